"""The token store at scale: the lazy window plan (O(1) start-up in the corpus size) and parquet / datasets input.

No timings here (bench/prepare_data.py prints them): the plan is checked on a corpus of a billion sequences,
whose lengths are a real numpy array of zero bytes (a broadcast view); anything built over the corpus would
need gigabytes and fail.
"""

from __future__ import annotations

import json
import sys
import typing as t
from pathlib import Path

import numpy as np
import pytest

from dflash.data.batching import BatchPlan, Permutation
from dflash.data.samples import DataPosition, JsonlDataset, Shard, shard_starts
from dflash.data.store import PrepareSpec, StoreError, prepare

pytestmark = pytest.mark.timeout(240)


def test_permutation_is_a_bijection_for_any_size() -> None:
    for n in (1, 2, 3, 7, 100, 1000, 4099):
        p = Permutation(n, [5, 6, 7, 8])
        assert sorted(p(np.arange(n)).tolist()) == list(range(n)), n
    a, b = Permutation(1000, [1, 2, 3, 4])(np.arange(1000)), Permutation(1000, [1, 2, 3, 5])(np.arange(1000))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


@pytest.mark.parametrize("max_batch_tokens", [None, 700])  # every batch full / cut by tokens
def test_window_plan_every_sample_once_per_epoch_deterministic_and_random_access(max_batch_tokens: int | None) -> None:
    lengths = np.random.default_rng(0).integers(2, 300, size=2000)
    kw: dict[str, t.Any] = dict(batch_size=8, max_batch_tokens=max_batch_tokens, bucket_window=4, seed=3)
    plan = BatchPlan(lengths, **kw)
    epochs = [list(plan.epoch(e)) for e in range(3)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(2000)), "every sample once per epoch"
        assert all(
            1 <= len(b) <= 8 and (len(b) == 1 or len(b) * max(lengths[b]) <= plan.max_batch_tokens) for b in batches
        )
    assert epochs[0] != epochs[1] != epochs[2], "each epoch shuffled afresh"
    flat = [b for batches in epochs for b in batches]
    fresh = BatchPlan(lengths, **kw)  # a resumed run asks for a batch deep in epoch 2 first
    g = len(flat) - 3
    assert fresh.batch(g) == flat[g]
    assert [fresh.batch(i) for i in range(len(flat))] == flat, "the same global sequence, in any access order"
    assert fresh.locate(len(epochs[0]) + 1) == (1, 1)
    other = BatchPlan(lengths, **{**kw, "seed": 4})
    assert [other.batch(i) for i in range(20)] != flat[:20]
    count, exact = plan.batches_per_epoch()
    assert exact == (max_batch_tokens is None) or plan._lazy.windows <= plan._lazy.ESTIMATE_WINDOWS
    assert abs(count - len(epochs[0])) <= 0.03 * len(epochs[0]), (count, len(epochs[0]))
    if exact:
        assert count == len(epochs[0])


class Sevens:
    """The lengths of a corpus of ``n`` sequences of 7 tokens, with StoreLengths' interface, in no memory."""

    dtype = np.dtype(np.int64)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def max(self) -> int:
        return 7

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        assert np.all((idx >= 0) & (idx < self.n))
        return np.full(len(idx), 7, dtype=np.int64)


