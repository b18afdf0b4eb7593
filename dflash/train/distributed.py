"""The node group: one ``dflash train`` process per node, joined by ``torch.distributed`` (gloo).

A multi-node run is launched by torchrun on every node::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN \\
        -m dflash train --config run.toml

torchrun sets ``RANK``/``WORLD_SIZE`` (and the store address) in the environment; ``NodeGroup.from_env``
joins the gloo process group from them. Without them (a plain ``python -m dflash train``), or with a
group of one, there is no group and the run is exactly the single-node one.

What crosses the nodes, and only at the drafters' barrier (every node reaches the same barriers in the
same order: steps are counted the same way everywhere, see ``dflash.train.run``):

- a small header per barrier (``exchange``): step, what the barrier does, live replicas, tokens trained
  since the last one, a pending stop; every node checks that all agree before any tensor moves;
- averaging: each tensor slice's local mean is ``all_reduce``-d (``cross_reduce``) weighted by the
  live replicas per node, in place in the averager's host buffer, so peak extra memory stays one slice;
- checkpoints: the data positions and anchor generators of every node are gathered to rank 0, which alone
  writes; at resume rank 0 loads and broadcasts the checkpoint (no shared filesystem needed).

Every collective waits at most ``[distributed] timeout`` seconds (gloo's own timeout). A peer that died
(connection reset) or hangs (timeout) makes the collective raise; it is re-raised as ``PeerLost`` with the
step and what the group was doing, and the run exits non-zero.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import threading
import time
import typing as t

import torch
import torch.distributed as dist

from dflash.errors import DflashError
from dflash.train.pipeline import SyncEvent

logger = logging.getLogger("dflash.distributed")  # the name train.log has always shown
# The barrier's lines are the run's and keep the name they had in train.py (dflash.train.run).
run_logger = logging.getLogger("dflash.train")

# The exception line a node writes when the group broke (dflashctl's status classifies it as peer-lost).
PEER_LOST = "lost the node group"


class PeerLost(DflashError, RuntimeError):
    """A collective failed: another node died, hangs, or the nodes fell out of step."""


class Disagreement(DflashError, RuntimeError):
    """The nodes reached a barrier with different steps or plans (different configs)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """What one node says at a barrier, before any tensor moves."""

    index: int  # barriers so far on this node: every node must be at the same one
    step: int
    average: bool
    checkpoint: bool
    final: bool
    replicas: int  # live drafter replicas on this node taking part in the averaging
    tokens: int  # target tokens trained since the last barrier
    seconds: float  # wall time since the last barrier
    stop: int  # a signal number when this node was asked to stop, else 0


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
    """Every node's header at one barrier."""

    headers: tuple[Header, ...]

    @property
    def replicas(self) -> int:
        return sum(h.replicas for h in self.headers)

    @property
    def stop(self) -> int:
        return max(h.stop for h in self.headers)


