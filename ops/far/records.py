"""A session's records on disk: the attempt layout and reading run.json / exit.json. stdlib only.

    <run_dir>/<session>/attempt-<n>/{run.json, exit.json, stop.json, train.log, metrics.jsonl}
    <run_dir>/<session>/current -> attempt-<n>

Written by the runner (ops/far/runner.py), read by the agent and the release program's "is a run live" check.
"""

from __future__ import annotations

import json
import os
import re
import time
import typing as t

from ops.far.atomic import switch_link

RUN_JSON = "run.json"
EXIT_JSON = "exit.json"
STOP_JSON = "stop.json"
LOG = "train.log"
METRICS = "metrics.jsonl"
CURRENT = "current"  # <run_dir>/<session>/current -> attempt-<n>

ENV_FILE = ".env.json"  # the run's environment: 0600, read and unlinked by the runner at once
STARTED_BY = ".started_by.json"  # who started the attempt and why: the runner puts it in run.json (`started_by`)
RUN_RESERVED = ".run.reserved"  # pre-allocated records, filled in place then renamed (a full disk
EXIT_RESERVED = ".exit.reserved"  # cannot stop them): -> run.json, -> exit.json

# The three processes of a run as run.json names them: (pid key, start-ticks key). The command first.
PROCESSES = (("child_pid", "child_start"), ("keeper_pid", "keeper_start"), ("pid", "pid_start"))


def attempt_name(n: int) -> str:
    return f"attempt-{n}"


def attempt_number(name: str) -> int | None:
    m = re.fullmatch(r"attempt-(\d+)", name)
    return int(m.group(1)) if m else None


def current_attempt(sdir: str) -> str | None:
    """The attempt dir `current` points to, else the highest attempt-<n>, else None."""
    link = os.path.join(sdir, CURRENT)
    if os.path.isdir(link):
        return os.path.join(sdir, os.readlink(link)) if os.path.islink(link) else link
    try:
        names = os.listdir(sdir)
    except OSError:
        return None
    numbered = [(attempt_number(name), name) for name in names if attempt_number(name) is not None]
    return os.path.join(sdir, max(numbered)[1]) if numbered else None


MAX_RECORD = 1 << 20  # bytes of one record: ours are a few KiB (run.json's room is RESERVE_BYTES)
MAX_SMALL = 64 << 10  # a heartbeat, a stop record
MAX_DEPTH = 16  # objects and lists within each other: ours go 4 deep
MAX_DIGITS = 30  # an integer's digits: pids, ticks, steps and byte counts all fit


def _no_constant(name: str) -> t.Any:
    raise ValueError(f"{name} is not a number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is out of range")
    return x


def depth(value: t.Any) -> int:
    """How deep lists and objects go in ``value`` (iterative: a deep one cannot exhaust the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                return deepest
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_record(raw: bytes) -> dict[str, t.Any]:
    """One record's bytes -> its object; ValueError (why, in a few words) for anything else: not JSON,
    not an object, NaN or Infinity, an out-of-range float, a huge integer, nested too deep."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if depth(data) > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} deep")
    return data


