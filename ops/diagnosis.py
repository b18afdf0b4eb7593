"""What a run's log tail says: why it ended (``diagnose``, the exception of its last traceback), how far
it got (the progress reading), the driver's words about a failed GPU (``find``: docs/design.md section 6,
cause ``gpu-fault``) and the trainer's divergence lines. Read by the probe, the supervisors, history and
plot.

Pure and stdlib only: the supervisor on the Proxmox host loads it.
"""

from __future__ import annotations

import dataclasses
import re
import signal as signal_mod
import time
import typing as t

from ops import wire
from ops.far import watch
from ops.states import Cause
from ops.workers import as_float, as_int

# --------------------------------------------------------------------------------------------
# The driver's words: a GPU that failed in hardware

# The Xids that mean the GPU itself failed (NVIDIA's Xid catalogue): a restart runs into the same GPU
# until it is reset or the machine rebooted. Application Xids (13, 31, 43...) are not here.
HARDWARE_XIDS: dict[int, str] = {
    48: "uncorrectable ECC error (double bit, DBE)",
    63: "ECC page retirement / row remapping recorded",
    64: "ECC page retirement / row remapping failed",
    79: "fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    154: "GPU recovery action required",
}

# `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.` (older drivers
# write no pid/name; some write the function `0000:00:01.0`)
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\): (?P<xid>\d+)\b"
)
# Xid 154 says which recovery the GPU needs; "to 0x0 (None)" is the all-clear, not a fault
_RECOVERY_NONE = re.compile(r"recovery action changed from 0x[0-9a-fA-F]{1,8} \([^()]{0,80}\) to 0x0 \(None\)")
# `NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.` and the multi-line form of newer drivers
# (`NVRM: The NVIDIA GPU 0000:b3:00.0 ... NVRM: fallen off the bus and is not responding to commands.`)
_FALLEN = re.compile(r"GPU has fallen off the bus|fallen off the bus and is not responding")
_BUS = re.compile(r"\b(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\b")
# A bus id given alone ([domain:]bus:device[.function], hex): the driver's 0000:b3:00.0, nvidia-smi's
# 00000000:B3:00.0, the Xid line's 0000:b3:00, a short b3:00 (a line is searched with _BUS: domain required)
_BUS_ID = re.compile(
    r"(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})(?:\.(?P<function>[0-7]))?",
    re.IGNORECASE,
)
# What CUDA tells the program (torch's `CUDA error: ...`, the driver API's enum name)
_ECC = re.compile(r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE")
# Also a bug's symptom: a hardware fault only with an Xid beside it
_LAUNCH = re.compile(r"CUDA error: unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED")
_GPU_TEXT = re.compile(r"\bGPU (\d+)\b|\bcuda:(\d+)\b")


@dataclasses.dataclass(frozen=True)
class Fault:
    """What the driver said: the Xid (None for a CUDA text without one), the PCI bus id it names, the
    GPU index where a text or nvidia-smi gives it, and the line it rests on."""

    line: str
    xid: int | None = None
    bus_id: str | None = None
    gpu: int | None = None

    @property
    def meaning(self) -> str:
        if self.xid is not None:
            return HARDWARE_XIDS.get(self.xid, "driver error")
        if _FALLEN.search(self.line):
            return HARDWARE_XIDS[79]
        if _ECC.search(self.line):
            return "uncorrectable ECC error"
        return "GPU fault"

    @property
    def text(self) -> str:
        """The driver's words without the kernel log's timestamp and host prefix."""
        at = self.line.find("NVRM:")
        return self.line[at:] if at > 0 else self.line

    @property
    def fingerprint(self) -> str:
        """The same GPU failing the same way matches itself across attempts."""
        what = f"xid {self.xid}" if self.xid is not None else self.meaning
        where = self.bus_id or (f"gpu {self.gpu}" if self.gpu is not None else "?")
        return f"gpu-fault|{what}|{where}"

    def phrase(self) -> str:
        """``Xid 79 (fallen off the bus) on GPU 3 (PCI 0000:3b:00)``"""
        what = f"Xid {self.xid} ({self.meaning})" if self.xid is not None else self.meaning
        where = [f"GPU {self.gpu}" if self.gpu is not None else None, f"PCI {self.bus_id}" if self.bus_id else None]
        if where[0] and where[1]:
            return f"{what} on {where[0]} ({where[1]})"
        return f"{what} on {where[0] or where[1]}" if where[0] or where[1] else what


def _bus(text: str) -> str:
    return text.lower()


def find(lines: t.Sequence[str]) -> Fault | None:
    """The first hardware fault the lines show (the first Xid is the cause; those after it follow from
    it), else a fallen-off-the-bus or uncorrectable-ECC text, else an unspecified launch failure beside
    any Xid. None when the lines show no GPU fault."""
    lines = capped(lines)
    xids: list[tuple[str, int, str]] = []  # (line, xid, bus) of every Xid line
    for line in lines:
        m = _XID.search(line)
        if m:
            xids.append((line.strip(), int(m.group("xid")), _bus(m.group("bus"))))
    for line, xid, bus in xids:
        if xid in HARDWARE_XIDS and not (xid == 154 and _RECOVERY_NONE.search(line)):
            return Fault(line, xid, bus, _gpu_in([line]))
    for line in lines:
        if _FALLEN.search(line) or _ECC.search(line):
            m = _BUS.search(line) if "NVRM" in line else None
            return Fault(line.strip(), None, _bus(m.group("bus")) if m else None, _gpu_in([line]))
    launch = [line.strip() for line in lines if _LAUNCH.search(line)]
    if launch and xids:
        line, xid, bus = xids[0]
        return Fault(launch[-1], xid, bus, _gpu_in(launch))
    return None


def _gpu_in(texts: t.Iterable[str]) -> int | None:
    for text in texts:
        if "NVRM" in text:
            continue  # the driver's `GPU0` of a GSP line is not an index the program sees
        m = _GPU_TEXT.search(text)
        if m:
            return int(next(g for g in m.groups() if g is not None))
    return None


_PID = re.compile(r"\bpid=(\d{1,10})\b")


def pid_of(line: str) -> int | None:
    """The process an NVRM Xid line names (``pid=1234``), None when it names none (``'<unknown>'``)."""
    m = _PID.search(line[:LINE_CAP])
    return int(m.group(1)) if m else None


def bus_id(text: str | None) -> str | None:
    """A PCI bus id as the driver writes it (``0000:b3:00.0``), from any of its forms; None for what is not
    one. A short form gets domain 0000 and function 0 (a GPU is function 0 of its PCI device)."""
    m = _BUS_ID.fullmatch((text or "").strip())
    if m is None:
        return None
    domain = int(m.group("domain") or "0", 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('device'), 16):02x}.{m.group('function') or 0}"