class NodeGroup:
    """This node's place in the group (rank, world) and the collectives the trainer uses."""

    def __init__(self, *, rank: int, world: int, timeout: float) -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.total_replicas = 0  # the weight of a cross-node mean: set by ``exchange`` for the round
        self.doing = "starting"  # for PeerLost messages
        self.step = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: t.Mapping[str, str], *, timeout: float) -> NodeGroup | None:
        """Join the group torchrun describes in ``environ``; None for a plain run (or a group of one)."""
        if "WORLD_SIZE" not in environ or "RANK" not in environ:
            return None
        world, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
        if world <= 1:
            return None
        local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
        if local != 1:
            raise ValueError(
                f"torchrun started {local} processes on this node; dflash train runs one per node "
                "(its drafter and target threads use every device of the node): --nproc-per-node 1"
            )
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
            # torchrun reuses the workers' store across rendezvous rounds: a restarted round can read the last
            # round's gloo addresses and time out connecting to dead ones (seen in CI). Refuse before training.
            raise ValueError(
                "torchrun --max-restarts with its shared rendezvous store can hand a restarted group the previous "
                "round's addresses: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                "(dflashctl --group does)"
            )
        # env:// also picks up torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) instead of a new one.
        dist.init_process_group("gloo", init_method="env://", timeout=dt.timedelta(seconds=timeout))
        group = cls(rank=rank, world=world, timeout=timeout)
        logger.info(
            "node group: node %d of %d (gloo, %s:%s; collectives time out after %gs)",
            rank,
            world,
            os.environ.get("MASTER_ADDR", "?"),
            os.environ.get("MASTER_PORT", "?"),
            timeout,
        )
        return group

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # collectives -----------------------------------------------------------------------------

    def _failed(self, e: BaseException) -> PeerLost:
        text = " ".join(str(e).split())
        return PeerLost(
            f"node {self.rank} of {self.world} {PEER_LOST} at step {self.step} ({self.doing}; "
            f"[distributed] timeout {self.timeout:g}s): {text}"
        )

    def _call(self, fn: t.Callable[[], t.Any]) -> t.Any:
        try:
            return fn()
        except RuntimeError as e:  # gloo: "Connection reset by peer", "Timed out waiting ...", ...
            raise self._failed(e) from e

    def all_gather(self, obj: t.Any) -> list[t.Any]:
        """Every node's ``obj`` (picklable, small), in rank order."""
        out: list[t.Any] = [None] * self.world
        self._call(lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast(self, obj: t.Any, *, src: int = 0) -> t.Any:
        """Node ``src``'s ``obj`` on every node (others pass anything, e.g. None)."""
        box = [obj]
        self._call(lambda: dist.broadcast_object_list(box, src=src))
        return box[0]

    def exchange(self, header: Header, *, doing: str) -> Round:
        """The barrier's headers of every node; raises ``Disagreement`` when they are not at the same point."""
        self.doing, self.step = doing, header.step
        headers = tuple(t.cast(list[Header], self.all_gather(header)))
        if len({(h.index, h.average, h.checkpoint, h.final) for h in headers}) > 1:
            shown = ", ".join(
                f"node {r}: barrier {h.index} at step {h.step}{' average' if h.average else ''}"
                f"{' checkpoint' if h.checkpoint else ''}{' final' if h.final else ''}"
                for r, h in enumerate(headers)
            )
            raise Disagreement(
                f"the nodes reached different barriers ({shown}); every node must run the same "
                "config (max_steps, average_every, checkpoint.interval)"
            )
        rnd = Round(headers)
        self.total_replicas = rnd.replicas
        return rnd

    def cross_reduce(self, mean: torch.Tensor, count: int) -> t.Callable[[], None]:
        """The averager's hook: this slice's local mean over ``count`` replicas -> the mean over every node.

        In place: sum over nodes of mean * count, divided by the replicas of every node (``exchange``
        set it for the round). gloo's all_reduce hands every node the same bytes, so every replica on
        every node ends the round bit-identical. Asynchronous: the all_reduce starts here (gloo's own
        threads carry it) and the returned function waits for it and divides, which the averager calls
        once it has reduced the next slice (every node issues the same slices in the same order).
        """
        if count != 1:
            mean.mul_(count)
        work = self._call(lambda: dist.all_reduce(mean, op=dist.ReduceOp.SUM, async_op=True))

        def finish() -> None:
            self._call(work.wait)
            mean.div_(self.total_replicas)

        return finish


class GroupBarrier:
    """This node's side of the drafters' barrier in a group: the same collectives in the same order on every node.

    ``meet`` first: the headers (the nodes must be at the same barrier; per-node throughput, rank 0 logs the
    ``nodes | step`` line; a pending stop). Then the run averages over every node's replicas (also before a
    checkpoint: rank 0 saves its replica for all) and checkpoints; then ``stopping``: a SIGTERM on any node
    stops every node here.
    """

    def __init__(self, group: NodeGroup) -> None:
        self.group = group
        self._tokens = 0  # target tokens trained since the last barrier (the group's per-node split)
        self._tokens_lock = threading.Lock()
        self._last_sync = time.monotonic()
        self._syncs = 0  # barriers so far: every node must be at the same one
        self.stop = 0  # the signal another node of the group received (we stopped with it)

    def count(self, tokens: int) -> None:
        """Tokens a drafter step trained (from the drafter threads)."""
        with self._tokens_lock:
            self._tokens += tokens

    def restart(self) -> None:
        """The first interval starts now (training starts)."""
        self._last_sync = time.monotonic()

    def meet(self, ev: SyncEvent, *, stop: int) -> Round:
        """Every node's header at this barrier; ``stop``: a signal this node received (0: none)."""
        now = time.monotonic()
        with self._tokens_lock:
            tokens, self._tokens = self._tokens, 0
        seconds, self._last_sync = now - self._last_sync, now
        self._syncs += 1
        header = Header(
            index=self._syncs,
            step=ev.step,
            average=ev.average,
            checkpoint=ev.checkpoint,
            final=ev.final,
            replicas=len(ev.replicas),
            tokens=tokens,
            seconds=seconds,
            stop=stop,
        )
        rnd = self.group.exchange(header, doing="the barrier")
        step = rnd.headers[0].step  # with several drafters per node the steps in flight differ a little: rank 0's
        if self.group.is_main:
            per = [h.tokens / max(h.seconds, 1e-9) / 1e3 for h in rnd.headers]
            run_logger.info(
                "nodes | step %d | %.1f Ktok/s | %s",
                step,
                sum(per),
                " | ".join(f"node-{r} {k:.1f}" for r, k in enumerate(per)),
            )
        return rnd

    def stopping(self, rnd: Round, step: int) -> None:
        """A node asked to stop: every node stops after this barrier (the run requests its pipeline's stop)."""
        asked = [r for r, h in enumerate(rnd.headers) if h.stop]
        run_logger.warning(
            "stop requested on node(s) %s: every node stops after the barrier at step %d",
            ", ".join(map(str, asked)),
            step,
        )
        self.stop = rnd.stop


__all__ = ["Disagreement", "GroupBarrier", "Header", "NodeGroup", "PEER_LOST", "PeerLost", "Round"]
