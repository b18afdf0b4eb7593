"""`dflash make-tiny`: a tiny target that learned something, and training data written by that target.

A small spec (few target steps, few samples) keeps each build to a few seconds; the demo's default
spec is exercised by scripts/demo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dflash.config import load_config
from dflash.data import JsonlDataset
from dflash.target import TargetModel
from dflash.tiny import Language, TinyError, TinySpec, load_manifest, make_tiny
from dflash.train import Run

REPO = Path(__file__).resolve().parents[2]

SMALL = TinySpec(target_steps=40, train_samples=24, eval_prompts=6, response_len=20, gen_batch=8, threads=1)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, built = make_tiny(tmp_path_factory.mktemp("tiny") / "tiny", SMALL)
    assert built
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes_and_a_rerun_is_a_no_op(tmp_path: Path, tiny: Path) -> None:
    again, built = make_tiny(tmp_path / "again", SMALL)
    assert built
    mine, theirs = files(again), files(tiny)
    assert set(mine) == {"language.json", "tiny.json", "train.jsonl", "eval.jsonl", "target/config.json",
                         "target/generation_config.json", "target/model.safetensors"}
    assert mine == theirs, [name for name in mine if mine[name] != theirs.get(name)]
    before = {p: p.stat().st_mtime_ns for p in again.rglob("*")}
    _, built = make_tiny(again, SMALL)
    assert not built, "a complete output of the same spec is left alone"
    assert {p: p.stat().st_mtime_ns for p in again.rglob("*")} == before
    (again / "train.jsonl").write_text("truncated")  # a damaged output is ours: built again
    assert load_manifest(again) is None
    _, built = make_tiny(again, SMALL)
    assert built and files(again) == theirs
    other, _ = make_tiny(tmp_path / "other", dataclasses.replace(SMALL, seed=1))
    assert files(other)["train.jsonl"] != theirs["train.jsonl"]


def test_the_data_is_the_targets_own_greedy_answer(tiny: Path) -> None:
    manifest = load_manifest(tiny)
    assert manifest is not None and manifest["spec"] == SMALL.to_dict()
    target = TargetModel.from_pretrained(str(tiny / "target"), dtype=torch.float32, num_draft_layers=2)
    assert target.vocab_size == SMALL.vocab_size and target.num_layers == SMALL.num_layers
    rows = records(tiny / "train.jsonl")
    assert len(rows) == SMALL.train_samples
    for row in rows[:3] + rows[-2:]:
        ids, mask = row["input_ids"], row["loss_mask"]
        p = mask.index(1)
        assert SMALL.prompt_min <= p <= SMALL.prompt_max and mask == [0] * p + [1] * SMALL.response_len
        # the response is what the target says after the prompt, one greedy token at a time
        alone = target.generate_greedy(torch.tensor([ids[:p]]), SMALL.response_len)
        assert alone[0].tolist() == ids
    used = {tok for row in rows for tok in row["input_ids"]}
    assert max(used) < SMALL.words, "unused rows (and the MASK, the last row) never appear"


def test_the_prompts_come_from_the_language_and_eval_prompts_are_held_out(tiny: Path) -> None:
    lang = Language.generate(SMALL)
    saved = json.loads((tiny / "language.json").read_text())
    assert saved["phrases"] == [list(p) for p in lang.phrases]
    # the likeliest successors chain every phrase into one cycle (greedy text does not loop early)
    seen, i = set(), 0
    for _ in range(SMALL.phrases):
        seen.add(i)
        i = lang.successors[i][0]
    assert i == 0 and len(seen) == SMALL.phrases
    train_prompts = {tuple(r["input_ids"][: r["loss_mask"].index(1)]) for r in records(tiny / "train.jsonl")}
    held = [tuple(r["input_ids"]) for r in records(tiny / "eval.jsonl")]
    assert len(held) == SMALL.eval_prompts and not set(held) & train_prompts


def test_dflash_train_loads_the_target_by_path_and_the_data_from_jsonl(tmp_path: Path, tiny: Path) -> None:
    import io

    cfg = load_config(REPO / "configs" / "tiny-cpu.toml", [
        f"target.path={tiny / 'target'}", f"data.path={tiny / 'train.jsonl'}", f"output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "max_steps=4", "log_every=2", "checkpoint.interval=0",
    ])
    out = io.StringIO()
    run = Run(cfg, environ={}, stream=out)
    assert run.mask_token_id == SMALL.mask_token_id and run.targets[0].model.layer_ids == [1, 3]
    assert run.train() == 0
    assert out.getvalue().count("| drafters 2/2") == 2
    data = JsonlDataset(tiny / "train.jsonl", format="tokens", vocab_size=SMALL.vocab_size, mask_token_id=SMALL.mask_token_id)
    assert len(data) == SMALL.train_samples


def test_tiny_cpu_toml_finds_the_workdir_tiny_folder_from_a_release(tmp_path: Path, tiny: Path) -> None:
    """A run starts in <workdir>/releases/<id> (current -> it): ../../tiny is <workdir>/tiny."""
    workdir = tmp_path / "wd"
    release = workdir / "releases" / "0123456789abcdef"
    shutil.copytree(REPO / "configs", release / "configs")
    (workdir / "current").symlink_to("releases/0123456789abcdef")
    shutil.copytree(tiny, workdir / "tiny")
    cwd = os.getcwd()
    os.chdir(workdir / "current")
    try:
        cfg = load_config("configs/tiny-cpu.toml")
    finally:
        os.chdir(cwd)
    assert Path(cfg.target.path or "") == (workdir / "tiny" / "target").resolve()
    assert Path(cfg.data.path) == (workdir / "tiny" / "train.jsonl").resolve()
    assert cfg.devices.targets == ("cpu", "cpu") and cfg.devices.drafters == ("cpu", "cpu")
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.interval > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"vocab_size": 200}, "vocab_size: must exceed words (200) so that unused rows (and MASK) exist, got 200"),
    ({"num_layers": 3}, "num_layers: must be >= 4, got 3"),
    ({"prompt_max": 4}, "prompt_max: must be >= prompt_min (8), got 4"),
    ({"num_kv_heads": 3}, "num_kv_heads: must divide num_heads (4), got 3"),
])
def test_bad_spec_values_are_named(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(TinyError) as err:
        make_tiny(tmp_path / "x", dataclasses.replace(SMALL, **change))
    assert str(err.value) == message
    assert not (tmp_path / "x").exists()


def test_refuses_to_overwrite_a_folder_that_is_not_its_own(tmp_path: Path) -> None:
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    with pytest.raises(TinyError, match="is not a make-tiny output"):
        make_tiny(mine, SMALL)
    assert (mine / "notes.txt").read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"], "no temp dir left behind"
