"""The NVIDIA driver's lines (NVRM) of this machine's kernel log since a time: where Xid errors are
written (docs/design.md section 6, cause ``gpu-fault``). The one place that runs journalctl or dmesg.

Never raises: no journalctl and no dmesg, a permission refused (an LXC container usually may not read
the kernel's ring buffer) or a timeout is no evidence, said in ``error``. stdlib only.

The log is streamed, never held: an Xid storm is hundreds of MB of one line repeated, read at every probe
of a crashed run. journalctl is asked for the NVRM lines only; what comes is read line by line, the NVRM
lines kept, and the reading stops at a cap (lines read, bytes read, time), the reader killed.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import tempfile
import threading
import typing as t

TIMEOUT = 10.0
MAX_LINES = 50  # the first Xid is the cause: what follows it repeats it
MAX_OTHERS = 8  # past those, the first line of each other device: one GPU's storm must not hide another's Xid
MAX_CHARS = 400
MAX_READ_BYTES = 16 << 20  # of the reader's output: bounds the time a storm costs (memory is one line)
MAX_READ_LINES = 50_000  # the same for a storm of short lines
_LINE_BYTES = 4096  # one read; a longer line is cut, its rest skipped


def _run(argv: list[str], keep: t.Callable[[str], bool] = lambda _: True) -> tuple[int, list[str], str]:
    """(exit code, the NVRM lines ``keep`` accepts, the end of stderr). Reads at most the caps; a reader
    stopped early by them is killed (by its pid) and counts as exit 0: what it said so far is its answer."""
    try:
        err_file = tempfile.TemporaryFile()
    except OSError as e:
        return -1, [], f"{argv[0]}: {e.strerror}"
    with err_file:
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_file)
        except OSError as e:
            return -1, [], f"{argv[0]}: {e.strerror}"
        late = threading.Event()

        def _late() -> None:
            late.set()
            p.kill()

        timer = threading.Timer(TIMEOUT, _late)
        timer.start()
        out = t.cast(t.IO[bytes], p.stdout)
        try:
            lines, stopped = _scan(out, keep)
            if stopped:  # a cap stopped the reading: the rest is not wanted, nor its writer
                p.kill()
        finally:
            timer.cancel()
            out.close()
            code = p.wait()
        err_file.seek(0, 2)
        err_file.seek(max(0, err_file.tell() - 4096))
        err = err_file.read().decode("utf-8", "replace")
    if late.is_set() and not lines:
        return -1, [], f"{argv[0]} did not answer within {TIMEOUT:g}s"
    return (0 if stopped or late.is_set() else code), lines, err


def _scan(out: t.IO[bytes], keep: t.Callable[[str], bool]) -> tuple[list[str], bool]:
    """(the NVRM lines ``keep`` accepts, whether a cap stopped the reading before the end): the first
    ``MAX_LINES``, then the first of each device not seen yet."""
    lines: list[str] = []
    seen: set[bytes] = set()
    others = read_bytes = read_lines = 0
    whole = True  # the last piece read ended its line
    while read_bytes < MAX_READ_BYTES and read_lines < MAX_READ_LINES and others < MAX_OTHERS:
        piece = out.readline(_LINE_BYTES)
        if not piece:
            return lines, False
        read_bytes += len(piece)
        head, whole = whole, piece.endswith(b"\n")
        if not head:  # the rest of a cut line
            continue
        read_lines += 1
        if b"NVRM" not in piece:
            continue
        text = piece.decode("utf-8", "replace").rstrip()[:MAX_CHARS]
        if not keep(text):
            continue
        dev = _device(piece)
        if len(lines) < MAX_LINES:
            lines.append(text)
        elif dev is not None and dev not in seen:
            lines.append(text)
            others += 1
        if dev is not None:
            seen.add(dev)
    return lines, True


def _device(line: bytes) -> bytes | None:
    # `NVRM: Xid (PCI:0000:41:00): 13, ...`: what the driver names the GPU by
    start = line.find(b"Xid (")
    end = line.find(b")", start + 5) if start >= 0 else -1
    return line[start + 5 : end] if end >= 0 else None


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
        # the journal filters for us where it can; one built without pattern matching refuses --grep
        code, lines, err = _run([*argv, "--grep", "NVRM"])
        if code != 0 and not lines and ("pattern" in err.lower() or "option" in err.lower()):
            code, lines, err = _run(argv)
        if code == 0 and lines:
            return {"source": "journalctl", "lines": lines, "error": None}
        # exit 0 and nothing: no journal here (a container's journald keeps no kernel lines), or no Xid
        # (journalctl --grep exits 1 when nothing matched: that is an answer too)
        if _no_match(code, err):
            return {"source": "journalctl", "lines": [], "error": None}
        if code != 0 or "No journal files" in err or "insufficient permissions" in err:
            problems.append(f"journalctl: {(err.strip() or f'exit {code}').splitlines()[-1][:200]}")
        elif code == 0:
            return {"source": "journalctl", "lines": [], "error": None}
    exe = shutil.which("dmesg")
    if exe is None:
        problems.append("no journalctl or dmesg")
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    # dmesg cannot be asked for a time span: its own stamps decide, before the caps count a line
    code, lines, err = _run([exe, "--time-format", "iso"], lambda x: (_dmesg_time(x) or 0.0) >= since)
    if code != 0:
        problems.append(f"dmesg: {(err.strip() or f'exit {code}').splitlines()[-1][:200]}")
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    return {"source": "dmesg", "lines": lines, "error": None}


def _no_match(code: int, err: str) -> bool:
    # journalctl --grep mimics grep: exit 1, nothing on stderr, when no line matched
    return code == 1 and not err.strip()


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
