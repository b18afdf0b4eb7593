"""A stand-in ``nvidia-smi`` (a GPU cannot run here) that prints what the real one prints: the CSV of
``--query-gpu`` and the ``-q -d ECC,ROW_REMAPPER,PERFORMANCE`` report in the layout of the driver branch
asked for (535+: ``Clocks Event Reasons``, SRAM/DRAM counts; 470: ``Clocks Throttle Reasons``)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    bus_id: str = "00000000:18:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    volatile_dram_uncorrectable: int = 0
    aggregate_dram_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    hw_slowdown: bool = False
    thermal_slowdown: bool = False
    lost: bool = False  # fell off the bus: no section, a line saying so (and the exit code of a failed query)


def _active(on: bool) -> str:
    return "Active" if on else "Not Active"


def report(gpus: list[FakeGpu], *, driver: str = "535.129.03") -> str:
    """The text of ``nvidia-smi -q -d ECC,ROW_REMAPPER,PERFORMANCE`` (a lost GPU has no section)."""
    gpus = [g for g in gpus if not g.lost]
    old = int(driver.split(".")[0]) < 535
    out = [
        "",
        "==============NVSMI LOG==============",
        "",
        "Timestamp                                 : Wed Dec  2 00:31:02 2026",
        f"Driver Version                            : {driver}",
        f"CUDA Version                              : {'11.4' if old else '12.2'}",
        "",
        f"Attached GPUs                             : {len(gpus)}",
    ]
    for g in gpus:
        out += [
            f"GPU {g.bus_id}",
            "    Performance State                     : P0",
            f"    Clocks {'Throttle' if old else 'Event'} Reasons",
            "        Idle                              : Not Active",
            "        Applications Clocks Setting       : Not Active",
            "        SW Power Cap                      : Active",
            f"        HW Slowdown                       : {_active(g.hw_slowdown or g.thermal_slowdown)}",
            f"            HW Thermal Slowdown           : {_active(g.thermal_slowdown)}",
            "            HW Power Brake Slowdown       : Not Active",
            "        Sync Boost                        : Not Active",
            "        SW Thermal Slowdown               : Not Active",
            "        Display Clock Setting             : Not Active",
            "    Sparse Operation Mode                 : N/A",
            "    ECC Mode",
            "        Current                           : Enabled",
            "        Pending                           : Enabled",
            "    ECC Errors",
        ]
        for scope, n in (("Volatile", g.volatile_dram_uncorrectable), ("Aggregate", g.aggregate_dram_uncorrectable)):
            out += [
                f"        {scope}",
                "            SRAM Correctable              : 0",
                "            SRAM Uncorrectable            : 0",
                "            DRAM Correctable              : 3",
                f"            DRAM Uncorrectable            : {n}",
            ]
        out += [
            "    Remapped Rows",
            "        Correctable Error                 : 0",
            f"        Uncorrectable Error               : {g.aggregate_dram_uncorrectable}",
            f"        Pending                           : {'Yes' if g.remap_pending else 'No'}",
            f"        Remapping Failure Occurred        : {'Yes' if g.remap_failed else 'No'}",
            "        Bank Remap Availability Histogram",
            "            Max                           : 2559 bank(s)",
            "            High                          : 1 bank(s)",
            "            Partial                       : 0 bank(s)",
            "            Low                           : 0 bank(s)",
            "            None                          : 0 bank(s)",
            "",
        ]
    return "\n".join(out) + "\n"


def install(bin_dir: Path, gpus: list[FakeGpu], *, driver: str = "535.129.03") -> Path:
    """``bin_dir/nvidia-smi``: ``-q ...`` prints ``report``, ``--query-gpu=...`` the CSV of every GPU; a lost
    GPU's line goes to stderr and ``-q`` exits 15 (nvidia-smi's "GPU is lost")."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "nvidia-smi.q").write_text(report(gpus, driver=driver))
    lost = "".join(f"Unable to determine the device handle for GPU{g.bus_id}: Unknown Error\n" for g in gpus if g.lost)
    (bin_dir / "nvidia-smi.lost").write_text(lost)
    gpus = [g for g in gpus if not g.lost]
    csv = "".join(f"{i}, {g.name}, 81559 MiB\n" for i, g in enumerate(gpus))
    (bin_dir / "nvidia-smi.csv").write_text(csv)
    exe = bin_dir / "nvidia-smi"
    q, c = shlex.quote(str(bin_dir / "nvidia-smi.q")), shlex.quote(str(bin_dir / "nvidia-smi.csv"))
    lines = shlex.quote(str(bin_dir / "nvidia-smi.lost"))
    query = f"cat {q}; if [ -s {lines} ]; then cat {lines} >&2; exit 15; fi ;;"
    exe.write_text(f'#!/bin/sh\ncase "$1" in\n  -q) {query}\n  *) exec cat {c} ;;\nesac\n')
    exe.chmod(0o755)
    return exe
