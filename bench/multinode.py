"""Several nodes on this machine: the averaging round over gloo, and simulated-worker throughput.

    .venv/bin/python -m bench.multinode [--nodes 1 2 4] [--mb 64] [--rounds 3] [--sim-steps 240] [--no-sim]

Each "node" is a process joined by ``torch.distributed`` (gloo on 127.0.0.1, as torchrun would set it up),
running dflash's own code:

- ``averaging``: one drafter replica of ``--mb`` MB (fp32, a few tensors) per node, averaged by
  ``dflash.train.averaging.Averager`` with ``NodeGroup.cross_reduce`` (slice by slice: local mean, all_reduce of
  mean * replicas, divide). Seconds per round (best of ``--rounds``), seconds per MB of one replica, the
  gloo all_reduce's bandwidth alone on the same bytes, and a check that every node ends bit-identical.
  With 1 node there is no group: the figure is a local round of 2 replicas (what a single box pays).
- ``pipeline`` (simulated workers, like ``dflash bench pipeline``): per node 2 targets x 80 ms, 2 drafters
  x 60 ms (sleeps), a header exchange + a real cross-node averaging of a 4 MB replica every 8 steps, steps
  counted across nodes (``step_stride``). Ktok/s of the group vs the ideal: nodes x one node's bound.

Loopback numbers: the all_reduce here moves bytes through memory, not a NIC; on real hosts the round
is bounded by the link (2 x bytes x (N-1)/N per node for a ring all_reduce).
"""

from __future__ import annotations

if not __package__:  # `python bench/multinode.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.multinode")

import argparse
import datetime as dt
import multiprocessing as mp
import os
import socket
import time
import typing as t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, world: int, port: int) -> t.Any:
    import torch.distributed as dist

    from dflash.train.distributed import NodeGroup

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=dt.timedelta(seconds=120)
    )
    return NodeGroup(rank=rank, world=world, timeout=120.0)


