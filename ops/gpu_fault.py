"""A GPU that failed in hardware, read from the driver's own words (docs/design.md section 6, cause
``gpu-fault``): NVRM Xid lines of the kernel log, and the CUDA texts a dead GPU gives the program.

Pure and stdlib only (the supervisor on the Proxmox host loads it). The lines are read by
``ops.diagnosis.find``, the kernel log itself by ``ops.far.kernel_log``; nvidia-smi's bus ids map a bus
id to a GPU index here.
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops import diagnosis, wire


def gpu_index(bus_id: str | None, gpus: t.Sequence[wire.Gpu] | None) -> int | None:
    """The index nvidia-smi gives the GPU at ``bus_id`` (its facts carry ``pci_bus_id``), else None."""
    want = diagnosis.bus_key(bus_id) if bus_id else None
    if want is None:
        return None
    for g in gpus or []:
        if g.pci_bus_id and diagnosis.bus_key(g.pci_bus_id) == want and g.index is not None:
            return g.index
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What the driver's words say of a crashed run: the fault (None: none shown), each source's line
    (``where: line``), and the kernel logs that could not be read when none shows one."""

    fault: diagnosis.Fault | None
    lines: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()


def explain(
    tail: t.Sequence[str],
    kernel: wire.KernelLog | None,
    host_kernel: wire.KernelLog | None,
    gpus: t.Sequence[wire.Gpu] | None,
    pids: t.Collection[int] = (),
) -> Finding:
    """A crashed run's cause is ``gpu-fault`` when its log tail, the container's kernel log (the agent's
    ``kernel``) or the Proxmox host's (``host_kernel``, read where dflashctl runs on the host) shows one:
    the Xid, the bus id and the GPU index of the fault, each source's line for the evidence. ``tail``: the
    program's own words (its last exception); a kernel log's lines count when they are about this run
    (``ours``: its GPUs, its ``pids``), never another container's GPU."""
    kept = {
        name: ours(facts.lines if facts is not None else (), gpus, pids)
        for name, facts in (("container", kernel), ("host", host_kernel))
    }
    sources = (
        ("log", tail),
        ("the container's kernel log", kept["container"][0]),
        ("the host's kernel log", kept["host"][0]),
    )
    others = [
        f"the {name}'s kernel log: {len(left)} NVRM line(s) about another GPU or process, not this run's "
        f"(first: {diagnosis.short(left[0], 200)})"
        for name, (_, left) in kept.items()
        if left and diagnosis.find(left) is not None
    ]
    found = [(where, f) for where, lines in sources for f in [diagnosis.find(lines)] if f is not None]
    if not found:
        unread = [
            f"{name} kernel log could not be read ({facts.error}): no evidence from it"
            for name, facts in (("the container's", kernel), ("the host's", host_kernel))
            if facts is not None and facts.error
        ]
        return Finding(None, unread=tuple([*unread, *others]))
    best = next((f for _, f in found if f.xid is not None), found[0][1])
    bus = best.bus_id or next((f.bus_id for _, f in found if f.bus_id), None)
    gpu = best.gpu if best.gpu is not None else next((f.gpu for _, f in found if f.gpu is not None), None)
    if gpu is None:
        gpu = gpu_index(bus, gpus)
    fault = diagnosis.Fault(best.line, best.xid, bus, gpu)
    return Finding(fault, tuple(f"{where}: {diagnosis.short(f.line, 200)}" for where, f in found), tuple(others))


def ours(
    lines: t.Sequence[str], gpus: t.Sequence[wire.Gpu] | None, pids: t.Collection[int]
) -> tuple[list[str], list[str]]:
    """(the lines about this run, the others): a line is the run's when it names one of its GPUs' bus
    ids (nvidia-smi's, in the container) or one of its pids. When the run's GPUs are not known every line
    is kept: the kernel names host pids, which a container's pid namespace never shows, so a pid alone
    cannot say a line is another run's."""
    mine = {k for g in gpus or () if g.pci_bus_id for k in [diagnosis.bus_key(g.pci_bus_id)] if k is not None}
    kept: list[str] = []
    left: list[str] = []
    for line in diagnosis.capped(lines):
        bus, pid = diagnosis.bus_key(line), diagnosis.pid_of(line)
        if (bus is not None and bus in mine) or (pid is not None and pid in pids):
            kept.append(line)
        elif not mine:
            kept.append(line)
        else:
            left.append(line)
    return kept, left
