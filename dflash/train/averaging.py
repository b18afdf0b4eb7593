"""Replica averaging through bounded host buffers, one tensor slice at a time, pipelined (Local SGD).

Every replica's trainable tensors (the fp32 master weights when the model trains in bf16) are averaged
element-wise and written back to every replica. One engine for every placement:

- a slice (at most ``chunk_numel`` elements of one tensor) of every replica is *gathered* into host memory:
  CUDA replicas by a ``non_blocking`` D2H copy on a per-device copy stream into a pinned staging buffer
  (one per replica), CPU replicas as a plain view (no copy);
- the host *reduces* it into an accumulator (fp32, fp64 for fp64 tensors) as ``r0 + sum(r_i - r0) / n``
  (replicas that are already identical come back bit for bit unchanged), split across host threads in
  cache-sized blocks (numpy ufuncs: they drop the GIL and never start a nested OpenMP team);
- ``cross_reduce`` (optional) turns the local mean into the global one: the multi-node hook (all_reduce of
  the same slices across nodes, weighted by the live replicas per node), called once per slice, in the
  same order on every node; an asynchronous hook (``NodeGroup.cross_reduce``) returns a finisher, called
  after the next slice's local reduction, so slice k's all_reduce overlaps slice k+1's copy and reduction;
- the mean is *scattered* back: ``non_blocking`` H2D copies on a second copy stream, plain copies for CPU.

Pipelined with two buffer slots: the D2H of slice k+1 runs while the host reduces slice k and the H2D of
slice k-1 drains. Ordering uses CUDA events only (the copy streams wait on an event recorded on each
device's current stream when the round starts; the host waits on per-slot events before it reads a staging
slot or rewrites an accumulator); no device-wide synchronize. When ``average`` returns, every replica holds
the mean and each device's current stream is ordered after the writes.

Peak extra memory: two slots of (one staging slice per CUDA replica + one accumulator), plus a small block
per host thread -- a slice of one tensor per replica, never a model copy, nothing on a GPU.

Frozen weights (the target's embedding and lm_head, held by every drafter replica) are never handed to
the averager, so they are never touched.

Optimizer state: each replica keeps its own AdamW moments (as Local SGD / torch's PeriodicModelAverager
do); only the weights are averaged. Averaging the moments would cost a second and third pass over the
model for no measured gain, and resetting them would restart the bias correction every interval.
Muon's momentum buffers (``optim.name = "muon"``) stay per replica too, for the same reasons: each is the
running mean of its own replica's gradients (the inner optimizer's state in Local SGD / DiLoCo), averaging
it is another pass over every hidden matrix, and zeroing it would drop ~20 steps (1 / (1 - 0.95)) of
gradient history at every round.

The caller guarantees no replica is mid-step (the pipeline's barrier).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
import typing as t

import numpy as np
import torch

DEFAULT_CHUNK = 1 << 24  # elements: 64 MiB per fp32 slice buffer
BLOCK = 1 << 16  # elements a host thread reduces at once: its operands stay in L2 across the passes
MIN_SPLIT = 1 << 18  # slices smaller than this are reduced by the calling thread alone
MAX_THREADS = 8

# The multi-node hook: (local mean of one slice, on the host, fp32/fp64; number of local replicas) ->
# overwrite the slice in place with the global mean; it may return a function that finishes the job
# (an asynchronous all_reduce: the averager calls it after reducing the next slice, to overlap them).
CrossReduce = t.Callable[[torch.Tensor, int], t.Callable[[], None] | None]


@dataclasses.dataclass(frozen=True)
class Round:
    """What the last ``average`` call did: for benches and logs."""

    seconds: float
    bytes_moved: int  # every replica's bytes gathered once and scattered once
    slices: int
    replicas: int


@dataclasses.dataclass
class _Slot:
    stage: list[torch.Tensor | None]  # per replica: raw bytes, pinned when CUDA is there
    acc: torch.Tensor | None = None  # raw bytes
    out: torch.Tensor | None = None  # raw bytes: the mean in the replicas' dtype when that is not the acc dtype
    d2h: dict[torch.device, t.Any] = dataclasses.field(default_factory=dict)  # device -> cuda Event
    h2d: dict[torch.device, t.Any] = dataclasses.field(default_factory=dict)


class Averager:
    """Averages lists of same-shaped tensors (one list per replica) in place, through bounded host buffers."""

    def __init__(
        self,
        max_numel: int,
        *,
        chunk_numel: int = DEFAULT_CHUNK,
        pin: bool | None = None,
        threads: int | None = None,
        cross_reduce: CrossReduce | None = None,
    ) -> None:
        self.chunk = max(1, min(max_numel, chunk_numel))
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.threads = max(1, threads if threads is not None else min(MAX_THREADS, torch.get_num_threads()))
        self.cross_reduce = cross_reduce
        self.last_round: Round | None = None
        self._slots: list[_Slot] = []
        self._streams: dict[torch.device, tuple[t.Any, t.Any]] = {}  # device -> (d2h, h2d) streams
        self._pool: cf.ThreadPoolExecutor | None = None
        self._scratch: list[np.ndarray] = []  # one block per host thread (the r_i - r0 term)
        # Tests: stage CPU replicas through the two slots like CUDA ones, to run the pipeline's bookkeeping.
        self._stage_host = False

    @property
    def buffer_bytes(self) -> int:
        """Host memory held for averaging now (allocated at the first round, then reused)."""
        held = [b for s in self._slots for b in (*s.stage, s.acc, s.out) if b is not None]
        return sum(b.numel() for b in held) + sum(a.nbytes for a in self._scratch)

    @classmethod
    def for_replicas(cls, replicas: t.Sequence[t.Sequence[torch.Tensor]], **kw: t.Any) -> Averager:
        largest = max((p.numel() for rep in replicas for p in rep), default=1)
        return cls(largest, **kw)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- the round -------------------------------------------------------------------------------------

    @torch.no_grad()
    def average(self, replicas: t.Sequence[t.Sequence[torch.Tensor]]) -> None:
        """``replicas[r][k]``: tensor k of replica r. Every tensor k ends up equal to the mean over r."""
        if len(replicas) < 2 and self.cross_reduce is None:  # one replica on a node of a group still averages
            return
        t0 = time.perf_counter()
        groups = _check(replicas)
        flats = [[_flat(p.detach()) for p in rep] for rep in replicas]  # [replica][tensor]
        plan = [
            (k, a, min(g[0].numel(), a + self._capacity(g[0].dtype)))
            for k, g in enumerate(groups)
            for a in range(0, g[0].numel(), self._capacity(g[0].dtype))
        ]
        devices = sorted({p.device for g in groups for p in g if p.device.type == "cuda"}, key=str)
        # two slots whenever a slice's accumulator outlives the next slice's reduction: a device's copies, or
        # the cross-node all_reduce still in flight while the next slice is reduced
        two = bool(devices) or self._stage_host or self.cross_reduce is not None
        self._ensure_slots(2 if two else 1, len(replicas), any_cuda=bool(devices))
        for dev in devices:  # the copies start after everything queued so far on the device
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(dev))
            self._stream(dev)[0].wait_event(start)
        nslots = len(self._slots)
        srcs: list[list[torch.Tensor]] = []
        # the slice whose cross-node all_reduce is in flight: (piece, slot, finish); scattered after the next
        # slice's local reduction, so the all_reduce overlaps that reduction and the next slice's copies
        pending: tuple[tuple[int, int, int], _Slot, t.Callable[[], torch.Tensor]] | None = None
        try:
            if plan:
                srcs.append(self._gather(flats, plan[0], self._slots[0]))
            for i, piece in enumerate(plan):
                slot = self._slots[i % nslots]
                if i + 1 < len(plan):
                    srcs.append(self._gather(flats, plan[i + 1], self._slots[(i + 1) % nslots]))
                for ev in slot.d2h.values():
                    ev.synchronize()
                for ev in slot.h2d.values():  # slice i - 2 has left this slot's accumulator
                    ev.synchronize()
                k, a, b = piece
                # Without a cross-node hook the host threads write CPU replicas straight from the cache.
                fused = [fl[k][a:b] for fl in flats if fl[k].device.type != "cuda"] if self.cross_reduce is None else []
                finish, done = self._reduce(srcs[i], slot, b - a, fused)
                srcs[i] = []  # drop the views: the staging slot is free for slice i + 2
                if pending is not None:  # slice i - 1: its all_reduce ran while slice i was reduced
                    self._scatter(flats, pending[0], pending[2](), pending[1], cpu_done=False)
                    pending = None
                if self.cross_reduce is None:
                    self._scatter(flats, piece, finish(), slot, cpu_done=done)
                else:
                    pending = (piece, slot, finish)
            if pending is not None:
                self._scatter(flats, pending[0], pending[2](), pending[1], cpu_done=False)
                pending = None
        except BaseException:
            if pending is not None:  # a later slice failed: the one in flight still lands if it can
                try:
                    self._scatter(flats, pending[0], pending[2](), pending[1], cpu_done=False)
                except Exception:  # noqa: BLE001 - the first failure is the one raised
                    pass
            raise
        finally:  # also when a slice failed: later work on the devices must not race the copies in flight
            for dev in devices:
                for ev in [s.h2d[dev] for s in self._slots if dev in s.h2d]:
                    torch.cuda.current_stream(dev).wait_event(ev)
            for s in self._slots:  # the round is over: the buffers are free for the next one
                for ev in (*s.h2d.values(), *s.d2h.values()):
                    ev.synchronize()
                s.h2d.clear()
                s.d2h.clear()
        for rep, fl in zip(replicas, flats):
            for p, f in zip(rep, fl):
                if f.data_ptr() != p.data_ptr() or not p.is_contiguous():
                    p.copy_(f.view(p.shape))
        nbytes = sum(2 * p.numel() * p.element_size() for g in groups for p in g)
        self.last_round = Round(time.perf_counter() - t0, nbytes, len(plan), len(replicas))

    def _capacity(self, dtype: torch.dtype) -> int:
        # Buffers hold chunk fp32 elements; wider dtypes get fewer per slice.
        return max(1, self.chunk * 4 // max(4, _acc_dtype(dtype).itemsize))

    def _ensure_slots(self, nslots: int, nreplicas: int, *, any_cuda: bool) -> None:
        if len(self._slots) != nslots or len(self._slots[0].stage) != nreplicas:
            self._slots = [_Slot(stage=[None] * nreplicas) for _ in range(nslots)]
        if any_cuda and not torch.cuda.is_available():  # pragma: no cover - only a broken install gets here
            raise RuntimeError("CUDA tensors without CUDA")

    def _bytes(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pin and torch.cuda.is_available())

    def _stream(self, dev: torch.device) -> tuple[t.Any, t.Any]:
        if dev not in self._streams:
            self._streams[dev] = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
        return self._streams[dev]

    def _gather(self, flats: list[list[torch.Tensor]], piece: tuple[int, int, int], slot: _Slot) -> list[torch.Tensor]:
        """Each replica's slice on the host: a view for CPU tensors, an async D2H copy for CUDA ones."""
        k, a, b = piece
        out: list[torch.Tensor] = []
        for r, fl in enumerate(flats):
            src = fl[k][a:b]
            if src.device.type != "cuda" and not self._stage_host:
                out.append(src)
                continue
            if slot.stage[r] is None:
                slot.stage[r] = self._bytes(self.chunk * 4)
            dst = slot.stage[r].view(src.dtype)[: b - a]  # type: ignore[union-attr]
            if src.device.type != "cuda":
                dst.copy_(src)
                out.append(dst)
                continue
            stream = self._stream(src.device)[0]
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            ev = slot.d2h.get(src.device) or torch.cuda.Event()
            ev.record(stream)  # re-recorded after each replica: the last one covers them all
            slot.d2h[src.device] = ev
            out.append(dst)
        return out

    def _reduce(
        self, srcs: list[torch.Tensor], slot: _Slot, m: int, fused: list[torch.Tensor]
    ) -> tuple[t.Callable[[], torch.Tensor], bool]:
        """The mean ``r0 + sum(r_i - r0) / n`` in the accumulator dtype, then the cross-node hook started.

        Returns a function giving the mean in the replicas' dtype (it waits for an asynchronous hook's
        all_reduce), and whether ``fused`` (CPU destinations) already holds it.
        """
        dtype = srcs[0].dtype
        acc_dtype = _acc_dtype(dtype)
        if slot.acc is None:
            slot.acc = self._bytes(self.chunk * 4)
        acc = slot.acc.view(acc_dtype)[:m]
        n = len(srcs)
        if dtype == acc_dtype:
            arrays, acc_np, outs = [s.numpy() for s in srcs], acc.numpy(), [f.numpy() for f in fused]
            self._parallel(m, lambda lo, hi, tmp: _mean_block(arrays, acc_np, lo, hi, tmp, outs))
            if self.cross_reduce is None:
                return (lambda: acc), True
        else:  # bf16/fp16: rare (masters are fp32), torch in this thread with slice-sized temporaries
            base = srcs[0].to(acc_dtype)
            delta = torch.zeros(m, dtype=acc_dtype)
            for s in srcs[1:]:
                delta.add_(s.to(acc_dtype).sub_(base))
            torch.add(base, delta, alpha=1.0 / n, out=acc)
        wait = self.cross_reduce(acc, n) if self.cross_reduce is not None else None

        def finish() -> torch.Tensor:
            if wait is not None:
                wait()
            if dtype == acc_dtype:
                return acc
            if slot.out is None:
                slot.out = self._bytes(self.chunk * 4)
            out = slot.out.view(dtype)[:m]
            out.copy_(acc)
            return out

        return finish, False

    def _parallel(self, m: int, fn: t.Callable[[int, int, np.ndarray], None]) -> None:
        threads = min(self.threads, max(1, m // MIN_SPLIT))
        while len(self._scratch) < threads:
            self._scratch.append(np.empty(min(BLOCK, self.chunk), dtype=np.float64))  # room for fp64 blocks
        if threads == 1:
            fn(0, m, self._scratch[0])
            return
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="dflash-avg")
        step = -(-m // threads)
        step = -(-step // BLOCK) * BLOCK  # whole blocks per thread
        futures = [
            self._pool.submit(fn, lo, min(m, lo + step), self._scratch[i]) for i, lo in enumerate(range(0, m, step))
        ]
        for f in futures:
            f.result()

    def _scatter(
        self,
        flats: list[list[torch.Tensor]],
        piece: tuple[int, int, int],
        mean: torch.Tensor,
        slot: _Slot,
        *,
        cpu_done: bool,
    ) -> None:
        k, a, b = piece
        for fl in flats:
            dst = fl[k][a:b]
            if dst.device.type != "cuda":
                if not cpu_done:
                    dst.copy_(mean)
                continue
            stream = self._stream(dst.device)[1]
            with torch.cuda.stream(stream):
                dst.copy_(mean, non_blocking=True)
            ev = slot.h2d.get(dst.device) or torch.cuda.Event()
            ev.record(stream)
            slot.h2d[dst.device] = ev


def _mean_block(
    arrays: list[np.ndarray], acc: np.ndarray, lo: int, hi: int, scratch: np.ndarray, outs: list[np.ndarray]
) -> None:
    """acc[lo:hi] = a0 + sum(a_i - a0) / n, then into every ``outs``; block by block so the passes stay in cache."""
    n = len(arrays)
    tmp_all = scratch.view(acc.dtype)
    for x in range(lo, hi, BLOCK):
        y = min(hi, x + BLOCK)
        base, out, tmp = arrays[0][x:y], acc[x:y], tmp_all[: y - x]
        if n == 1:  # a node with one live replica: its weights are the local mean
            out[...] = base
            for dst in outs:
                dst[x:y] = out
            continue
        np.subtract(arrays[1][x:y], base, out=out)
        for arr in arrays[2:]:
            np.subtract(arr[x:y], base, out=tmp)
            np.add(out, tmp, out=out)
        np.multiply(out, acc.dtype.type(1.0 / n), out=out)
        np.add(out, base, out=out)
        for dst in outs:  # may be arrays[r] itself: this block of it is no longer read
            dst[x:y] = out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(replicas: t.Sequence[t.Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    count = len(replicas[0])
    for r, rep in enumerate(replicas):
        if len(rep) != count:
            raise ValueError(f"replica {r} has {len(rep)} tensors, replica 0 has {count}")
    groups = []
    for k in range(count):
        group = [rep[k] for rep in replicas]
        shape, dtype = group[0].shape, group[0].dtype
        for r, p in enumerate(group):
            if p.shape != shape:
                raise ValueError(f"tensor {k}: replica {r} has shape {tuple(p.shape)}, replica 0 {tuple(shape)}")
            if p.dtype != dtype:
                raise ValueError(f"tensor {k}: replica {r} has dtype {p.dtype}, replica 0 {dtype}")
            if not p.dtype.is_floating_point:
                raise ValueError(f"tensor {k}: {p.dtype} cannot be averaged")
        groups.append(group)
    return groups


def _flat(p: torch.Tensor) -> torch.Tensor:
    # Parameters are contiguous, so this is a view and the slices write straight into the replica.
    return p.view(-1) if p.is_contiguous() else p.reshape(-1).clone()


def average_modules(modules: t.Sequence[torch.nn.Module], averager: Averager | None = None) -> None:
    """Average the trainable parameters (requires_grad) of same-structured modules; frozen ones untouched."""
    replicas = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    (averager or Averager.for_replicas(replicas)).average(replicas)


# -- the copy bound: what a round cannot beat ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    """Bytes per second of one big copy out of a device's memory into host memory and back."""

    out: float  # D2H into pinned memory (host memcpy for the CPU)
    back: float  # H2D from pinned memory


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 256 << 20, repeats: int = 3) -> CopyBandwidth:
    """Best of ``repeats`` timed copies of ``nbytes`` (syncs here are fine: this is a measurement)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)

    def best(fn: t.Callable[[], object]) -> float:
        fn()  # first touch / warm-up
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    out = best(lambda: host.copy_(src, non_blocking=cuda))
    back = best(lambda: src.copy_(host, non_blocking=cuda))
    return CopyBandwidth(out, back)


def copy_bound_seconds(
    replicas: t.Sequence[t.Sequence[torch.Tensor]], bandwidth: t.Mapping[torch.device, CopyBandwidth]
) -> float:
    """Seconds to copy every replica's tensors out once and back once at the measured bandwidth.

    Per device: its bytes / ``out`` + its bytes / ``back`` (no overlap of the two directions assumed).
    CUDA devices have their own links and run in parallel (the bound is the slowest device); CPU replicas
    share the host's memory bus, so theirs add up.
    """
    per_dev: dict[torch.device, int] = {}
    for rep in replicas:
        for p in rep:
            per_dev[p.device] = per_dev.get(p.device, 0) + p.numel() * p.element_size()
    cuda = [b / bandwidth[d].out + b / bandwidth[d].back for d, b in per_dev.items() if d.type == "cuda"]
    cpu = sum(b / bandwidth[d].out + b / bandwidth[d].back for d, b in per_dev.items() if d.type != "cuda")
    return max(cuda, default=0.0) + cpu


__all__ = [
    "Averager",
    "CopyBandwidth",
    "CrossReduce",
    "DEFAULT_CHUNK",
    "Round",
    "average_modules",
    "copy_bound_seconds",
    "measure_copy_bandwidth",
]
