"""Batch planning: global batch index g -> the sample indices of that batch, over endless epochs.

Batches form ONE deterministic global sequence ``g = 0, 1, 2, ...`` over endless epochs: each epoch
shuffles the samples (seeded by ``seed`` and the epoch), sorts windows of ``bucket_window`` batches' worth
of samples by length (bucketing: little padding), cuts them into batches of at most ``batch_size``
sequences and ``max_batch_tokens`` padded tokens (``cut_window``), and shuffles the batch order inside the
window. ``BatchPlan`` is that plan; a JSONL dataset's is built per epoch from its list of lengths.

A token store's (``dflash.data.store``) follows the same rules one window at a time (``WindowPlan``): its shuffle
is a seeded permutation evaluated per window (``Permutation``), its lengths are read from the store's
offsets as needed (``StoreLengths``), and an epoch is a lazy view (``LazyEpoch``): start-up and memory are
O(1) in the corpus size. With ``max_batch_tokens`` below ``batch_size`` x the longest sequence, batches per
epoch (for ``epochs``) are estimated from a sample of windows when there are many.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import threading
import typing as t

import numpy as np

from dflash.data.store import TokenStore
from dflash.errors import DataError


class BatchPlan:
    """Global batch index g -> sample indices, over endless epochs (see the module docstring)."""

    def __init__(
        self,
        lengths: t.Sequence[int],
        *,
        batch_size: int,
        max_batch_tokens: int | None = None,
        bucket_window: int = 64,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not len(lengths):
            raise DataError("data: no samples to batch")
        self.lengths = lengths
        self.batch_size = batch_size
        self._np = hasattr(lengths, "dtype")  # a token store's lengths (or an array): the lazy window plan
        longest = int(lengths.max()) if self._np else max(lengths)  # type: ignore[attr-defined]
        self.max_batch_tokens = max_batch_tokens if max_batch_tokens is not None else batch_size * longest
        self.window = bucket_window * batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._lock = threading.Lock()
        self._starts = [0]  # _starts[e] = global index of epoch e's first batch
        self._plans: dict[int, list[list[int]]] = {}
        self._lazy: t.Any = None
        if self._np:
            self._lazy = WindowPlan(
                lengths,
                batch_size=batch_size,
                max_batch_tokens=self.max_batch_tokens,
                window=self.window,
                shuffle=shuffle,
                seed=seed,
            )

    def fingerprint(self) -> str:
        key = f"{self.batch_size}:{self.max_batch_tokens}:{self.window}:{self.shuffle}:{self.seed}:{len(self.lengths)}"
        if self._np:  # another batch order than the list plan's
            key += ":windows"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def epoch(self, e: int) -> t.Sequence[list[int]]:
        if self._lazy is not None:  # a view: its len() counts every window, O(corpus)
            return t.cast(t.Sequence[list[int]], LazyEpoch(self._lazy, e, self._lock))
        with self._lock:
            return self._epoch(e)

    def batches_per_epoch(self) -> tuple[int, bool]:
        """(batches in epoch 0, exact?): a token store's plan estimates it from a sample of its windows when
        there are many (counting them all is O(corpus)); the list plan counts."""
        if self._lazy is not None:
            with self._lock:
                return t.cast(tuple[int, bool], self._lazy.estimate_epoch_len())
        return len(self.epoch(0)), True

    def _epoch(self, e: int) -> list[list[int]]:
        plan = self._plans.get(e)
        if plan is None:
            plan = self._build(e)
            self._plans[e] = plan
            for old in [k for k in self._plans if k < e - 2]:  # threads stay within an epoch or two
                del self._plans[old]
        return plan

    def _build(self, e: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + e)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        batches: list[list[int]] = []
        for w in range(0, len(order), self.window):
            chunk = sorted(order[w : w + self.window], key=lambda i: self.lengths[i])
            window = cut_window(
                chunk,
                [self.lengths[i] for i in chunk],
                batch_size=self.batch_size,
                max_batch_tokens=self.max_batch_tokens,
            )
            if self.shuffle:
                rng.shuffle(window)
            batches.extend(window)
        return batches

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of global batch g."""
        if g < 0:
            raise IndexError(g)
        with self._lock:
            if self._lazy is not None:
                e, w, j = self._lazy.locate(g)
                return e, t.cast(int, self._lazy.index_in_epoch(e, w, j))
            while g >= self._starts[-1]:
                e = len(self._starts) - 1
                self._starts.append(self._starts[-1] + len(self._epoch(e)))
            lo, hi = 0, len(self._starts) - 1
            while hi - lo > 1:  # largest e with _starts[e] <= g
                mid = (lo + hi) // 2
                if self._starts[mid] <= g:
                    lo = mid
                else:
                    hi = mid
            return lo, g - self._starts[lo]

    def batch(self, g: int) -> list[int]:
        if self._lazy is not None:
            with self._lock:
                return t.cast(list[int], self._lazy.batch(g))
        e, j = self.locate(g)
        return self.epoch(e)[j]


