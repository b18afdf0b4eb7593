"""The NVIDIA driver's lines (NVRM) of this machine's kernel log since a time: where Xid errors are
written (docs/design.md section 6, cause ``gpu-fault``). The one place that runs journalctl or dmesg.

Never raises: no journalctl and no dmesg, a permission refused (an LXC container usually may not read
the kernel's ring buffer) or a timeout is no evidence, said in ``error``. stdlib only.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import typing as t

TIMEOUT = 10.0
MAX_LINES = 50  # the first Xid is the cause: what follows it repeats it
MAX_CHARS = 400


def _run(argv: list[str]) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return -1, "", f"{argv[0]} did not answer within {TIMEOUT:g}s"
    except OSError as e:
        return -1, "", f"{argv[0]}: {e.strerror}"
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def _nvrm(text: str, since: float | None = None) -> list[str]:
    lines = [line.rstrip()[:MAX_CHARS] for line in text.splitlines() if "NVRM" in line]
    if since is not None:  # dmesg cannot be asked for a time span: its own stamps decide
        lines = [x for x in lines if (_dmesg_time(x) or 0.0) >= since]
    return lines[:MAX_LINES]


def _dmesg_time(line: str) -> float | None:
    # `dmesg --time-format iso`: 2026-12-02T00:01:02,123456+00:00 NVRM: ...
    stamp = line.split(" ", 1)[0].replace(",", ".")
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def read(since: float) -> dict[str, t.Any]:
    """``{"source": "journalctl" | "dmesg" | None, "lines": [...], "error": str | None}``: the NVRM lines
    logged since ``since`` (epoch seconds). journalctl first (the journal keeps what the ring buffer
    dropped), then dmesg."""
    problems: list[str] = []
    exe = shutil.which("journalctl")
    if exe is not None:
        argv = [exe, "-k", "--since", f"@{int(since)}", "-o", "short-iso", "--no-pager"]
        code, out, err = _run(argv)
        lines = _nvrm(out)
        if code == 0 and lines:
            return {"source": "journalctl", "lines": lines, "error": None}
        # exit 0 and nothing: no journal here (a container's journald keeps no kernel lines), or no Xid
        if code != 0 or "No journal files" in err or "insufficient permissions" in err:
            problems.append(f"journalctl: {(err.strip() or f'exit {code}').splitlines()[-1][:200]}")
        elif code == 0:
            return {"source": "journalctl", "lines": [], "error": None}
    exe = shutil.which("dmesg")
    if exe is None:
        problems.append("no journalctl or dmesg")
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    code, out, err = _run([exe, "--time-format", "iso"])
    if code != 0:
        problems.append(f"dmesg: {(err.strip() or f'exit {code}').splitlines()[-1][:200]}")
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    return {"source": "dmesg", "lines": _nvrm(out, since), "error": None}


def since_failed(attempt: t.Any) -> float | None:
    """When the attempt started, if it ended non-zero (exit.json): the kernel log is read for a crash
    only, from the attempt's start on (an older Xid belongs to another run). None otherwise."""
    if not isinstance(attempt, dict):
        return None
    run, ended = attempt.get("run"), attempt.get("exit")
    if not isinstance(run, dict) or not isinstance(ended, dict) or ended.get("exit_code") == 0:
        return None
    started = run.get("started_ts")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or started != started:
        return None
    return float(started)


def of_failed(attempt: t.Any) -> t.Any:
    """``read`` from the attempt's start, for an attempt that ended non-zero; None for any other."""
    since = since_failed(attempt)
    return None if since is None else read(since)
