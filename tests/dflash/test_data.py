"""Training data: JSONL samples, chat rendering, bucketing, sharding, the resumable position."""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.data.batching import BatchPlan
from dflash.data.chat import load_tokenizer
from dflash.data.samples import (
    ChatRenderer,
    DataError,
    DataPosition,
    JsonlDataset,
    Shard,
    collate,
    has_anchor,
    shard_starts,
)


def write_jsonl(path: Path, records: t.Iterable[t.Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def token_records(n: int, *, seed: int = 0, lo: int = 5, hi: int = 40) -> list[dict[str, t.Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(1, 100, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0, 0] + [1] * (length - 2)})
    return out


# --------------------------------------------------------------------------------------------
# Samples


def test_pretokenized_samples_round_trip(tmp_path: Path) -> None:
    recs = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [9, 10, 11]}]
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", recs))
    assert len(ds) == 2
    assert ds.read(0).input_ids == [5, 6, 7, 8] and ds.read(0).loss_mask == [0, 1, 1, 1]
    assert ds.read(1).loss_mask == [1, 1, 1], "a missing loss_mask supervises every token"
    assert list(ds.lengths) == [4, 3]


def test_samples_without_an_anchor_are_skipped_and_counted(tmp_path: Path) -> None:
    recs = [
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1]},  # no two consecutive supervised tokens
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        "",  # blank lines are fine
    ]
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", recs))
    assert len(ds) == 1 and ds.skipped == 1
    assert ds.read(0).loss_mask == [0, 0, 1, 1]
    with pytest.raises(DataError, match=r"no usable samples .* \(1 skipped"):
        JsonlDataset(write_jsonl(tmp_path / "e.jsonl", recs[:1]))


def test_samples_are_cut_to_max_length(tmp_path: Path) -> None:
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(1, 11))}]), max_length=6)
    assert ds.read(0).input_ids == [1, 2, 3, 4, 5, 6] and list(ds.lengths) == [6]
    # cutting can remove every anchor: then the sample is skipped, not half-used
    recs = [{"input_ids": list(range(1, 11)), "loss_mask": [0] * 8 + [1, 1]}, {"input_ids": [1, 2]}]
    ds = JsonlDataset(write_jsonl(tmp_path / "e.jsonl", recs), max_length=6)
    assert len(ds) == 1 and ds.skipped == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"d.jsonl line 2: not valid JSON"),
        (
            '{"input_ids": [1, 2], "loss_mask": [1]}',
            r"line 2: loss_mask: expected 2 values \(one per input id\), got 1 values",
        ),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', r"line 2: loss_mask\[1\]: expected 0 or 1, got 2"),
        ('{"input_ids": [1, "a"]}', r"line 2: input_ids\[1\]: expected a token id, got 'a'"),
        ('{"input_ids": [1, 600]}', r"line 2: input_ids\[1\] = 600 is outside the target vocabulary \(512\)"),
        ('{"input_ids": [1, 511, 3]}', r"line 2: input_ids\[1\] = 511 is the MASK id"),
        ('{"text": "hi"}', r'line 2: expected "input_ids" \(pre-tokenized\) or "messages" \(chat\)'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"line 2: a chat record needs a tokenizer"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
)
def test_bad_lines_are_named_by_file_line_and_key(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, line])
    with pytest.raises(DataError, match=r"^data.path: " + message if message.startswith("d.") else message):
        JsonlDataset(path, vocab_size=512, mask_token_id=511)


def test_has_anchor() -> None:
    assert has_anchor([0, 1, 1]) and not has_anchor([1, 0, 1, 0]) and not has_anchor([1])


# --------------------------------------------------------------------------------------------
# Chat rendering with a tokenizer built here (no download)


WORDS = [
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "hello",
    "there",
    "how",
    "are",
    "you",
    "fine",
    "thanks",
    "and",
    "bye",
    "ok",
]


def make_tokenizer(template: str) -> t.Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = template
    return fast


PLAIN = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|> {% generation %}{{ m.content }} <|end|>"
    "{% endgeneration %} {% else %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHAT = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you"},
    {"role": "user", "content": "fine thanks"},
    {"role": "assistant", "content": "ok bye"},
]


def supervised_words(tok: t.Any, ids: list[int], mask: list[int]) -> list[str]:
    return [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]


@pytest.mark.parametrize("template", [PLAIN, MARKED], ids=["prefix-diff", "generation-marks"])
def test_chat_rendering_supervises_exactly_the_assistant_turns(template: str) -> None:
    tok = make_tokenizer(template)
    sample = ChatRenderer(tok).render(CHAT)
    assert len(sample.input_ids) == len(sample.loss_mask)
    assert supervised_words(tok, sample.input_ids, sample.loss_mask) == [
        "how",
        "are",
        "you",
        "<|end|>",
        "ok",
        "bye",
        "<|end|>",
    ]


def test_chat_records_in_a_dataset(tmp_path: Path) -> None:
    tok = make_tokenizer(PLAIN)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"input_ids": [4, 5, 6]}])
    ds = JsonlDataset(path, tokenizer=tok)
    assert len(ds) == 2
    s = ds.read(0)
    assert supervised_words(tok, s.input_ids, s.loss_mask)[:3] == ["how", "are", "you"]