class StoreLengths:
    """Per usable sequence of a store its length cut to ``max_length``, read from the offsets memmap as needed.

    ``lengths[idx]`` (an index array) gathers; ``len``, ``max`` and ``dtype`` are O(1). Only a run whose
    ``max_length`` is below the store's longest sequence pays one pass over ``first_anchor`` (4 bytes per
    sequence) to leave out the sequences whose first anchor the cut loses; ``np.asarray`` materializes.
    """

    dtype = np.dtype(np.int64)

    def __init__(self, store: TokenStore, max_length: int) -> None:
        self.offsets = store.offsets
        self.max_length = max_length
        n = len(store)
        longest = int(store.meta.get("max_length", -1))
        if longest < 0 and n:  # a store without the key (older): one pass
            longest = int(np.diff(store.offsets).max())
        self.index: np.ndarray | None = None
        if longest > max_length and n:
            keep = np.asarray(store.first_anchor) + 2 <= max_length  # a cut sequence keeps an anchor
            if not keep.all():
                self.index = np.flatnonzero(keep)
        self._len = n if self.index is None else len(self.index)
        self._max = min(longest, max_length) if n else 0

    def __len__(self) -> int:
        return self._len

    def max(self) -> int:
        return self._max

    def store_index(self, i: t.Any) -> t.Any:
        return i if self.index is None else self.index[i]

    def __getitem__(self, i: t.Any) -> t.Any:
        j = np.asarray(self.store_index(i), dtype=np.int64)
        return np.minimum(self.offsets[j + 1] - self.offsets[j], self.max_length)

    def __array__(self, dtype: t.Any = None, copy: t.Any = None) -> np.ndarray:
        out = self[np.arange(self._len)]
        return out if dtype is None else out.astype(dtype)


def store_lengths(store: TokenStore, max_length: int) -> StoreLengths:
    return StoreLengths(store, max_length)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9))


