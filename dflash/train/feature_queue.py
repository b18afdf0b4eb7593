"""The pipeline's ONE queue between targets and drafters: a FIFO bounded in items and in the bytes its
items hold (pinned host memory or a drafter GPU's), from before a target's forward to the end of the
drafter step that used them (docs/design.md section 16)."""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import typing as t

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    """One batch of target features in the queue."""

    payload: t.Any
    tokens: int  # target tokens behind it (Ktok/s)
    position: int  # its global batch index
    shard: int
    target: int
    nbytes: int = 0  # memory the payload holds (the queue's byte bound)


def pinned_host_bytes(peak: bool = False) -> int:
    """Pinned host memory torch's caching host allocator holds (in use + cached), or its peak; 0 if unknown."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):  # a torch without host stats, or no CUDA
        return 0
    key = "allocated_bytes.peak" if peak else "allocated_bytes.current"
    return int(stats.get(key, stats.get(f"allocated_bytes.all.{'peak' if peak else 'current'}", 0)) or 0)


def cached_host_bytes() -> int:
    """Pinned host memory torch's caching host allocator holds unused (cached, not active); 0 if unknown.

    Pinned blocks in use elsewhere (the checkpoint snapshot's buffers, the averager's slots: tens of GB)
    count in ``allocated_bytes`` too, so only this part says whether freeing the cache would free anything."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):  # a torch without host stats, or no CUDA
        return 0
    allocated, active = stats.get("allocated_bytes.current"), stats.get("active_bytes.current")
    if allocated is None or active is None:
        return 0
    return max(int(allocated) - int(active), 0)


# queue.max_bytes never derives below this (the bound before it was derived; pinned host RAM is plentiful)
MIN_DEFAULT_BYTES = 4 << 30


def default_max_bytes(*, drafters: int, targets: int, accumulate: int, item_bytes: int) -> int:
    """``queue.max_bytes`` when unset: every drafter's accumulated items plus the one it takes next, and one
    being made per target, at the largest item. Below that, the targets run one at a time through the
    over-bound path (3 drafters x 11 items of 256 MiB against 4 GiB: ~56% of the drafters' rate)."""
    return max(MIN_DEFAULT_BYTES, (drafters * (accumulate + 1) + targets) * item_bytes)


def pinned_block(n: int) -> int:
    """The caching host allocator's block for ``n`` bytes: the next power of two."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def feature_item_bytes(tokens: int, feature_size: int, itemsize: int, *, pinned: bool) -> int:
    """What an item of ``tokens`` padded tokens holds at most: its features (a pinned block when a GPU
    target hands them over through host memory) and int64 ids and loss mask. The largest one sizes the
    queue's default bound (``default_max_bytes``); ``dflash plan`` sizes the host with it too."""
    feats = tokens * feature_size * itemsize
    return (pinned_block(feats) if pinned else feats) + 2 * tokens * 8


def short_bound_warning(max_bytes: int, *, drafters: int, accumulate: int, item_bytes: int) -> str | None:
    """One line when a set bound is below what the drafters hold while they accumulate (None: it is not)."""
    held = drafters * accumulate * item_bytes
    if max_bytes >= held:
        return None
    return (
        f"queue.max_bytes {format_bytes(max_bytes)} is below what {drafters} drafters accumulating {accumulate} "
        f"items of up to {format_bytes(item_bytes)} hold ({format_bytes(held)}): targets will run one at a time "
        "at full-length batches; unset it to derive one"
    )


