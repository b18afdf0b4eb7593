"""A session's records on disk: the attempt layout and reading run.json / exit.json. stdlib only.

    <run_dir>/<session>/attempt-<n>/{run.json, exit.json, stop.json, train.log, metrics.jsonl}
    <run_dir>/<session>/current -> attempt-<n>

Written by the runner (ops/far/runner.py), read by the agent and the release program's "is a run live" check.
"""

from __future__ import annotations

import json
import os
import re
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


def read_json(path: str) -> tuple[dict[str, t.Any] | None, str | None]:
    """(the record, None), (None, None) when there is none, or (None, why it cannot be read)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{path}: {e}"
    return (data, None) if isinstance(data, dict) else (None, f"{path}: not a JSON object")


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