class Permutation:
    """A seeded pseudo-random permutation of ``range(n)``, evaluated at any positions in O(positions).

    A 4-round Feistel network on ``Z_a x Z_b`` (a ~ b ~ sqrt(n), a * b >= n; each round maps (L, R) to
    (R, (L + F(R)) mod |L's range|), invertible, so a bijection), with cycle-walking (apply again while the
    value is >= n, rare: a * b - n < a): a bijection of ``range(n)``, and nothing is built over n.
    """

    def __init__(self, n: int, key: t.Sequence[int]) -> None:
        self.n = n
        self.a = math.isqrt(max(n - 1, 0)) + 1
        self.b = -(-n // self.a)
        self.keys = [np.uint64(k & 0xFFFFFFFFFFFFFFFF) for k in key]

    def _once(self, x: np.ndarray) -> np.ndarray:
        mods = (np.uint64(self.a), np.uint64(self.b))
        left, right = x // mods[1], x % mods[1]
        for r, k in enumerate(self.keys):
            f = (right ^ k) * _MIX[0]
            f ^= f >> np.uint64(32)
            f *= _MIX[1]
            f ^= f >> np.uint64(29)
            left, right = right, (left + f % mods[r % 2]) % mods[r % 2]
        return left * mods[1] + right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = self._once(np.asarray(positions, dtype=np.uint64))
            out = x >= self.n
            while out.any():  # cycle-walking
                x[out] = self._once(x[out])
                out = x >= self.n
        return x.astype(np.int64)


def cut_window(chunk: list[int], lens: list[int], *, batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Greedy batches of a window sorted by length (ascending: each new sample is the longest so far)."""
    window: list[list[int]] = []
    cur: list[int] = []
    for i, n in zip(chunk, lens):
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * n > max_batch_tokens):
            window.append(cur)
            cur = []
        cur.append(i)
    if cur:
        window.append(cur)
    return window


class WindowPlan:
    """The batch plan of a token store, built one window at a time (O(window), never O(corpus)).

    Epoch e orders the samples by a seeded permutation (``Permutation``, evaluated per window); window w
    is positions ``[w * window, (w + 1) * window)`` of that order, sorted by length (stably), cut greedily
    and its batch order shuffled: the list plan's rules. A window's batches are built when a global index
    falls into it (the last 64 kept). When every batch is full (``max_batch_tokens`` at its default,
    ``batch_size`` x the longest) a window's batch count is its size / batch_size, so global index ->
    (epoch, window, batch) is arithmetic. Otherwise per-window counts are kept (one int per window) and
    ``locate`` walks the windows up to the index asked for: a resume far into such a run builds every window
    before its position once (about 0.5 ms each).
    """

    ESTIMATE_WINDOWS = 32  # batches per epoch of a bigger corpus: estimated from this many windows

    def __init__(
        self, lengths: t.Any, *, batch_size: int, max_batch_tokens: int, window: int, shuffle: bool, seed: int
    ) -> None:
        self.lengths = lengths
        self.n = len(lengths)
        self.batch_size, self.max_batch_tokens, self.window = batch_size, max_batch_tokens, window
        self.shuffle, self.seed = shuffle, seed
        self.windows = -(-self.n // window)  # per epoch
        # every batch full (max_batch_tokens at its default, batch_size x longest): counts are arithmetic
        self.full = batch_size * int(lengths.max()) <= max_batch_tokens
        self._perms: dict[int, Permutation] = {}
        self._counts: dict[int, list[int]] = {}  # epoch -> cumulative batch counts of its first windows
        self._starts = [0]  # global index of epoch e's first batch, for the epochs fully counted
        self._cache: dict[tuple[int, int], list[list[int]]] = {}

    def _perm(self, e: int) -> Permutation | None:
        if not self.shuffle:
            return None
        p = self._perms.get(e)
        if p is None:
            key = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, e]).integers(0, 2**63, size=4)
            p = self._perms[e] = Permutation(self.n, [int(k) for k in key])
            for old in [k for k in self._perms if k < e - 2]:
                del self._perms[old]
        return p

    def window_batches(self, e: int, w: int) -> list[list[int]]:
        got = self._cache.get((e, w))
        if got is not None:
            return got
        pos = np.arange(w * self.window, min((w + 1) * self.window, self.n), dtype=np.int64)
        perm = self._perm(e)
        idx = perm(pos) if perm is not None else pos
        lens = np.asarray(self.lengths[idx])
        s = np.argsort(lens, kind="stable")
        batches = self._cut(idx[s].tolist(), lens[s])
        if self.shuffle:
            random.Random((self.seed * 1_000_003 + e) * 1_000_003 + w).shuffle(batches)
        if len(self._cache) >= 64:  # the windows the target threads are in, and a few behind
            del self._cache[next(iter(self._cache))]
        self._cache[(e, w)] = batches
        return batches

    def _cut(self, chunk: list[int], lens: np.ndarray) -> list[list[int]]:
        """``cut_window`` vectorized: k[p], how many samples the greedy batch starting at p takes, for every p."""
        m = len(lens)
        if self.full:
            return [chunk[p : p + self.batch_size] for p in range(0, m, self.batch_size)]
        pos = np.arange(m)
        k = np.ones(m, dtype=np.int64)
        for j in range(2, self.batch_size + 1):
            last = pos + j - 1
            grow = (k == j - 1) & (last < m) & (j * lens[np.minimum(last, m - 1)] <= self.max_batch_tokens)
            if not grow.any():
                break
            k[grow] = j
        takes = k.tolist()
        out = []
        p = 0
        while p < m:
            out.append(chunk[p : p + takes[p]])
            p += takes[p]
        return out

    def _count_to(self, e: int, w: int) -> list[int]:
        """Epoch e's cumulative counts through window w (``counts[w + 1]``: batches in windows 0..w)."""
        counts = self._counts.setdefault(e, [0])
        while len(counts) <= w + 1:
            v = len(counts) - 1
            c = -(-self._window_len(v) // self.batch_size) if self.full else len(self.window_batches(e, v))
            counts.append(counts[-1] + c)
        return counts

    def _window_len(self, w: int) -> int:
        return min(self.window, self.n - w * self.window)

    def epoch_len(self, e: int) -> int:
        if self.full:
            return self.estimate_epoch_len()[0]
        return self._count_to(e, self.windows - 1)[-1]

    def estimate_epoch_len(self) -> tuple[int, bool]:
        """(batches in epoch 0, exact?): exact up to ESTIMATE_WINDOWS windows, else from that many spread
        over the epoch (the full count walks every window: O(corpus))."""
        if self.full:
            full = -(-self.window // self.batch_size)
            return full * (self.windows - 1) + -(-self._window_len(self.windows - 1) // self.batch_size), True
        if self.windows <= self.ESTIMATE_WINDOWS:
            return self.epoch_len(0), True
        ws = np.linspace(0, self.windows - 2, self.ESTIMATE_WINDOWS).round().astype(int)  # full windows
        per = sum(len(self.window_batches(0, int(w))) for w in ws) / len(ws)
        last = len(self.window_batches(0, self.windows - 1))
        return max(1, round(per * (self.windows - 1)) + last), False

    def locate(self, g: int) -> tuple[int, int, int]:
        """(epoch, window, index within the window) of global batch g."""
        if g < 0:
            raise IndexError(g)
        if self.full:  # every window but an epoch's last has the same count: arithmetic, O(1) anywhere
            per_epoch = self.estimate_epoch_len()[0]
            e, j = divmod(g, per_epoch)
            w, k = divmod(j, -(-self.window // self.batch_size))
            return e, w, k
        while True:
            e = bisect.bisect_right(self._starts, g) - 1
            j = g - self._starts[e]
            if e < len(self._starts) - 1:  # an epoch fully counted before (its counts may have been dropped)
                counts = self._count_to(e, self.windows - 1)
                break
            counts = self._count_to(e, 0)
            while counts[-1] <= j and len(counts) <= self.windows:  # count windows until g is in one
                counts = self._count_to(e, len(counts) - 1)
            if counts[-1] > j:
                break
            self._starts.append(self._starts[e] + counts[-1])  # epoch e is complete and g lies beyond it
            for old in [k for k in self._counts if k < e - 2]:
                del self._counts[old]
        w = bisect.bisect_right(counts, j) - 1
        return e, w, j - counts[w]

    def batch(self, g: int) -> list[int]:
        e, w, j = self.locate(g)
        return self.window_batches(e, w)[j]

    def index_in_epoch(self, e: int, w: int, k: int) -> int:
        if self.full:
            return w * -(-self.window // self.batch_size) + k
        return self._count_to(e, w)[w] + k

    def epoch_batch(self, e: int, j: int) -> list[int]:
        if self.full:
            w, k = divmod(j, -(-self.window // self.batch_size))
            return self.window_batches(e, w)[k]
        counts = self._count_to(e, self.windows - 1)
        w = bisect.bisect_right(counts, j) - 1
        return self.window_batches(e, w)[j - counts[w]]


class LazyEpoch:
    """One epoch of a ``WindowPlan`` as a sequence of batches (``len`` counts every window: O(corpus))."""

    def __init__(self, plan: WindowPlan, e: int, lock: t.Any) -> None:
        self.plan, self.e, self.lock = plan, e, lock

    def __len__(self) -> int:
        with self.lock:
            return self.plan.epoch_len(self.e)

    def __getitem__(self, j: int) -> list[int]:
        if not 0 <= j < len(self):
            raise IndexError(j)
        with self.lock:
            return self.plan.epoch_batch(self.e, j)

    def __iter__(self) -> t.Iterator[list[int]]:
        return (self[j] for j in range(len(self)))


__all__ = [
    "BatchPlan",
    "LazyEpoch",
    "Permutation",
    "StoreLengths",
    "WindowPlan",
    "cut_window",
    "store_lengths",
]
