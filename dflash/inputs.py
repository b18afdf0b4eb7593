"""What a user hands dflash, read one way: files that are regular files, JSON that is bounded and text
that a tokenizer can encode.

Every JSON a user gives us (a JSONL line, a JSON-array input, eval prompts, an ``--eval`` report, a drafter's
config.json, a server's answer) goes through ``loads``:

- nesting deeper than ``MAX_DEPTH`` is refused (Python's parser raises RecursionError near 1000 levels, and
  code that walks or re-encodes a value nested just below that fails later instead);
- ``NaN`` and ``Infinity`` (which Python's parser accepts, JSON does not) are refused: a tau of NaN is not a
  figure;
- a string holding a lone surrogate (``"\\ud800"``: an emoji cut in half) is refused: it is valid JSON but
  not text, and a tokenizer fails on it with a TypeError (``bad-text``).

``loads`` raises ``JsonProblem`` with a ``reason`` (``bad-json`` or ``bad-text``, the drop reasons of the
corpus commands) and a message; callers say where (file, line) in their own words. ``open_regular`` opens a
path only when it is a regular file (a FIFO would block the read forever, a folder fails later).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import typing as t
from pathlib import Path

from dflash.errors import InputError

MAX_DEPTH = 200  # nesting levels of a JSON value: far above any record, report or config
MAX_JSON_FILE_BYTES = 64 << 20  # a report or config.json larger than this is not one

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON can spell a surrogate only as an escape
_CONTAINERS = (dict, list)


class JsonProblem(InputError, ValueError):
    """Not usable JSON: ``reason`` is ``bad-json`` (not JSON, too deep, NaN) or ``bad-text`` (not text);
    the message is "not valid JSON: DETAIL" or "not text: DETAIL". Callers catch it and say where (file,
    line); under the error root all the same (exit 2) should one ever reach ``main``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{'not text' if reason == 'bad-text' else 'not valid JSON'}: {detail}")
        self.reason = reason
        self.detail = detail


class InputFileError(InputError, ValueError):
    """A file a user named cannot be read as what it should be: one line naming it (exit 2)."""


def _no_constant(name: str) -> t.NoReturn:
    raise JsonProblem("bad-json", f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    x = float(text)
    if math.isinf(x):  # 1e400: valid JSON, but no finite number
        raise JsonProblem("bad-json", f"{text} is out of range")
    return x


def text_problem(s: str) -> str | None:
    """Why ``s`` is not text a tokenizer can encode (a lone surrogate), or None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate ({s[e.start]!r}) at character {e.start}"
    return None


def _walk(value: t.Any, max_depth: int) -> None:
    """Depth and text of a parsed value, without recursion (a deep value must not overflow our stack)."""
    stack: list[tuple[t.Any, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            problem = text_problem(v)
            if problem:
                raise JsonProblem("bad-text", f"{problem} in {where or 'the value'}")
            continue
        if not isinstance(v, _CONTAINERS):
            continue
        if depth > max_depth:
            raise JsonProblem("bad-json", f"nested too deeply (over {max_depth} levels)")
        if isinstance(v, dict):
            for k, x in v.items():
                sub = f"{where}.{k}" if where else str(k)
                problem = text_problem(k)
                if problem:
                    raise JsonProblem("bad-text", f"{problem} in a key of {where or 'the value'}")
                if isinstance(x, (str, *_CONTAINERS)):
                    stack.append((x, depth + 1, sub))
        else:
            for i, x in enumerate(v):
                if isinstance(x, (str, *_CONTAINERS)):
                    stack.append((x, depth + 1, f"{where}[{i}]"))


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> t.Any:
    """``json.loads`` for what a user hands us: bounded, finite and text (module doc). JsonProblem if not."""
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise JsonProblem("bad-json", "nested too deeply") from None
    except UnicodeDecodeError as e:
        raise JsonProblem("bad-json", f"not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JsonProblem("bad-json", str(e)) from None
    if not isinstance(value, _CONTAINERS) and not isinstance(value, str):
        return value
    raw = data if isinstance(data, bytes) else None
    if raw is None:
        try:
            raw = data.encode("utf-8")  # type: ignore[union-attr]
        except UnicodeEncodeError:
            raw = b"\\ud800"  # the text itself holds a surrogate: walk it
    # the fast path (most records): no escaped surrogate and fewer brackets than levels allowed
    deep = raw.count(b"[") + raw.count(b"{") > max_depth
    if deep or _ESCAPED_SURROGATE.search(raw):
        _walk(value, max_depth)
    return value


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only fd of ``path`` when it is a regular file; InputFileError (one line) otherwise. Opened
    non-blocking, so a FIFO is refused instead of waiting for a writer."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InputFileError(f"{what}: cannot read {p}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise InputFileError(f"{what}: {p} is {kind}; expected a file")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: str | os.PathLike[str], what: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file (``open_regular``), at most ``max_bytes`` (InputFileError beyond)."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as e:
            raise InputFileError(f"{what}: cannot read {path}: {e.strerror}") from None
    if max_bytes is not None and len(data) > max_bytes:
        raise InputFileError(f"{what}: {path} is larger than {max_bytes >> 20} MiB")
    return data


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """A regular file as UTF-8 text (InputFileError, one line, when it is not)."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what}: {path} is not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike[str], what: str) -> t.Any:
    """A small JSON file a user names (a report, a config.json): regular, bounded, finite, text."""
    data = read_bytes(path, what, max_bytes=MAX_JSON_FILE_BYTES)
    try:
        return loads(data)
    except JsonProblem as e:
        raise InputFileError(
            f"{what}: {path} is {'not text' if e.reason == 'bad-text' else 'not JSON'} ({e.detail})"
        ) from None


__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_FILE_BYTES",
    "InputFileError",
    "JsonProblem",
    "loads",
    "open_regular",
    "read_bytes",
    "read_json",
    "read_text",
    "text_problem",
]
