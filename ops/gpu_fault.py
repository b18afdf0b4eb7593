"""A GPU that failed in hardware, read from the driver's own words (docs/design.md section 6, cause
``gpu-fault``): NVRM Xid lines of the kernel log, and the CUDA texts a dead GPU gives the program.

Pure and stdlib only (the supervisor on the Proxmox host loads it). The kernel log itself is read by
``ops.far.kernel_log``; nvidia-smi's bus ids map a bus id to a GPU index here.
"""

from __future__ import annotations

import dataclasses
import re
import typing as t

from ops import wire
from ops.states import Cause, State

if t.TYPE_CHECKING:
    from ops.probe import Status

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
_RECOVERY_NONE = re.compile(r"recovery action changed from .* to 0x0 \(None\)")
# `NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.` and the multi-line form of newer drivers
# (`NVRM: The NVIDIA GPU 0000:b3:00.0 ... NVRM: fallen off the bus and is not responding to commands.`)
_FALLEN = re.compile(r"GPU has fallen off the bus|fallen off the bus and is not responding")
_BUS = re.compile(r"\b(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\b")
# What CUDA tells the program (torch's `CUDA error: ...`, the driver API's enum name)
_ECC = re.compile(r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE")
# Also a bug's symptom: a hardware fault only with an Xid beside it
_LAUNCH = re.compile(r"CUDA error: unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED")
_GPU = re.compile(r"\bGPU (\d+)\b|\bcuda:(\d+)\b")


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
        m = _GPU.search(text)
        if m:
            return int(next(g for g in m.groups() if g is not None))
    return None


def bus_key(text: str) -> tuple[int, int, int] | None:
    """``0000:3b:00`` (the driver's), ``00000000:3B:00.0`` (nvidia-smi's) -> (domain, bus, device)."""
    m = _BUS.fullmatch(text.strip()) or _BUS.search(text)
    if m is None:
        return None
    domain, bus, device = m.group("bus").split(":")
    return int(domain, 16), int(bus, 16), int(device, 16)


def gpu_index(bus_id: str | None, gpus: t.Sequence[wire.Gpu] | None) -> int | None:
    """The index nvidia-smi gives the GPU at ``bus_id`` (its facts carry ``pci_bus_id``), else None."""
    want = bus_key(bus_id) if bus_id else None
    if want is None:
        return None
    for g in gpus or []:
        if g.pci_bus_id and bus_key(g.pci_bus_id) == want and g.index is not None:
            return g.index
    return None


def explain(st: Status, agent: t.Mapping[str, t.Any] | None, host_kernel: t.Mapping[str, t.Any] | None) -> None:
    """A crashed run's cause is ``gpu-fault`` when its log tail, the container's kernel log (the agent's
    ``kernel``) or the Proxmox host's (``host_kernel``, read where dflashctl runs on the host) shows one:
    the Xid, the bus id and the GPU index go on the Status, each source's line in its evidence. The
    program's own last error (a CUDA error's traceback) stays as evidence: the Xid is the cause."""
    if st.state != State.CRASHED:
        return
    attempt = (agent or {}).get("attempt") or {}
    sources = (
        ("log", ((attempt.get("log") or {}).get("tail")) or st.tail),  # st.tail: a pane's, without a run record
        ("the container's kernel log", _lines((agent or {}).get("kernel"))),
        ("the host's kernel log", _lines(host_kernel)),
    )
    found = [(where, f) for where, lines in sources for f in [find(lines)] if f is not None]
    if not found:
        for name, facts in (("the container's", (agent or {}).get("kernel")), ("the host's", host_kernel)):
            if isinstance(facts, dict) and facts.get("error"):
                st.evidence.append(f"{name} kernel log could not be read ({facts['error']}): no evidence from it")
        return
    best = next((f for _, f in found if f.xid is not None), found[0][1])
    bus = best.bus_id or next((f.bus_id for _, f in found if f.bus_id), None)
    gpu = best.gpu if best.gpu is not None else next((f.gpu for _, f in found if f.gpu is not None), None)
    if gpu is None:
        gpu = gpu_index(bus, st.gpus)
    fault = Fault(best.line, best.xid, bus, gpu)
    if st.cause != Cause.GPU_FAULT and st.detail:
        st.evidence.append(f"the program's last error ({st.cause}): {_short(st.detail, 200)}")
    st.cause, st.detail, st.fingerprint = Cause.GPU_FAULT, _short(fault.text, 400), fault.fingerprint
    st.gpu, st.gpu_bus_id, st.xid = fault.gpu, fault.bus_id, fault.xid
    for where, f in found:
        line = f"{where}: {_short(f.line, 200)}"
        if line not in st.evidence:  # diagnose() already named the log's
            st.evidence.append(line)


def _lines(facts: t.Any) -> list[str]:
    lines = facts.get("lines") if isinstance(facts, dict) else None
    return [x for x in lines if isinstance(x, str)] if isinstance(lines, list) else []


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