def test_plan_of_a_billion_sequences_starts_without_touching_the_corpus() -> None:
    n = 10**9  # a plan built over n (the old one: a permutation of n) would need gigabytes
    windows = n // 512  # bucket_window 64 x batch_size 8
    for mbt, per in ((None, 8), (21, 3)):  # full batches (arithmetic count) / cut by tokens (estimated count)
        plan = BatchPlan(Sevens(n), batch_size=8, max_batch_tokens=mbt, bucket_window=64, seed=1)
        first = plan.batch(0)
        assert len(first) == per and all(0 <= i < n for i in first)
        count, exact = plan.batches_per_epoch()
        assert count == windows * -(-512 // per) and exact == (mbt is None)
        assert plan.batch(1) != first and len(set(plan.batch(1)) & set(first)) == 0
        if mbt is None:  # a resume far into the run: arithmetic (cut by tokens, it walks the windows before it)
            assert plan.locate(3 * count + 2) == (3, 2)
            assert len(plan.batch(3 * count - 1)) == 8


def tokens_records(n: int) -> list[dict[str, t.Any]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        k = int(rng.integers(4, 40))
        out.append({"input_ids": rng.integers(1, 90, size=k).tolist(), "loss_mask": [0, 0] + [1] * (k - 2)})
    return out


def write_jsonl(path: Path, recs: t.Iterable[t.Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_store_shards_resume_without_losing_a_batch(tmp_path: Path) -> None:
    prepare(
        PrepareSpec(
            src=str(write_jsonl(tmp_path / "d.jsonl", tokens_records(300))),
            out=str(tmp_path / "s"),
            tokenizer_path=None,
            kwargs={},
            max_len=64,
            shard_lines=100,
        ),
        log=lambda m: None,
    )
    ds = JsonlDataset(tmp_path / "s", max_length=64)
    plan = BatchPlan(ds.lengths, batch_size=4, bucket_window=2, seed=5)
    assert len(list(plan.epoch(0))) > 40  # the runs below cross into epoch 2
    T = 3
    straight = [Shard(ds, plan, start=s, stride=T) for s in shard_starts(T)]
    expected = [[next(sh) for _ in range(40)] for sh in straight]
    seen = sorted(i for sh in expected for b in sh[: len(list(plan.epoch(0))) // T] for i in plan.batch(b.index))
    assert len(seen) == len(set(seen)), "no sample twice within the first epoch's batches"
    first = [Shard(ds, plan, start=s, stride=T) for s in shard_starts(T)]
    for sh, k in zip(first, (5, 9, 7)):  # unequally far at the checkpoint
        for _ in range(k):
            next(sh)
    saved = DataPosition(tuple(sh.next for sh in first), "fp")
    resumed_plan = BatchPlan(JsonlDataset(tmp_path / "s", max_length=64).lengths, batch_size=4, bucket_window=2, seed=5)
    resumed = [Shard(ds, resumed_plan, start=s, stride=T) for s in shard_starts(T, saved)]
    for sh, k in zip(resumed, (5, 9, 7)):
        got = next(sh)
        assert got.index == expected[resumed.index(sh)][k].index
        assert got.input_ids.tolist() == expected[resumed.index(sh)][k].input_ids.tolist()
    # another number of target threads: from the smallest saved position on, nothing skipped
    two = [Shard(ds, resumed_plan, start=s, stride=2) for s in shard_starts(2, saved)]
    assert min(sh.next for sh in two) == min(saved.next)


def test_a_store_cut_shorter_than_it_was_made_leaves_out_sequences_without_an_anchor(tmp_path: Path) -> None:
    recs = tokens_records(50) + [{"input_ids": list(range(1, 31)), "loss_mask": [0] * 25 + [1] * 5}]
    prepare(
        PrepareSpec(
            src=str(write_jsonl(tmp_path / "d.jsonl", recs)),
            out=str(tmp_path / "s"),
            tokenizer_path=None,
            kwargs={},
            max_len=64,
        ),
        log=lambda m: None,
    )
    ds = JsonlDataset(tmp_path / "s", max_length=20)
    raw = JsonlDataset(write_jsonl(tmp_path / "cut.jsonl", recs), max_length=20)
    assert len(ds) == len(raw) == 50 and ds.skipped == 1
    assert np.asarray(ds.lengths).tolist() == list(raw.lengths)
    assert [ds.read(i).input_ids for i in (0, 49)] == [raw.read(i).input_ids for i in (0, 49)]


# --------------------------------------------------------------------------------------------
# parquet and datasets folders


def chat_rows() -> list[dict[str, t.Any]]:
    rows: list[dict[str, t.Any]] = []
    for k in range(12):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"hello {k}"},
                    {"role": "assistant", "content": f"fine thanks {k} bye"},
                ]
            }
        )
    rows[4] = {"messages": [{"role": "user", "content": "no answer"}]}  # dropped: no assistant turn, row 4
    return rows


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_prepare_data import LLAMA3, make_tokenizer

    path = tmp_path_factory.mktemp("tok") / "llama3"
    make_tokenizer(LLAMA3, "<|eot_id|>", bos="<|begin_of_text|>").save_pretrained(path)
    return path


def store_arrays(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in ("tokens.bin", "loss_mask.bin", "offsets.bin", "first_anchor.bin")}


def spec(src: Path, out: Path, tok: Path, **kw: t.Any) -> PrepareSpec:
    return PrepareSpec(src=str(src), out=str(out), tokenizer_path=str(tok), kwargs={}, max_len=256, shard_lines=5, **kw)


def test_parquet_and_datasets_folder_make_the_same_store_as_jsonl(tmp_path: Path, llama3_dir: Path) -> None:
    pytest.importorskip("datasets")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = chat_rows()
    prepare(spec(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "from-jsonl", llama3_dir), log=lambda m: None)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=5)
    meta = prepare(spec(tmp_path / "d.parquet", tmp_path / "from-parquet", llama3_dir), log=lambda m: None)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    meta_ds = prepare(spec(tmp_path / "ds", tmp_path / "from-ds", llama3_dir), log=lambda m: None)
    want = store_arrays(tmp_path / "from-jsonl")
    assert store_arrays(tmp_path / "from-parquet") == want and store_arrays(tmp_path / "from-ds") == want
    for m, kind in ((meta, "parquet"), (meta_ds, "datasets")):
        assert m["source"]["kind"] == kind
        assert m["counts"]["records"] == 12 and m["counts"]["sequences"] == 11
        assert m["drops"]["no-assistant"]["rows"] == [4] and "lines" not in m["drops"]["no-assistant"]
    assert not (tmp_path / "from-parquet" / "input.jsonl").exists()
    with pytest.raises(StoreError, match=r"^prepare-data: row 4: no assistant turn \(no-assistant; --strict"):
        prepare(spec(tmp_path / "d.parquet", tmp_path / "strict", llama3_dir, strict=True), log=lambda m: None)


def test_tabular_input_errors_are_one_line(tmp_path: Path, llama3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")
    import datasets

    rows = chat_rows()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        StoreError, match=r"holds several splits \(train\): give one split's folder, e\.g\. .*dd/train$"
    ):
        prepare(spec(tmp_path / "dd", tmp_path / "o1", llama3_dir), log=lambda m: None)
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match="not a dataset saved with save_to_disk"):
        prepare(spec(tmp_path / "plain", tmp_path / "o2", llama3_dir), log=lambda m: None)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(StoreError, match=r"bad.parquet: cannot read it as parquet: "):
        prepare(spec(tmp_path / "bad.parquet", tmp_path / "o3", llama3_dir), log=lambda m: None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # the extra not installed: the import fails
    with pytest.raises(StoreError, match=r"needs the datasets extra: pip install 'dflash\[datasets\]'$"):
        prepare(spec(tmp_path / "bad.parquet", tmp_path / "o4", llama3_dir), log=lambda m: None)
