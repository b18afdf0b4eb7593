"""Training data: token sequences with loss masks, in batches, sharded over target threads.

A JSONL file holds one sample per line, either pre-tokenized::

    {"input_ids": [151644, 872, ...], "loss_mask": [0, 0, ..., 1, 1]}     # loss_mask optional: all ones

or chat messages rendered with a tokenizer's chat template (assistant turns supervised)::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

``data.path`` may also be a token store folder written by ``dflash prepare-data`` (dflash/data/store.py):
it is memory-mapped, not indexed, and refused when made for another tokenizer or chat template.

The file is indexed once (byte offset and token length per line); samples are parsed again on demand
in the target threads (``os.pread``, no shared file position), so memory stays small for big files.
Samples are cut to ``max_length``; a sample without two consecutive supervised tokens (no possible
anchor) is skipped and counted.

Batches form ONE deterministic global sequence ``g = 0, 1, 2, ...`` over endless epochs (the plan:
``dflash.data.batching``). Target thread ``i`` of ``T`` reads batches ``g = i, i+T, i+2T, ...`` (deterministic
sharding). The data position is the next ``g`` of every shard; saved in checkpoints, it makes a resumed run
continue with the same next batch. Resuming with another number of target threads restarts every shard
from the smallest saved position (a few batches are seen twice, none skipped).

Packing several samples into one row is not done: the target would attend across samples unless every
attention path took document ids, and bucketing already keeps padding low.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import logging
import os
import typing as t
from pathlib import Path

import torch

from dflash import inputs
from dflash.data.batching import BatchPlan, store_lengths
from dflash.data.store import StoreError, TokenStore
from dflash.errors import DataError

logger = logging.getLogger("dflash.data")  # the name train.log has always shown


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


@dataclasses.dataclass(slots=True)
class Batch:
    """Right-padded sequences: ``[B, S]`` long tensors, ``loss_mask`` 0/1."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    index: int  # the global batch index g (the data position of this batch)
    n_tokens: int  # real tokens (what the target reads): the unit of Ktok/s