def bus_key(text: str) -> tuple[int, int, int] | None:
    """The bus id a line names (``0000:3b:00``, the driver's; ``00000000:3B:00.0``, nvidia-smi's) as
    (domain, bus, device); None when it names none."""
    m = _BUS.fullmatch(text.strip()) or _BUS.search(text)
    full = bus_id(m.group(0)) if m else None
    if full is None:
        return None
    domain, bus, device = full.split(".")[0].split(":")
    return int(domain, 16), int(bus, 16), int(device, 16)


# --------------------------------------------------------------------------------------------
# The trainer's divergence lines

# the whole line, as dflash's __main__ prints it (one line, no logger prefix)
_DIVERGED = re.compile(
    r"dflash: (?P<what>diverged at step (?P<step>\d{1,12}): (?P<figure>[a-z -]{1,40}) not finite(?: \([^();]{0,200}\))?; "
    r"last finite checkpoint: (?P<last>[^;]{1,1000}?))\s*"
)
_LAST = re.compile(r"last finite checkpoint: ([^;]{1,1000})$")


def diverged_line(lines: t.Sequence[str], exit_code: int | None) -> tuple[str, str] | None:
    """The trainer's own verdict: its exit code 3 (dflash.errors' EXIT_DIVERGED) with the diverged line
    as the log's last line: (what it says without ``dflash: ``, the line), or None. The same text
    printed anywhere else, or before another end, is a user's text."""
    if exit_code != EXIT_DIVERGED:
        return None
    last = next((x for x in reversed(capped(lines)) if x.strip()), None)
    m = _DIVERGED.fullmatch(last.strip()) if last is not None else None
    return (m.group("what"), m.group(0)) if m else None


