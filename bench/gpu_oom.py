"""The GPU smoke's forced CUDA OOM, read back the way `dflashctl status` reads a run.

    .venv/bin/python -m bench.gpu_oom GPU MARGIN_BYTES SHAPES_JSON train --config RUN.toml

runs `dflash train` whose GPU ``GPU`` is capped once its warm-up is done (``oom_child``): the OOM is the
real allocator's, in a drafter step (a cap at start would hit the target's load on a shared GPU instead).
``forced_oom`` (called by ``python -m bench.gpu_smoke``) starts that under the real runner in a temp run
dir and classifies it with the agent's probe facts and ``ops.probe.classify``.
"""

from __future__ import annotations

if not __package__:  # `python bench/gpu_oom.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.gpu_oom")

import argparse
import json
import os
import subprocess
import sys
import time
import typing as t
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def end_leftovers(record: Path) -> None:
    """SIGKILL the command and keeper a timed-out OOM run left (the pids it recorded, same start time)."""
    import signal

    from ops.far.runner import proc_stat

    try:
        run = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    for key in ("child", "keeper"):
        pid, start = run.get(f"{key}_pid"), run.get(f"{key}_start")
        st = proc_stat(pid) if isinstance(pid, int) else None
        if st is not None and st[1] == start:
            os.kill(pid, signal.SIGKILL)


def oom_child(argv: t.Sequence[str]) -> int:
    """``GPU MARGIN_BYTES SHAPES_JSON dflash-args...``: ``dflash train`` whose GPU is capped after its warm-up.

    The run's warm-up (``dflash.train.run.warm_up_replicas``, wrapped here: the smoke's shapes only) compiles
    and builds everything a step needs but the step's activations; then the allocator's cache is emptied and
    the GPU capped at what it holds plus the margin, so the first drafter step's logits cannot fit."""
    import torch

    import dflash.train.run as train

    gpu, margin, shapes = int(argv[0]), float(argv[1]), [tuple(s) for s in json.loads(argv[2])]
    warm = train.warm_up_replicas

    def warm_then_cap(replicas: t.Any, **kw: t.Any) -> t.Any:
        out = warm(replicas, **{**kw, "shapes": shapes or kw.get("shapes")})
        torch.cuda.synchronize(gpu)
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(gpu)
        total = torch.cuda.get_device_properties(gpu).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + margin) / total), gpu)
        print(f"gpu_smoke: GPU {gpu} capped at {(held + margin) / 2**30:.2f} GiB after warm-up", file=sys.stderr)
        return out

    train.warm_up_replicas = warm_then_cap  # type: ignore[assignment]  # the child's own module: a test hook
    from dflash.__main__ import main as dflash_main

    return int(dflash_main(list(argv[3:])) or 0)


def forced_oom(  # the smoke's step 5 (bench/gpu_smoke.py's docstring)
    args: argparse.Namespace,
    tmp: Path,
    cfg_path: Path,
    drafters: list[str],
    shapes: t.Sequence[tuple[int, int, int]] | None,
) -> dict[str, t.Any]:
    from ops import probe
    from ops.far import agent

    env = dict(os.environ)
    if args.cpu:
        gpu = 0  # the injected message names GPU 0 for a CPU device
        command = [sys.executable, "-m", "dflash", "train", "--config", str(cfg_path)]
        env["DFLASH_FAULT"] = "oom-at-step:1"
        how = "injected (DFLASH_FAULT=oom-at-step:1: the allocator's text, raised in the drafter step)"
    else:
        gpu = int(drafters[-1].split(":")[1])
        command = [
            sys.executable,
            "-m",
            "bench.gpu_oom",
            str(gpu),
            str(args.oom_margin_gib * 2**30),
            json.dumps([list(x) for x in shapes or []]),
            "train",
            "--config",
            str(cfg_path),
        ]
        how = f"real: GPU {gpu}'s allocator capped after warm-up at what it holds + {args.oom_margin_gib:g} GiB"
    session = "smoke"
    run_dir = tmp / "runs"
    attempt = run_dir / session / "attempt-1"
    runner = [
        sys.executable,
        "-m",
        "ops.far.runner",
        "--attempt-dir",
        str(attempt),
        "--session",
        session,
        "--attempt",
        "1",
        "--cwd",
        str(ROOT),
        "--python",
        sys.executable,
        "--",
        *command,
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            runner,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=args.oom_timeout,
        )
        runner_rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:  # the runner is killed; its keeper and the command live on by design
        runner_rc = None
        end_leftovers(attempt / "run.json")
    req = {
        "session": session,
        "socket": f"dflash-smoke-{os.getpid()}",
        "run_dir": str(run_dir),
        "workdir": str(tmp),
        "python": sys.executable,
    }
    facts = {
        "host": "local",
        "session": session,
        "socket": req["socket"],
        "container_id": None,
        "hang_after": 600,
        "startup_grace": 0,
        "checked_at": time.time(),
        "mode": "agent",
        "agent": {"ok": True, "protocol": agent.PROTOCOL, "verb": "probe", **agent.probe(req)},
    }
    st = probe.classify(facts)
    return {
        "how": how,
        "gpu_expected": gpu,
        "runner_exit": runner_rc,
        "seconds": time.perf_counter() - t0,
        "state": st.state,
        "cause": st.cause,
        "gpu": st.gpu,
        "detail": (st.detail or "")[:300],
        "log": str(attempt / "train.log"),
    }


if __name__ == "__main__":
    sys.exit(oom_child(sys.argv[1:]))
