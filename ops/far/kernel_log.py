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
import typing as t

TIMEOUT = 10.0
MAX_LINES = 50  # the first Xid is the cause: what follows it repeats it
MAX_OTHERS = 8  # past those, the first line of each other device: one GPU's storm must not hide another's Xid
MAX_CHARS = 400
MAX_READ_BYTES = 16 << 20  # of the reader's output: bounds the time a storm costs (memory is one line)
MAX_READ_LINES = 50_000  # the same for a storm of short lines
# dmesg prints the whole ring buffer, oldest first, the attempt's lines last: it is read to its end (the
# kernel caps the ring at 32 MiB), these caps only guard against a reader that never stops
DMESG_READ_BYTES = 64 << 20
DMESG_READ_LINES = 1_000_000
_LINE_BYTES = 4096  # one read; a longer line is cut, its rest skipped


class _Read(t.NamedTuple):
    """One reader's answer: its exit code (0 when the caps stopped it), the NVRM lines kept, the end of
    its stderr, and whether a cap stopped the reading before the end."""

    code: int
    lines: list[str]
    err: str
    capped: bool = False

    def problem(self, name: str) -> str:
        if self.capped and not self.lines:  # a later Xid would be unseen: not "no Xid"
            return f"{name}: stopped at the cap of what is read, no NVRM line before it"
        return f"{name}: {(self.err.strip() or f'exit {self.code}').splitlines()[-1][:200]}"


def _run(
    argv: list[str],
    keep: t.Callable[[str], bool] = lambda _: True,
    max_lines: int = MAX_READ_LINES,
    max_bytes: int = MAX_READ_BYTES,
) -> _Read:
    """The NVRM lines ``keep`` accepts of what ``argv`` prints. Reads at most the caps; a reader stopped
    early by them is killed (by its pid) and counts as exit 0: what it said so far is its answer."""
    # here, not at the top: every status probe imports this module, only a crashed run's reads the log
    import subprocess
    import tempfile
    import threading

    try:
        err_file = tempfile.TemporaryFile()
    except OSError as e:
        return _Read(-1, [], f"{argv[0]}: {e.strerror}")
    with err_file:
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_file)
        except OSError as e:
            return _Read(-1, [], f"{argv[0]}: {e.strerror}")
        late = threading.Event()

        def _late() -> None:
            late.set()
            p.kill()

        timer = threading.Timer(TIMEOUT, _late)
        timer.start()
        out = t.cast(t.IO[bytes], p.stdout)
        try:
            lines, stopped = _scan(out, keep, max_lines, max_bytes)
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
        return _Read(-1, [], f"{argv[0]} did not answer within {TIMEOUT:g}s")
    return _Read(0 if stopped or late.is_set() else code, lines, err, stopped)


def _scan(out: t.IO[bytes], keep: t.Callable[[str], bool], max_lines: int, max_bytes: int) -> tuple[list[str], bool]:
    """(the NVRM lines ``keep`` accepts, whether a cap stopped the reading before the end): the first
    ``MAX_LINES``, then the first of each device not seen yet."""
    lines: list[str] = []
    seen: set[bytes] = set()
    others = read_bytes = read_lines = 0
    whole = True  # the last piece read ended its line
    while read_bytes < max_bytes and read_lines < max_lines and others < MAX_OTHERS:
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
        dev = _device(piece)
        full = len(lines) >= MAX_LINES
        if full and (dev is None or dev in seen):  # a repeat, before the dearer work below
            continue
        text = piece.decode("utf-8", "replace").rstrip()[:MAX_CHARS]
        if not keep(text):
            continue
        lines.append(text)
        others += 1 if full else 0
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
        r = _run([*argv, "--grep", "NVRM"])
        if r.code != 0 and not r.lines and ("pattern" in r.err.lower() or "option" in r.err.lower()):
            r = _run(argv)
        if r.code == 0 and r.lines:
            return {"source": "journalctl", "lines": r.lines, "error": None}
        # exit 0 and nothing: no journal here (a container's journald keeps no kernel lines), or no Xid
        # (journalctl --grep exits 1 when nothing matched: that is an answer too)
        if _no_match(r.code, r.err):
            return {"source": "journalctl", "lines": [], "error": None}
        if r.code != 0 or r.capped or "No journal files" in r.err or "insufficient permissions" in r.err:
            problems.append(r.problem("journalctl"))
        else:
            return {"source": "journalctl", "lines": [], "error": None}
    exe = shutil.which("dmesg")
    if exe is None:
        problems.append("no journalctl or dmesg")
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    # dmesg cannot be asked for a time span: its own stamps decide, before the caps count a line
    r = _run(
        [exe, "--time-format", "iso"],
        lambda x: (_dmesg_time(x) or 0.0) >= since,
        DMESG_READ_LINES,
        DMESG_READ_BYTES,
    )
    if r.code != 0 or (r.capped and not r.lines):
        problems.append(r.problem("dmesg"))
        return {"source": None, "lines": [], "error": "; ".join(problems)}
    return {"source": "dmesg", "lines": r.lines, "error": None}


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