def empty_host_cache() -> None:
    """Free the caching host allocator's unused pinned blocks (no-op where torch has no such call)."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if fn is not None:
        fn()


def payload_bytes(payload: t.Any) -> int:
    """Bytes a queue item holds: ``payload.nbytes`` (FeatureBatch, a tensor), 0 for anything else."""
    n = getattr(payload, "nbytes", 0)
    return int(n) if isinstance(n, int) else 0


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class FeatureQueue:
    """A FIFO bounded by items AND by the bytes its items hold (``Item.nbytes``); ``queue.Queue``'s
    put/get/qsize/maxsize.

    Bytes are held from ``reserve`` (a target, before its forward allocates the features) or ``put`` until
    the consumer's ``release`` (a drafter, after the step that used them): an item a drafter has taken still
    holds its pinned host memory or GPU memory, so it still counts. ``put`` of an unreserved item and
    ``reserve`` block while the bytes would overflow the bound; nothing held admits anything, so a batch
    larger than ``max_bytes`` still flows (alone). ``peak_bytes`` is the most it ever held.

    Progress: drafters that accumulate hold items while they wait for more, so when what they hold already
    fills the bound (drafters x accumulate items larger than ``max_bytes``: 3 x 11 items of 2048 tokens of
    a 27B target's features are ~4.4 GB) nothing could be admitted and every worker would wait forever.
    So while a consumer waits on an empty queue and no item is being made, one item is admitted over the
    bound: the excess is one item at a time, beyond what the waiting drafters hold.
    """

    def __init__(self, maxsize: int, max_bytes: int | None = None) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.bytes = 0
        self.peak_bytes = 0
        self.queue: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._making = 0  # reservations not yet put (items being made)
        self._starved = 0  # consumers waiting in ``get`` on an empty queue

    def qsize(self) -> int:
        with self._cond:
            return len(self.queue)

    def _room(self, nbytes: int) -> bool:
        if self.bytes == 0 or self.max_bytes is None or self.bytes + nbytes <= self.max_bytes:
            return True
        # over the bound: only so that a starved consumer gets its next item (see the class's "Progress")
        return not self.queue and self._making == 0 and self._starved > 0

    def _wait(self, ok: t.Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ok():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Full
            self._cond.wait(left)

    def _hold(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        """Hold ``nbytes`` for an item about to be made (``put(..., reserved=True)`` then adds no more)."""
        with self._cond:
            self._wait(lambda: self._room(nbytes), timeout)
            self._hold(nbytes)
            self._making += 1

    def unreserve(self, nbytes: int) -> None:
        """A reserved item will not be put (its forward failed, or the run stops): its bytes are free."""
        with self._cond:
            self._making = max(0, self._making - 1)
            self.bytes = max(0, self.bytes - nbytes)
            self._cond.notify_all()

    def adjust(self, delta: int) -> None:
        """A held item turned out ``delta`` bytes larger (or smaller) than reserved."""
        with self._cond:
            self.bytes = max(0, self.bytes + delta)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        """The consumer is done with an item: its bytes are free."""
        if nbytes:
            with self._cond:
                self.bytes = max(0, self.bytes - nbytes)
                self._cond.notify_all()

    def discard(self) -> int:
        """Drop what is still queued (the run is over: no drafter will take it) and free its bytes."""
        with self._cond:
            n = len(self.queue)
            self.bytes = max(0, self.bytes - sum(it.nbytes for it in self.queue))
            self.queue.clear()
            self._cond.notify_all()
            return n

    def put(self, item: Item, timeout: float | None = None, *, reserved: bool = False) -> None:
        with self._cond:
            if reserved:
                self._wait(lambda: len(self.queue) < self.maxsize or not self.queue, timeout)
                self._making = max(0, self._making - 1)
            else:
                self._wait(lambda: len(self.queue) < self.maxsize and self._room(item.nbytes), timeout)
                self._hold(item.nbytes)
            self.queue.append(item)
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Item:
        """The next item; its bytes stay held until ``release``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self.queue:
                self._starved += 1
                self._cond.notify_all()  # a producer held back by the bound may now admit one item
                try:
                    while not self.queue:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise queue.Empty
                        self._cond.wait(left)
                finally:
                    self._starved -= 1
            item = self.queue.popleft()
            self._cond.notify_all()
            return item
