"""Key paths: the checks of one hosts.toml value, each raising a ``ConfigError`` that names the full key
path it read (``hosts.pve.port: expected an integer, got "x"``). Shared by hosts.py and group.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import typing as t
from pathlib import Path

from ops.errors import ConfigError

MAX_COMMAND = 64 * 1024  # characters of `command`/`pct`: Linux allows 128 KiB for one argv item
SHOW_MAX = 120  # characters of a bad value quoted in an error message
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def show(value: t.Any) -> str:
    """A value in a message: JSON (one line, escapes shown), cut to SHOW_MAX characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= SHOW_MAX else f"{text[:SHOW_MAX]}... ({len(text)} characters)"


def only_keys(table: dict[str, t.Any], allowed: set[str], prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}", "unknown key")


def string(value: t.Any, path: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"expected a string, got {show(value)}")
    if nonempty and not value.strip():
        raise ConfigError(path, "must not be empty")
    return value


def integer(value: t.Any, path: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {show(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"{minimum if minimum is not None else '-inf'}..{maximum if maximum is not None else 'inf'}"
        raise ConfigError(path, f"expected an integer in {bounds}, got {value}")
    return value


def number(value: t.Any, path: str, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(path, f"expected a number of seconds, got {show(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"expected at least {minimum:g}, got {value}")
    return float(value)


def env_name(value: t.Any, path: str) -> str:
    name = string(value, path, nonempty=True)
    if not ENV_NAME.fullmatch(name):
        raise ConfigError(
            path,
            f"not a valid environment variable name (letters, digits, '_'; not starting with a digit), got {show(name)}",
        )
    return name


def argv(value: t.Any, path: str) -> tuple[str, ...]:
    """A command: a string split with shlex (``"sudo pct"``) or a list of strings."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if sum(len(v) for v in value) > MAX_COMMAND:
            raise ConfigError(path, f"too long: {sum(len(v) for v in value)} characters (at most {MAX_COMMAND})")
        return tuple(value)
    if isinstance(value, str):
        if len(value) > MAX_COMMAND:  # shlex.split is slow on huge strings: minutes for 10 MB
            raise ConfigError(path, f"too long: {len(value)} characters (at most {MAX_COMMAND})")
        try:
            argv = shlex.split(value)
        except ValueError as e:
            raise ConfigError(path, f"cannot split into words: {e}") from e
        if argv:
            return tuple(argv)
    raise ConfigError(path, f"expected a non-empty command (string or list of strings), got {show(value)}")


def local_path(value: t.Any, path: str, base: Path) -> str:
    text = string(value, path, nonempty=True)
    p = Path(text).expanduser()
    # normpath, not resolve(): a venv's bin/python is a symlink that must stay one.
    return os.path.normpath(p if p.is_absolute() else base / p)


# One rule for session and tmux socket names, wherever they come from (hosts.toml, --session): a
# tmux target (no ':' or '.'), a folder name, an argv item (never starting with '-'), ASCII only.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
NAME_RULE = "letters, digits, '-', '_' only (ASCII, 1 to 64, not starting with '-')"


def valid_name(value: str) -> bool:
    return _NAME.fullmatch(value) is not None


def check_name(value: str, path: str) -> str:
    """``value`` when it is a valid session / socket name, else a ConfigError naming ``path``."""
    if not valid_name(value):
        raise ConfigError(path, f"use {NAME_RULE}, got {show(value)}")
    return value


def _has_control(value: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)


def ssh_word(value: str, path: str) -> None:
    """address and user end up as ssh's destination argument: never an option, never two words."""
    if value.startswith("-"):
        raise ConfigError(path, f"must not start with '-' (ssh would read it as an option), got {show(value)}")
    if _has_control(value) or any(c.isspace() for c in value):
        raise ConfigError(path, f"must not contain spaces or control characters, got {show(value)}")


def ssh_path(value: str, path: str) -> None:
    """identity_file, known_hosts, ssh_config: also written into ssh options (``attach``)."""
    if _has_control(value):
        raise ConfigError(path, f"must not contain control characters, got {show(value)}")
    if "${" in value:
        raise ConfigError(
            path, f"must not contain '${{' (ssh would expand it as an environment variable), got {show(value)}"
        )