def parse_line(text: str) -> t.Any:
    """One line of a JSON lines file (metrics.jsonl): NaN passes (a diverged loss is a fact), a huge
    integer or a nesting deeper than the parser goes is ValueError."""
    try:
        return json.loads(text, parse_int=_int)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path: str, limit: int = MAX_RECORD) -> tuple[dict[str, t.Any] | None, str | None]:
    """(the record, None), (None, None) when there is none, or (None, why it cannot be read: one line
    naming the file). Never raises: whatever wrote the file (a crash, an older version, a person)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path}: {e.strerror or e}"
    if len(raw) > limit:
        return None, f"{path}: larger than {limit >> 10} KiB"
    try:
        return parse_record(raw), None
    except ValueError as e:
        return None, f"{path}: {str(e)[:200]}"


def run_key(run: t.Mapping[str, t.Any] | None) -> str | None:
    """Which run wrote an attempt dir: a dir removed and made again by another run gets another key."""
    if not run:
        return None
    return f"{run.get('started_at')}|{run.get('pid')}|{run.get('pid_start')}"


def next_attempt_dir(sdir: str) -> tuple[int, str]:
    """A new `attempt-<n>` dir, n one more than any there (made here: two starts never share one)."""
    os.makedirs(sdir, exist_ok=True)
    while True:
        numbers = [attempt_number(name) for name in os.listdir(sdir)]  # no := here: the release program is 3.7
        n = max([x for x in numbers if x is not None], default=0) + 1
        path = os.path.join(sdir, f"attempt-{n}")
        try:
            os.mkdir(path)  # atomic: two starts never share an attempt
        except FileExistsError:
            continue
        return n, path


def point_current(sdir: str, name: str) -> None:
    """`current -> attempt-<n>` switched atomically (relative symlink, then rename over)."""
    switch_link(sdir, CURRENT, name, tmp_prefix=".")


# --------------------------------------------------------------------------------------------
# One checked reader per kind: each key's type (null is always "not known"), strings cut, numbers in range.
# A key that fails is dropped and named (``<file>: <key>: ...``): a figure is right or absent, never wrong.

MAX_TEXT = 4096  # characters of one string kept (a message names a value, it does not archive it)
MAX_INT = 1 << 63
STARTED_BY_MAX = 2048  # bytes of started_by as JSON (what `start` accepts)
MAX_LIST = 64  # entries of a list kept (`command` words, `left` / `killed` members)

INT, NUM, STR, BOOL, STRS, DICT, DICTS, TIME = "int", "num", "str", "bool", "strs", "dict", "dicts", "time"
FIELDS = {
    RUN_JSON: {
        "session": STR,
        "attempt": INT,
        "pid": INT,
        "pid_start": INT,
        "child_pid": INT,
        "child_start": INT,
        "keeper_pid": INT,
        "keeper_start": INT,
        "tag": STR,
        "subreaper": BOOL,
        "started_at": TIME,
        "started_ts": NUM,
        "command": STRS,
        "cwd": STR,
        "release": STR,
        "start_id": STR,
        "container_boot": NUM,
        "container_boot_ticks": INT,
        "oom_kill": INT,
        "hostname": STR,
        "python": STR,
        "started_by": DICT,
    },
    EXIT_JSON: {
        "exit_code": INT,
        "signal": INT,
        "ended_at": TIME,
        "ended_ts": NUM,
        "oom_kill": INT,
        "oom_kill_before": INT,
        "disk_free": INT,
        "disk_full": BOOL,
        "left": DICTS,
        "killed": DICTS,
    },
    STOP_JSON: {
        "requested_at": TIME,
        "grace": NUM,
        "reason": STR,
        "by": STR,
        "killed": DICTS,
    },
}
_EXPECTED = {
    INT: "a whole number",
    NUM: "a number",
    STR: "a string",
    BOOL: "true or false",
    STRS: "a list of strings",
    DICT: "an object",
    DICTS: "a list of objects",
    TIME: "a time as 2026-11-29T15:02:11Z",
}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def fits(kind: str, value: t.Any) -> t.Any:
    """``value`` as ``kind`` keeps it (cut where it is long); raises ValueError when it is not one."""
    if kind == BOOL:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        pass
    elif kind == INT:
        if isinstance(value, int) and -MAX_INT < value < MAX_INT:
            return value
    elif kind == NUM:
        if isinstance(value, (int, float)) and -1e15 < value < 1e15:
            return value
    elif kind == STR:
        if isinstance(value, str):
            return _cut(value)
    elif kind == TIME:
        if isinstance(value, str) and len(value) == 20:
            try:
                time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
                return value
            except ValueError:
                pass
    elif kind == STRS:
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return [_cut(x) for x in value[:MAX_LIST]]
    elif kind == DICT:
        if isinstance(value, dict):
            if len(json.dumps(value)) > STARTED_BY_MAX:
                raise ValueError(f"larger than {STARTED_BY_MAX} bytes")
            return value
    elif kind == DICTS:
        if isinstance(value, list) and all(isinstance(x, dict) for x in value):
            return value[:MAX_LIST]
    raise ValueError(f"expected {_EXPECTED[kind]}")


def check(name: str, rec: t.Mapping[str, t.Any], path: str = "") -> tuple[dict[str, t.Any], list[str]]:
    """A record of kind ``name`` (run.json, exit.json, stop.json) with each known key checked: (the
    record with the failing keys dropped and long values cut, one line per failing key naming the file
    and the key). Unknown keys pass as they are (a newer runner's)."""
    fields = FIELDS.get(name, {})
    out: dict[str, t.Any] = {}
    problems = []
    for key, value in rec.items():
        kind = fields.get(key)
        if kind is None or value is None:
            out[key] = value
            continue
        try:
            out[key] = fits(kind, value)
        except ValueError as e:
            problems.append(f"{path or name}: {key}: {e}")
    return out, problems


def read_record(path: str) -> tuple[dict[str, t.Any] | None, list[str]]:
    """A run's record (run.json, exit.json, stop.json, by its file name) read and checked: (the record
    or None, what was wrong with it: one line each, naming the file and the key)."""
    rec, err = read_json(path)
    if rec is None:
        return None, [err] if err else []
    return check(os.path.basename(path), rec, path)
