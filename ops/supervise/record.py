"""The host supervisor's own files (service.json, env.json, status.json, its incidents), read through one
checked reader: a file someone edited, an older version wrote or a crash cut short is one line naming the
file and the key, never a traceback and never a value of the wrong kind passed on. Stdlib only.
"""

from __future__ import annotations

import json
import math
import typing as t

MAX_BYTES = 1 << 20  # a record bigger than this is not ours


class BadRecord(Exception):
    """``<path>: <key>: <what is wrong>`` (one line)."""


def _no_constant(name: str) -> t.Any:
    raise ValueError(f"{name} is not a number JSON allows")


def load(path: str) -> dict[str, t.Any] | None:
    """The JSON object in ``path``; None when there is no such file. Too big, not JSON, deeper than
    Python's recursion allows, NaN/Infinity, or not an object: BadRecord."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadRecord(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise BadRecord(f"{path}: bigger than {MAX_BYTES >> 20} MiB: not a record of dflashctl's")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRecord(f"{path}: not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise BadRecord(f"{path}: nested too deeply") from None
    if not isinstance(doc, dict):
        raise BadRecord(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


Kind = type | tuple[type, ...]


def field(doc: t.Mapping[str, t.Any], path: str, key: str, kind: Kind, *, required: bool = True) -> t.Any:
    """``doc[key]`` of ``kind`` (bool is no int; a float must be finite), or BadRecord naming file and key."""
    if key not in doc or doc[key] is None:
        if required:
            raise BadRecord(f"{path}: {key}: missing")
        return None
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise BadRecord(f"{path}: {key}: expected {want}, got {_show(value)}")
    return value


def strings(doc: t.Mapping[str, t.Any], path: str, key: str) -> list[str]:
    """A list of strings (missing: empty)."""
    value = field(doc, path, key, list, required=False) or []
    if not all(isinstance(v, str) for v in value):
        raise BadRecord(f"{path}: {key}: expected a list of strings")
    return list(value)


def string_map(doc: t.Mapping[str, t.Any], path: str, key: str) -> dict[str, str]:
    """An object of strings (missing: empty)."""
    value = field(doc, path, key, dict, required=False) or {}
    if not all(isinstance(v, str) for v in value.values()):
        raise BadRecord(f"{path}: {key}: expected an object of strings")
    return dict(value)


def _show(value: t.Any) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, float) else repr(value)
    except (ValueError, RecursionError):
        text = "..."
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