def has_anchor(loss_mask: t.Sequence[int]) -> bool:
    """True when some position p has loss_mask[p] and loss_mask[p+1] (a DFlash anchor is possible)."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))


# --------------------------------------------------------------------------------------------
# Chat rendering


class ChatRenderer:
    """messages -> (input_ids, loss_mask) with the tokenizer's chat template; assistant turns supervised.

    With a template that marks assistant text (``{% generation %}``) the tokenizer's own assistant mask is
    used; otherwise each assistant turn is located by rendering the conversation up to it (with the
    generation prompt) and up to its end, which needs a template whose renderings are prefixes of each
    other: when they are not, the sample is refused with a clear error instead of a wrong mask.
    """

    def __init__(self, tokenizer: t.Any, chat_template_kwargs: t.Mapping[str, t.Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise DataError("data.tokenizer: the tokenizer has no chat template; chat records need one")
        self._marked = "generation" in template and "endgeneration" in template

    def _ids(self, messages: list[dict[str, t.Any]], *, add_generation_prompt: bool = False) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, **self.kwargs
        )
        if isinstance(out, t.Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def render(self, messages: list[dict[str, t.Any]], *, max_len: int | None = None) -> Sample:
        """With ``max_len`` the turns are located only up to the first one that starts past it (the sample is
        cut there anyway): the cost of a long conversation stops growing with the square of its turns."""
        if self._marked:
            enc = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **self.kwargs
            )
            return Sample(list(enc["input_ids"]), [int(bool(m)) for m in enc["assistant_masks"]])
        full = self._ids(messages)
        mask = [0] * len(full)
        for i, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            start = self._ids(messages[:i], add_generation_prompt=True)
            if max_len is not None and len(start) >= max_len:
                break  # this turn and every later one begin past the cut
            end = self._ids(messages[: i + 1])
            if full[: len(start)] != start or full[: len(end)] != end:
                raise DataError(
                    f"the chat template does not render turn {i} as a prefix of the whole conversation, "
                    "so the assistant tokens cannot be located; pre-tokenize this data with a loss_mask"
                )
            for p in range(len(start), len(end)):
                mask[p] = 1
        return Sample(full, mask)


# --------------------------------------------------------------------------------------------
# The dataset


class JsonlDataset:
    """A JSONL file of samples, indexed once; ``read(i)`` parses sample ``i`` again (thread-safe)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str = "auto",
        tokenizer: t.Any = None,
        max_length: int = 3072,
        vocab_size: int | None = None,
        mask_token_id: int | None = None,
        chat_template_kwargs: t.Mapping[str, t.Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.format = format
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.mask_token_id = mask_token_id  # a real token must never be the drafter's MASK row
        self._store: t.Any = None
        if self.path.is_dir() and (self.path / "meta.json").is_file():  # a token store (dflash prepare-data)
            self._open_store(tokenizer, chat_template_kwargs)
            return
        self.renderer = ChatRenderer(tokenizer, chat_template_kwargs) if tokenizer is not None else None
        if self.path.is_dir():  # os.open would succeed and the first read fail with a traceback
            raise DataError(f"data.path: {self.path} is a directory; expected a JSONL file")
        try:  # a regular file: a FIFO would block the index forever
            self._fd = inputs.open_regular(self.path, "data.path")
        except inputs.InputFileError as e:
            raise DataError(str(e)) from None
        self._offsets = array.array("q")  # byte offset of each usable line
        self._sizes = array.array("q")  # its length in bytes
        self._lines = array.array("q")  # its 1-based line number (for messages)
        self.lengths: t.Any = array.array("q")  # its token length after cutting to max_length (a store: StoreLengths)
        self.skipped = 0
        self._index()
        if not self.lengths:
            raise DataError(
                f"data.path: no usable samples in {self.path} ({self.skipped} skipped: a sample needs two "
                "consecutive supervised tokens)"
            )
        if self.skipped:
            logger.warning(
                "data: skipped %d of %d samples in %s without two consecutive supervised tokens",
                self.skipped,
                self.skipped + len(self.lengths),
                self.path,
            )

    def _open_store(self, tokenizer: t.Any, kwargs: t.Mapping[str, t.Any] | None) -> None:
        """Map the store's arrays (O(1)); refuse one made for another tokenizer, template or vocabulary."""
        self._fd = -1
        self.renderer = None
        try:
            self._store = TokenStore(self.path)
            self._store.check_target(tokenizer, kwargs, vocab_size=self.vocab_size, mask_token_id=self.mask_token_id)
        except StoreError as e:
            raise DataError(str(e)) from None
        self.lengths = store_lengths(self._store, self.max_length)  # lazy: read from the offsets as needed
        self.skipped = len(self._store) - len(self.lengths)
        if not len(self.lengths):
            raise DataError(f"data.path: no usable samples in the token store {self.path}")

    def __len__(self) -> int:
        return len(self.lengths)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # the fd is ours; a leaked dataset must not leak it
        try:
            self.close()
        except Exception:
            pass

    def _index(self) -> None:
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                size = len(raw)
                if raw.strip():
                    sample = self._parse(raw, lineno)
                    if has_anchor(sample.loss_mask):
                        self._offsets.append(offset)
                        self._sizes.append(size)
                        self._lines.append(lineno)
                        self.lengths.append(len(sample.input_ids))
                    else:
                        self.skipped += 1
                offset += size

    def read(self, i: int) -> Sample:
        if self._store is not None:
            j = int(self.lengths.store_index(i))
            ids, mask = self._store.read(j)
            return Sample(ids[: self.max_length].tolist(), mask[: self.max_length].tolist())
        raw = os.pread(self._fd, self._sizes[i], self._offsets[i])
        return self._parse(raw, self._lines[i])

    def fingerprint(self) -> str:
        """Identifies the file's content as indexed (a resumed run warns when its data changed)."""
        if self._store is not None:  # O(1): the store's meta says what it holds
            return f"{self._store.fingerprint()[:8]}{len(self.lengths):08x}"
        h = hashlib.sha256()
        h.update(str(self.path.name).encode())
        h.update(self.lengths.tobytes())
        h.update(self._sizes.tobytes())
        return h.hexdigest()[:16]

    def _parse(self, raw: bytes, lineno: int) -> Sample:
        where = f"data.path: {self.path.name} line {lineno}"
        try:  # bounded, and text a tokenizer encodes (a lone surrogate is refused here, not as a TypeError)
            rec = inputs.loads(raw)
        except inputs.JsonProblem as e:
            raise DataError(f"{where}: {e}") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object")
        fmt = self.format
        if fmt == "auto":
            fmt = "tokens" if "input_ids" in rec else "chat" if "messages" in rec else ""
            if not fmt:
                raise DataError(f'{where}: expected "input_ids" (pre-tokenized) or "messages" (chat)')
        if fmt == "tokens":
            sample = self._tokens(rec, where)
        else:
            sample = self._chat(rec, where)
        ids, mask = sample.input_ids[: self.max_length], sample.loss_mask[: self.max_length]
        if self.vocab_size is not None or self.mask_token_id is not None:
            for j, tok in enumerate(ids):
                if self.vocab_size is not None and tok >= self.vocab_size:
                    raise DataError(
                        f"{where}: input_ids[{j}] = {tok} is outside the target vocabulary ({self.vocab_size})"
                    )
                if tok == self.mask_token_id:
                    raise DataError(
                        f"{where}: input_ids[{j}] = {tok} is the MASK id (drafter.mask_token_id); "
                        "MASK must be an unused row of the target vocabulary"
                    )
        return Sample(ids, mask)

    def _tokens(self, rec: dict[str, t.Any], where: str) -> Sample:
        ids = rec.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise DataError(f"{where}: input_ids: expected a non-empty list of token ids")
        for j, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise DataError(f"{where}: input_ids[{j}]: expected a token id, got {tok!r}")
        mask = rec.get("loss_mask")
        if mask is None:
            return Sample(ids, [1] * len(ids))
        if not isinstance(mask, list) or len(mask) != len(ids):
            got = f"{len(mask)} values" if isinstance(mask, list) else repr(mask)
            raise DataError(f"{where}: loss_mask: expected {len(ids)} values (one per input id), got {got}")
        out = []
        for j, m in enumerate(mask):
            if m not in (0, 1):  # True/False compare equal to 1/0
                raise DataError(f"{where}: loss_mask[{j}]: expected 0 or 1, got {m!r}")
            out.append(int(m))
        return Sample(ids, out)

    def _chat(self, rec: dict[str, t.Any], where: str) -> Sample:
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: messages: expected a non-empty list of {{role, content}} objects")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise DataError(f"{where}: messages[{j}]: expected an object with role and content")
        if self.renderer is None:
            raise DataError(f"{where}: a chat record needs a tokenizer (data.tokenizer, or target.path)")
        try:
            return self.renderer.render(msgs, max_len=self.max_length)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None


# --------------------------------------------------------------------------------------------
# Batches


def collate(samples: t.Sequence[Sample], *, index: int, pad_id: int = 0, pin: bool = False) -> Batch:
    """Right-pad to the longest sample; attention_mask and loss_mask are 0 on padding.

    ``pin``: in pinned host memory (a run with CUDA devices): their ``non_blocking`` copies to a GPU (the
    target's forward, the drafter's step) are then asynchronous, not a hidden sync of the copying stream."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s.input_ids)
        ids[r, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        att[r, :n] = 1
        mask[r, :n] = torch.tensor(s.loss_mask, dtype=torch.long)
    n_tokens = int(att.sum())
    if pin:
        ids, att, mask = ids.pin_memory(), att.pin_memory(), mask.pin_memory()
    return Batch(ids, att, mask, index=index, n_tokens=n_tokens)


# --------------------------------------------------------------------------------------------
# Shards and the data position


@dataclasses.dataclass(frozen=True, slots=True)
class DataPosition:
    """The next global batch index of every shard, and what the indices refer to."""

    next: tuple[int, ...]
    fingerprint: str = ""

    def to_dict(self) -> dict[str, t.Any]:
        return {"next": list(self.next), "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: t.Mapping[str, t.Any]) -> DataPosition:
        return cls(next=tuple(int(g) for g in d["next"]), fingerprint=str(d.get("fingerprint", "")))


def shard_starts(num_shards: int, saved: DataPosition | None = None) -> list[int]:
    """Where each of ``num_shards`` shards starts: shard j reads g = j (mod num_shards)."""
    if saved is None or not saved.next:
        return list(range(num_shards))
    if len(saved.next) == num_shards and all(g % num_shards == j for j, g in enumerate(saved.next)):
        return list(saved.next)
    g0 = min(saved.next)  # nothing before g0 is unseen; some batches after it are seen twice
    return [g0 + (j - g0) % num_shards for j in range(num_shards)]


class Shard:
    """The batches of one target thread: g = start, start + T, start + 2T, ... (endless)."""

    def __init__(
        self, dataset: JsonlDataset, plan: BatchPlan, *, start: int, stride: int, pad_id: int = 0, pin: bool = False
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.next = start
        self.stride = stride
        self.pad_id = pad_id
        self.pin = pin  # collate into pinned host memory (a run with CUDA devices)

    def __iter__(self) -> Shard:
        return self

    def __next__(self) -> Batch:
        g = self.next
        self.next += self.stride
        samples = [self.dataset.read(i) for i in self.plan.batch(g)]
        return collate(samples, index=g, pad_id=self.pad_id, pin=self.pin)


__all__ = [
    "Batch",
    "ChatRenderer",
    "DataError",
    "DataPosition",
    "JsonlDataset",
    "Sample",
    "Shard",
    "collate",
    "has_anchor",
    "shard_starts",
]
