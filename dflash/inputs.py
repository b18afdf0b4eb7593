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

A UTF-8 byte order mark (``BOM``, what Windows editors put first) at the start of a file a user gives us is
the file's encoding mark, never content: every reader drops it (``without_bom``: ``loads``, ``read_text``,
``read_json``, ``head``, the run config), so the same bytes get the same answer from every command.

``loads`` raises ``JsonProblem`` with a ``reason`` (``bad-json`` or ``bad-text``, the drop reasons of the
corpus commands) and a message; callers say where (file, line) in their own words. ``open_regular`` opens a
path only when it is a regular file (a FIFO would block the read forever, a folder fails later).

A JSON object a file holds is read field by field through a ``Record`` (``read_record``): each field taken
is checked for its type and range when taken (a missing key, ``"6"`` for a count, a negative size, a huge
string), and a bad one is a ``RecordError`` naming the file and the key path (``meta.json: counts.sequences
is "x", expected an integer >= 0``): one line, never a traceback, never a figure read wrong. Files another
process, an older version, a crash or a person could have written (a store's meta.json, checkpoint.json,
best.json, a model's config.json, a corpus part's part.json) go through it.
"""

from __future__ import annotations

import dataclasses
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
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


@t.overload
def without_bom(data: bytes) -> bytes: ...
@t.overload
def without_bom(data: str) -> str: ...
def without_bom(data: bytes | str) -> bytes | str:
    """``data`` without a leading UTF-8 byte order mark (a file's first bytes, or its text)."""
    if isinstance(data, bytes):
        return data[len(BOM) :] if data.startswith(BOM) else data
    return data[1:] if data.startswith("\ufeff") else data


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
    data = without_bom(data)
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
    data = without_bom(read_bytes(path, what))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what}: {path} is not UTF-8 text (byte {e.start})") from None


def head(path: str | os.PathLike[str], size: int = 4096) -> bytes:
    """A file's first ``size`` bytes without a BOM and leading white space: what says a JSON array from JSON
    lines (``[`` first) or an empty file."""
    with open(path, "rb") as f:
        return without_bom(f.read(size)).lstrip()


def read_json(path: str | os.PathLike[str], what: str) -> t.Any:
    """A small JSON file a user names (a report, a config.json): regular, bounded, finite, text."""
    data = read_bytes(path, what, max_bytes=MAX_JSON_FILE_BYTES)
    try:
        return loads(data)
    except JsonProblem as e:
        raise InputFileError(
            f"{what}: {path} is {'not text' if e.reason == 'bad-text' else 'not JSON'} ({e.detail})"
        ) from None


MAX_FIELD_CHARS = 4096  # a text field of a record: a name, a hash, a path; far above any we write
_MISSING: t.Any = object()


class RecordError(InputError, ValueError):
    """A field of a JSON file is missing or not what it should be: one line naming the file and the key."""


def show(v: t.Any, limit: int = 60) -> str:
    """A value as a message quotes it: JSON, cut to ``limit`` characters (a huge value is not printed whole)."""
    try:
        text = json.dumps(v, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = type(v).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(v: t.Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Record:
    """A JSON object read from ``where`` (a file; ``prefix`` the key path of a nested object in it). Each
    accessor checks the field it takes; ``default`` (when given) stands for a missing key or null."""

    data: t.Mapping[str, t.Any]
    where: str
    prefix: str = ""

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def bad(self, name: str, expected: str) -> t.NoReturn:
        got = "missing" if name not in self.data else f"is {show(self.data[name])}"
        raise RecordError(f"{self.where}: {self.key(name)} {got}, expected {expected}")

    def _get(self, name: str) -> t.Any:
        v = self.data.get(name)
        return _MISSING if v is None else v

    def integer(self, name: str, *, lo: int | None = None, hi: int | None = None, default: t.Any = _MISSING) -> t.Any:
        v = self._get(name)
        if v is _MISSING and default is not _MISSING:
            return default
        expected = "an integer" + (f" >= {lo}" if lo is not None and hi is None else "")
        expected += f" in {lo}..{hi}" if lo is not None and hi is not None else f" <= {hi}" if hi is not None else ""
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            self.bad(name, expected)
        return v

    def number(self, name: str, *, lo: float | None = None, default: t.Any = _MISSING) -> t.Any:
        v = self._get(name)
        if v is _MISSING and default is not _MISSING:
            return default
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (lo is not None and v < lo):
            self.bad(name, "a finite number" + (f" >= {lo:g}" if lo is not None else ""))
        return float(v)

    def text(self, name: str, *, max_chars: int = MAX_FIELD_CHARS, default: t.Any = _MISSING) -> t.Any:
        v = self._get(name)
        if v is _MISSING and default is not _MISSING:
            return default
        if not isinstance(v, str) or len(v) > max_chars or text_problem(v) is not None:
            self.bad(name, f"a string (at most {max_chars} characters)")
        return v

    def texts(self, name: str, *, max_items: int = 256, default: t.Any = _MISSING) -> t.Any:
        """A non-empty list of strings."""
        v = self._get(name)
        if v is _MISSING and default is not _MISSING:
            return default
        ok = isinstance(v, list) and 0 < len(v) <= max_items
        if not ok or not all(isinstance(x, str) and 0 < len(x) <= MAX_FIELD_CHARS for x in v):
            self.bad(name, "a non-empty list of strings")
        return list(v)

    def record(self, name: str, *, default: t.Any = _MISSING) -> t.Any:
        """A nested object, as a Record whose keys are named ``name.KEY``."""
        v = self._get(name)
        if v is _MISSING and default is not _MISSING:
            return default
        if not isinstance(v, dict):
            self.bad(name, "a JSON object")
        return Record(v, self.where, f"{self.key(name)}.")


def as_record(value: t.Any, where: str) -> Record:
    """``value`` (a parsed JSON file) as a Record; RecordError when it is not a JSON object."""
    if not isinstance(value, dict):
        raise RecordError(f"{where}: expected a JSON object, got {show(value, 20)}")
    return Record(value, where)


def read_record(path: str | os.PathLike[str], what: str | None = None) -> Record:
    """A small JSON file holding one object (``read_json``), as a Record named by its path. A file that is
    missing, unreadable, not JSON or no object: InputFileError / RecordError, one line naming it."""
    return as_record(read_json(path, what or str(path)), str(path))


__all__ = [
    "MAX_DEPTH",
    "MAX_FIELD_CHARS",
    "Record",
    "RecordError",
    "as_record",
    "read_record",
    "show",
    "MAX_JSON_FILE_BYTES",
    "InputFileError",
    "JsonProblem",
    "loads",
    "BOM",
    "head",
    "without_bom",
    "open_regular",
    "read_bytes",
    "read_json",
    "read_text",
    "text_problem",
]