def disk_full_line(lines: t.Sequence[str], exit_code: int | None) -> str | None:
    """The trainer's own verdict on a last checkpoint it could not write: exit 4 (dflash.errors'
    EXIT_DISK_FULL) with its ``dflash: disk full: ...`` line as the log's last line, or None."""
    if exit_code != EXIT_DISK_FULL:
        return None
    last = next((x.strip() for x in reversed(capped(lines)) if x.strip()), None)
    return last if last is not None and last.startswith("dflash: disk full: ") else None


# dflash train's one line when DFLASH_EXCLUDED_GPUS leaves a role without devices (dflash.train.devices), exit 1
_NO_DEVICES = re.compile(r"dflash: DFLASH_EXCLUDED_GPUS=\S{1,2000} leaves no (?:target|drafter) device of .{0,2000}")


def no_devices_left(detail: str | None, exit_code: int | None) -> bool:
    """The trainer refused to start: the excluded GPUs leave no target or no drafter device (its exit 1 with
    that line last: a ``nonzero-exit``'s detail)."""
    return exit_code == 1 and detail is not None and _NO_DEVICES.fullmatch(detail.strip()) is not None


def spike_line(s: wire.Spike) -> str:
    """A loss-spike record as the trainer's own warning line says it (dflash.train.divergence.Spike.line)."""
    return (
        f"loss spike at step {s.step}: loss {s.loss or 0:.3f} above {s.factor or 0:g} x the running "
        f"median {s.median or 0:.3f} for {s.steps} steps"
    )


def last_finite_checkpoint(detail: str | None) -> str | None:
    """The checkpoint a diverged line names as the last finite one (None: ``none``, or no such line)."""
    m = _LAST.search(detail or "")
    return m.group(1).strip() if m and m.group(1).strip() != "none" else None


# --------------------------------------------------------------------------------------------
# Reading a log tail: what killed the run, how far it got


@dataclasses.dataclass(slots=True)
class Progress:
    step: int | None
    loss: float | None
    ktok_s: float | None
    at: str | None


LINE_CAP = 2000  # characters of one line any pattern here reads: the trainer's own lines are shorter
EXIT_DIVERGED = 3  # dflash.errors: the trainer's exit code for a non-finite update (Diverged)
EXIT_DISK_FULL = 4  # dflash.errors: the run's last checkpoint could not be written (DiskFull)
_RECOVERED = "retrying once with the batch halved"  # the trainer's CUDA OOM it recovered from (pipeline.py)
_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torchrun's per-rank prefixes
_CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_GPU = re.compile(r"\bGPU (\d+)\b|\bcuda:(\d+)\b|\bdevice (\d+)\b")
_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out")
_NCCL_ERROR = re.compile(
    r"NCCL error|DistBackendError|ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclRemoteError"
    r"|ncclInvalidUsage|Some NCCL operations have failed"
)
# dflash.train.distributed wraps every collective's failure in PeerLost; the bare gloo texts are for other programs
_PEER_LOST = re.compile(
    r"dflash\.(?:train\.)?distributed\.PeerLost: (?P<detail>.*)"
    r"|gloo/transport/tcp/[^\]\s]{1,200}\] (?:.{0,300}?Connection (?:reset|closed) by peer"
    r"|Timed out waiting \d{1,12}ms for (?:recv|send) operation)"
)
_ENOSPC = re.compile(r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded|\[Errno 122\]")
_EXC_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::\s.*|:)?$")
_TAIL_CAUSES = ((_NCCL_TIMEOUT, Cause.NCCL_TIMEOUT), (_CUDA_OOM, Cause.CUDA_OOM), (_NCCL_ERROR, Cause.NCCL_ERROR))
# the trainer's step line: `step 120 | loss 2.314 | acc 0.61 | ... | 19.4 Ktok/s | ...`
_STEP = re.compile(r"\bstep (\d{1,12}) \| loss ([-+0-9.eEnaif]{1,32})")
_KTOK = re.compile(r"\| ([0-9.]{1,16}) Ktok/s")