def _replica(mb: float, seed: int) -> list[t.Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    numel = int(mb * 2**20 / 4)
    sizes = [numel // 2, numel // 4, numel - numel // 2 - numel // 4]  # a few tensors of different sizes
    return [torch.randn(n, generator=g) for n in sizes]


def averaging_worker(rank: int, world: int, port: int, mb: float, rounds: int, out: t.Any) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    from dflash.train.averaging import Averager

    torch.set_num_threads(1)
    if world == 1:  # no group: one box's local round of 2 replicas
        reps = [_replica(mb, 0), _replica(mb, 1)]
        av = Averager.for_replicas(reps)
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            av.average(reps)
            times.append(time.perf_counter() - t0)
        out.put({"rank": 0, "first": times[0], "best": min(times[1:]), "allreduce": 0.0, "digest": ""})
        return
    group = _join(rank, world, port)
    rep = _replica(mb, rank)
    av = Averager.for_replicas([rep], cross_reduce=group.cross_reduce)
    group.total_replicas = world
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        av.average([rep])
        times.append(time.perf_counter() - t0)
    flat = torch.cat(rep)
    best_ar = float("inf")
    for _ in range(rounds):  # the all_reduce alone, on the same bytes in one buffer
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        best_ar = min(best_ar, time.perf_counter() - t0)
    h = hashlib.sha256()
    for p in rep:
        h.update(p.numpy().tobytes())
    out.put(
        {"rank": rank, "first": times[0], "best": min(times[1:]), "allreduce": best_ar, "digest": h.hexdigest()[:16]}
    )
    group.close()


def pipeline_worker(rank: int, world: int, port: int, steps: int, out: t.Any) -> None:
    import torch

    from dflash.train.averaging import Averager
    from dflash.train.distributed import Header
    from dflash.train.pipeline import Pipeline, PipelineOptions, StepStats, SyncEvent
    from dflash.train.simulate import SimDrafter, SimSource, SimTarget

    torch.set_num_threads(1)
    group = _join(rank, world, port) if world > 1 else None
    T, D, tokens = 2, 2, 4096
    rep = [_replica(4, rank * 10 + j) for j in range(D)]
    av = Averager.for_replicas(rep, cross_reduce=group.cross_reduce if group is not None else None)
    syncs = [0]

    def on_sync(ev: SyncEvent) -> None:
        reps = [rep[j] for j in ev.replicas]
        if group is not None:
            syncs[0] += 1
            group.exchange(
                Header(
                    index=syncs[0],
                    step=ev.step,
                    average=ev.average,
                    checkpoint=ev.checkpoint,
                    final=ev.final,
                    replicas=len(reps),
                    tokens=0,
                    seconds=0.0,
                    stop=0,
                ),
                doing="bench",
            )
        av.average(reps)

    done: list[float] = []

    def on_step(n: int, stats: StepStats, tok: int) -> None:
        done.append(time.monotonic())

    pipe = Pipeline(
        targets=[SimTarget("cpu", 0.080, 1 << 20) for _ in range(T)],
        sources=[SimSource(rank * T + i, world * T, tokens) for i in range(T)],
        drafters=[SimDrafter("cpu", 0.060) for _ in range(D)],
        on_sync=on_sync,
        on_step=on_step,
        shard_starts=[rank * T + i for i in range(T)],
        options=PipelineOptions(
            max_steps=steps,
            capacity=16,
            average_every=8 * world,
            step_stride=world,
            shard_stride=world * T,
            barrier_timeout=60.0,
        ),
    )
    if group is not None:
        import torch.distributed as dist

        dist.barrier()
    t0 = time.monotonic()
    pipe.run()
    wall = time.monotonic() - t0
    warm = len(done) // 10
    span = done[-1] - done[warm]
    out.put(
        {"rank": rank, "ktok_s": (len(done) - 1 - warm) * tokens / span / 1000.0, "wall": wall, "updates": len(done)}
    )
    if group is not None:
        group.close()


def spawn(fn: t.Callable[..., None], world: int, *args: t.Any) -> list[dict[str, t.Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return sorted(results, key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mb", type=float, default=64.0, help="MB of one replica (fp32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim-steps", type=int, default=240, help="global steps of the simulated run")
    ap.add_argument("--no-sim", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"machine: {os.cpu_count()} CPUs; gloo on 127.0.0.1; one replica = {args.mb:g} MB fp32 per node")
    print(f"{'nodes':>5} {'round s':>8} {'first s':>8} {'ms/MB':>7} {'allreduce s':>11} {'MB/s':>8}  identical")
    for n in args.nodes:
        res = spawn(averaging_worker, n, args.mb, args.rounds)
        best = max(r["best"] for r in res)
        first = max(r["first"] for r in res)
        ar = max(r["allreduce"] for r in res)
        same = len({r["digest"] for r in res}) == 1
        bw = f"{args.mb / ar:8.0f}" if ar else "       -"
        print(
            f"{n:>5} {best:8.3f} {first:8.3f} {1000 * best / args.mb:7.2f} {ar:11.3f} {bw}  "
            f"{'yes' if same else 'NO'}{'' if n > 1 else ' (local round of 2 replicas, no group)'}"
        )
    if args.no_sim:
        return 0
    print(
        "\nsimulated workers per node: 2 targets x 80 ms, 2 drafters x 60 ms, 4096 tokens/batch; "
        "averaging (4 MB replica, cross-node) every 8 local updates"
    )
    one = min(2 * 1000 / 80, 2 * 1000 / 60) * 4096 / 1000  # one node's bound, Ktok/s
    print(f"{'nodes':>5} {'Ktok/s':>8} {'ideal':>8} {'ratio':>6}  per node")
    for n in args.nodes:
        res = spawn(pipeline_worker, n, args.sim_steps)
        total = sum(r["ktok_s"] for r in res)
        print(
            f"{n:>5} {total:8.1f} {n * one:8.1f} {total / (n * one):6.3f}  "
            + " ".join(f"{r['ktok_s']:.1f}" for r in res)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
