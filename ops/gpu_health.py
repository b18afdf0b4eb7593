"""``dflashctl doctor``'s ``gpu-health``: what ``nvidia-smi -q -d ECC,ROW_REMAPPER,PERFORMANCE`` says of each
GPU, judged ``fail`` (uncorrectable ECC errors since the driver loaded, a row remapping that failed),
``warn`` (uncorrectable errors in the GPU's lifetime, a remap pending a reset, a hardware or thermal
slowdown) or ``ok`` (docs/design.md section 6, doctor). A GPU that does not answer (nvidia-smi's
``Unable to determine the device handle for GPU<bus>: Unknown Error`` or ``: GPU is lost ...``, on stdout or
stderr, whatever its exit code) is ``fail`` too: it has no section, so its index is unknown.

Pure: the text in, one verdict per GPU out. The layout is the driver's indented ``key : value`` tree;
section names differ by driver (``Clocks Event Reasons`` from 535 on, ``Clocks Throttle Reasons``
before; ``SRAM/DRAM Uncorrectable`` on Ampere and later, ``Double Bit`` totals before), so both are read.
"""

from __future__ import annotations

import dataclasses
import re

ARGV = ("nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER,PERFORMANCE")
_GPU = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
# the driver writes it with and without the space after "GPU"
_LOST = re.compile(
    r"Unable to determine the device handle for GPU ?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]): *(.*)$"
)
_THROTTLE = ("Clocks Event Reasons", "Clocks Throttle Reasons")
# a slowdown the hardware forced (the GPU protects itself: heat, power brake); SW power cap and idle are normal
_SLOWDOWNS = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW Thermal Slowdown")


@dataclasses.dataclass(frozen=True)
class GpuHealth:
    index: int | None  # None: a GPU that did not answer (nvidia-smi gave it no section)
    bus_id: str
    status: str  # "ok" | "warn" | "fail"
    why: tuple[str, ...] = ()

    def line(self) -> str:
        return f"GPU {'?' if self.index is None else self.index} ({self.bus_id}): {self.status}" + (
            f": {'; '.join(self.why)}" if self.why else ""
        )


def _tree(lines: list[str]) -> dict[str, str]:
    """``ECC Errors/Volatile/DRAM Uncorrectable`` -> ``0``: each value under its sections' path."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for raw in lines:
        if not raw.strip():
            continue
        depth = len(raw) - len(raw.lstrip(" "))
        key, sep, value = raw.strip().partition(":")
        key = key.strip()
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = "/".join([*(k for _, k in stack), key])
        if sep and value.strip():
            out[path] = value.strip()
        else:
            stack.append((depth, key))
    return out


def _count(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None  # N/A: ECC off, or a GPU without it


def _uncorrectable(tree: dict[str, str], scope: str) -> int | None:
    """The uncorrectable ECC errors of ``Volatile`` or ``Aggregate``: the ``... Uncorrectable ...`` counts,
    or the ``Double Bit/Total`` of older drivers. None when the GPU reports none (N/A)."""
    prefix = f"ECC Errors/{scope}/"
    counts = [
        _count(v)
        for k, v in tree.items()
        if k.startswith(prefix) and ("Uncorrectable" in k.split("/")[-1] or k == f"{prefix}Double Bit/Total")
    ]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def judge(index: int, bus_id: str, lines: list[str]) -> GpuHealth:
    tree = _tree(lines)
    fail: list[str] = []
    warn: list[str] = []
    volatile, aggregate = _uncorrectable(tree, "Volatile"), _uncorrectable(tree, "Aggregate")
    if volatile:
        fail.append(f"{volatile} uncorrectable ECC error(s) since the driver loaded (reset the GPU)")
    if aggregate and not volatile:
        warn.append(f"{aggregate} uncorrectable ECC error(s) in its lifetime")
    if tree.get("Remapped Rows/Remapping Failure Occurred") == "Yes":
        fail.append("a row remapping failed (the GPU needs service)")
    if tree.get("Remapped Rows/Pending") == "Yes":
        warn.append("a row remap is pending: reset the GPU to apply it")
    active = [
        name.split("/")[-1]
        for name, value in tree.items()
        if name.split("/")[0] in _THROTTLE and name.split("/")[-1] in _SLOWDOWNS and value == "Active"
    ]
    if active:
        warn.append(f"clocks slowed: {', '.join(active)}")
    status = "fail" if fail else "warn" if warn else "ok"
    return GpuHealth(index, bus_id, status, tuple(fail + warn))


def parse(text: str) -> list[GpuHealth]:
    """One verdict per ``GPU <bus id>`` section, in nvidia-smi's order (its index order), then one ``fail``
    per GPU that did not answer (``text``: stdout and stderr)."""
    sections: list[tuple[str, list[str]]] = []
    lost: list[GpuHealth] = []
    for line in text.splitlines():
        gone = _LOST.search(line)
        if gone:
            why = gone.group(2).strip().rstrip(".") or "no reason given"
            lost.append(GpuHealth(None, gone.group(1), "fail", (f"does not answer: {why[:200]}",)))
            continue
        m = _GPU.match(line)
        if m:
            sections.append((m.group(1), []))
        elif sections:
            sections[-1][1].append(line)
    return [*(judge(i, bus, body) for i, (bus, body) in enumerate(sections)), *lost]