@dataclasses.dataclass(slots=True)
class Diagnosis:
    cause: Cause
    detail: str | None = None
    gpu: int | None = None
    signal: int | None = None
    evidence: list[str] = dataclasses.field(default_factory=list)
    xid: int | None = None
    bus_id: str | None = None

    @property
    def fingerprint(self) -> str:
        """Stable across runs: numbers, addresses and sizes collapse, so the same bug matches itself."""
        if self.cause == Cause.SIGNAL:
            return f"signal|{self.signal}"
        if self.cause == Cause.CUDA_OOM:
            return f"cuda-oom|gpu {self.gpu}"
        if self.cause == Cause.GPU_FAULT:
            return Fault(self.detail or "", self.xid, self.bus_id, self.gpu).fingerprint
        body = re.sub(r"0x[0-9a-fA-F]+", "<addr>", self.detail or "")
        body = re.sub(r"\d+(?:\.\d+)?", "#", body)
        return f"{self.cause}|{body[:200]}"


def capped(lines: t.Iterable[str]) -> list[str]:
    """Each line cut to LINE_CAP characters: what a pattern reads of a user's line is bounded."""
    return [line[:LINE_CAP] for line in lines]


def _clean(lines: t.Iterable[str]) -> list[str]:
    return [_PREFIX.sub("", line.rstrip()) for line in capped(lines)]


def ending(lines: t.Sequence[str]) -> list[str]:
    """What the run said after its last step line, less the trainer's own recovered warnings: the end
    a crash's words are read from (an earlier warning the run went on from is not its cause)."""
    last = max((i for i, x in enumerate(lines) if _STEP.search(x)), default=-1)
    return [x for x in lines[last + 1 :] if _RECOVERED not in x]