def test_a_template_that_rewrites_history_is_refused() -> None:
    # renders earlier assistant turns differently once a later turn exists (like thinking-stripping templates)
    tmpl = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|assistant|> ok <|end|> "
        "{% else %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    with pytest.raises(DataError, match="not render turn 1 as a prefix"):
        ChatRenderer(make_tokenizer(tmpl)).render(CHAT)


# --------------------------------------------------------------------------------------------
# Batches


def plan_for(lengths: list[int], **kw: t.Any) -> BatchPlan:
    return BatchPlan(lengths, **{"batch_size": 4, "bucket_window": 4, "seed": 3, **kw})


def test_every_epoch_uses_every_sample_once_within_the_bounds() -> None:
    lengths = [int(x) for x in torch.randint(3, 60, (101,), generator=torch.Generator().manual_seed(1))]
    plan = plan_for(lengths, max_batch_tokens=120)
    for e in range(3):
        batches = plan.epoch(e)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(101))
        for b in batches:
            assert 1 <= len(b) <= 4
            assert len(b) * max(lengths[i] for i in b) <= 120
    assert plan.epoch(0) != plan.epoch(1), "each epoch is shuffled afresh"


def test_batches_are_deterministic_under_a_seed() -> None:
    lengths = list(range(5, 105))
    a, b, c = plan_for(lengths), plan_for(lengths), plan_for(lengths, seed=4)
    assert [a.batch(g) for g in range(60)] == [b.batch(g) for g in range(60)]
    assert [a.batch(g) for g in range(60)] != [c.batch(g) for g in range(60)]


def test_bucketing_cuts_padding() -> None:
    lengths = [int(x) for x in torch.randint(4, 400, (256,), generator=torch.Generator().manual_seed(2))]

    def padding(plan: BatchPlan) -> int:
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in plan.epoch(0))

    bucketed = padding(plan_for(lengths, bucket_window=16))
    unsorted = padding(plan_for(lengths, bucket_window=1))  # a window of one batch: no sorting across batches
    assert bucketed < unsorted / 3


def test_global_index_runs_across_epochs() -> None:
    lengths = [10] * 10
    plan = plan_for(lengths)  # 3 batches per epoch (4 + 4 + 2)
    per_epoch = len(plan.epoch(0))
    assert per_epoch == 3
    assert plan.locate(0) == (0, 0) and plan.locate(per_epoch) == (1, 0) and plan.locate(7) == (2, 1)
    assert plan.batch(per_epoch + 1) == plan.epoch(1)[1]


def test_collate_pads_right_and_masks_padding() -> None:
    from dflash.data.samples import Sample

    b = collate([Sample([1, 2, 3], [0, 1, 1]), Sample([4, 5], [1, 1])], index=7, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert b.index == 7 and b.n_tokens == 5


# --------------------------------------------------------------------------------------------
# Shards and the position


def test_shards_split_the_global_sequence_deterministically(tmp_path: Path) -> None:
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", token_records(40)))
    plan = BatchPlan(ds.lengths, batch_size=2, bucket_window=4, seed=0)
    shards = [Shard(ds, plan, start=s, stride=3) for s in shard_starts(3)]
    seen = [[next(sh).index for _ in range(5)] for sh in shards]
    assert seen == [[0, 3, 6, 9, 12], [1, 4, 7, 10, 13], [2, 5, 8, 11, 14]]
    batch = Shard(ds, plan, start=4, stride=3).__next__()
    expected = [ds.read(i).input_ids for i in plan.batch(4)]
    assert [row[: len(e)] for row, e in zip(batch.input_ids.tolist(), expected)] == expected


def test_resume_continues_with_the_same_next_batch(tmp_path: Path) -> None:
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", token_records(30)))
    plan = BatchPlan(ds.lengths, batch_size=3, bucket_window=2, seed=5)
    T = 2
    straight = [Shard(ds, plan, start=s, stride=T) for s in shard_starts(T)]
    expected = [[next(sh).input_ids.tolist() for _ in range(9)] for sh in straight]  # crosses epochs

    first = [Shard(ds, plan, start=s, stride=T) for s in shard_starts(T)]
    for sh, k in zip(first, (4, 6)):  # the shards got unequally far before the checkpoint
        for _ in range(k):
            next(sh)
    saved = DataPosition.from_dict(DataPosition(tuple(sh.next for sh in first), "fp").to_dict())
    resumed = [Shard(ds, plan, start=s, stride=T) for s in shard_starts(T, saved)]
    assert next(resumed[0]).input_ids.tolist() == expected[0][4]
    assert next(resumed[1]).input_ids.tolist() == expected[1][6]


def test_a_different_number_of_shards_restarts_from_the_smallest_position() -> None:
    saved = DataPosition((8, 13))  # 2 shards: next 8 (shard 0) and 13 (shard 1)
    starts = shard_starts(3, saved)
    assert starts == [9, 10, 8]
    assert all(s % 3 == j for j, s in enumerate(starts)) and min(starts) == 8
    assert shard_starts(2, saved) == [8, 13]
    assert shard_starts(2, None) == [0, 1]


def test_a_model_folder_without_tokenizer_files_is_no_tokenizer(tmp_path: Path) -> None:
    # transformers would hand back an empty tokenizer for it; we refuse, so pre-tokenized data
    # (format "auto") trains without one and chat data gets a clear error.
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(DataError, match=r"^data.tokenizer: no tokenizer in .*\(none of tokenizer.json"):
        load_tokenizer(str(tmp_path))
