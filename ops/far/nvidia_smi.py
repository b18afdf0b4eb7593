"""nvidia-smi's facts for the probe (docs/design.md section 14): started first, read last, because it is
the slow fact. stdlib only."""

from __future__ import annotations

import shutil
import subprocess

from ops.far.protocol import GpuFacts

_GPU_QUERY = "index,name,memory.used,memory.total,utilization.gpu,pci.bus_id"


def start() -> subprocess.Popen[bytes] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.Popen(
            [exe, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError:
        return None


def finish(proc: subprocess.Popen[bytes] | None) -> list[GpuFacts] | dict[str, str] | None:
    if proc is None:
        return None
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "nvidia-smi did not answer within 10s"}
    if proc.returncode != 0:
        return {"error": (err or out).decode("utf-8", "replace").strip()[-300:]}
    gpus: list[GpuFacts] = []
    for line in out.decode("utf-8", "replace").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) not in (5, 6):  # 5: a stand-in of an older query
            continue

        def num(s: str) -> float | None:
            try:
                return float(s)
            except ValueError:
                return None

        gpus.append(
            {
                "index": int(num(cells[0]) or 0),
                "name": cells[1],
                "memory_used_mib": num(cells[2]),
                "memory_total_mib": num(cells[3]),
                "utilization_pct": num(cells[4]),
            }
        )
        if len(cells) == 6:
            gpus[-1]["pci_bus_id"] = cells[5]  # 00000000:3B:00.0: what a driver's Xid line names
    return gpus