def last_exception(lines: t.Sequence[str]) -> str | None:
    """The exception line of the LAST traceback in ``lines`` (the first unindented line after its frames)."""
    lines = _clean(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if not line.strip() or line[0] in " \t":
            continue
        if _EXC_LINE.match(line.split(": ", 1)[0]):
            return line.strip()
        return None
    return None


def _gpu_of(texts: t.Iterable[str]) -> int | None:
    for text in texts:
        m = _GPU.search(text)
        if m:
            return int(next(g for g in m.groups() if g is not None))
    return None


def diagnose(
    lines: t.Sequence[str],
    *,
    exit_code: int | None,
    signal: int | None,
    oom_before: int | None = None,
    oom_after: int | None = None,
    disk_free: int | None = None,
) -> Diagnosis:
    """Why a run ended non-zero: the log tail, the exit record (``disk_free``: bytes left where the run
    wrote, when ``exit.json`` says the disk was full) and the cgroup's oom_kill count."""
    lines = _clean(lines)
    exc = last_exception(lines)
    # first: the CUDA error's traceback, what NCCL says and a loss gone NaN on a failing GPU follow from it
    fault = find([exc]) if exc else None  # the program's own words: its last exception, never a printed line
    if fault is not None:
        why = [f"log: {short(fault.line, 200)}"]
        return Diagnosis(Cause.GPU_FAULT, short(fault.text, 400), fault.gpu, signal, why, fault.xid, fault.bus_id)
    div = diverged_line(lines, exit_code)
    if div is not None:  # the trainer's own verdict: nothing else in the tail explains the end better
        return Diagnosis(Cause.DIVERGED, short(div[0], 400), evidence=[f"log: {short(div[1], 300)}"])
    full = disk_full_line(lines, exit_code)
    if full is not None:  # the trainer's own verdict: its last checkpoint was not written
        return Diagnosis(Cause.DISK_FULL, short(full, 400), evidence=[f"log: {short(full, 300)}"])
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        how = f"signal {signal}" if signal else f"exit {exit_code}"
        return Diagnosis(
            Cause.HOST_OOM,
            f"the container's OOM killer killed {oom_after - oom_before} process(es) during the run ({how})",
            signal=signal or _from_shell(exit_code),
            evidence=[f"cgroup memory.events oom_kill rose from {oom_before} to {oom_after}"],
        )
    end = ending(lines)
    if exc and _CUDA_OOM.search(exc):
        return Diagnosis(Cause.CUDA_OOM, exc, gpu=_gpu_of([exc] + [x for x in end if _CUDA_OOM.search(x)]))
    if exc and _NCCL_TIMEOUT.search(exc):
        return Diagnosis(Cause.NCCL_TIMEOUT, exc)
    if exc and _NCCL_ERROR.search(exc):
        return Diagnosis(Cause.NCCL_ERROR, exc)
    if exc and _ENOSPC.search(exc):
        return Diagnosis(Cause.DISK_FULL, exc)
    for pattern, cause in _TAIL_CAUSES:
        hits = [x.strip() for x in end if pattern.search(x)]
        if hits:
            gpu = _gpu_of(hits) if cause == Cause.CUDA_OOM else None
            return Diagnosis(
                cause, short(hits[-1], 400), gpu=gpu, signal=signal, evidence=[f"log: {short(hits[-1], 200)}"]
            )
    # a lost peer: usually not the last traceback (torchrun's own ChildFailedError follows it)
    peer = [m for m in map(_PEER_LOST.search, end) if m]
    if peer:
        m = peer[-1]
        return Diagnosis(
            Cause.PEER_LOST,
            short(m.group("detail") or m.group(0), 400),
            signal=signal,
            evidence=[f"log: {short(m.string.strip(), 200)}"],
        )
    hits = [x.strip() for x in end if _ENOSPC.search(x)]
    if hits:
        return Diagnosis(
            Cause.DISK_FULL, short(hits[-1], 400), signal=signal, evidence=[f"log: {short(hits[-1], 200)}"]
        )
    if signal:
        return Diagnosis(Cause.SIGNAL, f"ended by signal {signal} ({signame(signal)})", signal=signal)
    if disk_free is not None:
        # torch.save says "file write failed", tools say nothing: the record of the disk decides
        return Diagnosis(
            Cause.DISK_FULL,
            exc or f"{disk_free} bytes were free where the run writes when the command ended",
            evidence=[f"exit.json: {disk_free} bytes free on the run's disk when the command ended"],
        )
    if exc:
        return Diagnosis(Cause.PYTHON_EXCEPTION, exc)
    sh = _from_shell(exit_code)
    if sh:
        return Diagnosis(
            Cause.SIGNAL,
            f"exit {exit_code} = 128+{sh}: a process was killed by signal {sh} ({signame(sh)})",
            signal=sh,
        )
    last = next((x.strip() for x in reversed(lines) if x.strip()), None)
    return Diagnosis(Cause.NONZERO_EXIT, short(last, 400) if last else f"exit code {exit_code}")


def _from_shell(exit_code: int | None) -> int | None:
    """A shell reports a signalled child as 128+N."""
    if exit_code is not None and 128 < exit_code <= 128 + 64:
        return exit_code - 128
    return None


def progress_of(metrics: wire.Metrics | None, log: wire.Log | None) -> Progress | None:
    """The last metrics.jsonl record, else the last `step N | loss X ...` line of the log."""
    rec = metrics.last if metrics else None
    if rec is not None and rec.get("step") is not None:
        return Progress(
            step=as_int(rec.get("step")),
            loss=as_float(rec.get("loss")),
            ktok_s=as_float(rec.get("ktok_s")),
            at=rec.get("at") if isinstance(rec.get("at"), str) else iso(metrics.mtime if metrics else None),
        )
    return progress_from_lines(log.tail if log else (), iso(log.mtime if log else None))


def progress_from_lines(lines: t.Sequence[str], at: str | None) -> Progress | None:
    for line in reversed(capped(lines)):
        m = _STEP.search(line)
        if m:
            k = _KTOK.search(line)
            return Progress(
                step=int(m.group(1)), loss=as_float(m.group(2)), ktok_s=as_float(k.group(1)) if k else None, at=at
            )
    return None


def iso(ts: t.Any) -> str | None:
    """Epoch seconds -> ``2026-11-29T15:02:11Z``; None for what is not a time (absent, NaN, out of range)."""
    x = watch.number(ts, 0.0, watch.MAX_TIME)
    return None if x is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(x))


def signame(n: int | None) -> str:
    try:
        return signal_mod.Signals(n).name if n else "?"
    except ValueError:
        return f"signal {n}"


def short(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
