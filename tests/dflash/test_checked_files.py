"""Files dflash reads that another process, an older version, a crash or a person could have written: each
read through one checked reader per kind (dflash.inputs.Record), so a missing key, a wrong type, a non-finite
or out-of-range number, a huge or deeply nested value is one line naming the file and the key (exit 2),
never a traceback nor a figure read wrong.

Real parts: a real tiny Qwen3 target folder (save_pretrained), a real tiny drafter checkpoint, the real
`python -m dflash` CLI in a child process (testkit.forkserver).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint.checkpoints import save_checkpoint
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config
from testkit import forkserver

REPO = Path(__file__).resolve().parents[2]
MASK = 511

pytestmark = pytest.mark.timeout(600)


def dflash(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI, in a child process: what a user runs (forked from a server that imported dflash once:
    these tests run it some fifty times)."""
    return forkserver.shared().run(args, cwd=cwd or REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The exit-2 answer: one line on stderr, no traceback."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def run_ckpt(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    """A checkpoint whose trainer state names the run's target, as training writes it."""
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=MASK)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    return save_checkpoint(
        root, step=5, drafter=DFlashDraftModel(cfg), trainer_state={"config": {"target": {"path": str(target_dir)}}}
    )


def verifier_folder(root: Path, config: str | bytes | None) -> Path:
    folder = root / "verifier"
    folder.mkdir()
    if config is not None:
        path = folder / "config.json"
        path.write_bytes(config if isinstance(config, bytes) else config.encode())
    return folder


def good_config(target_dir: Path, **change: t.Any) -> str:
    data = json.loads((target_dir / "config.json").read_text())
    return json.dumps({**data, **change})


LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "architectures": ["LlamaForCausalLM"]}

# what the verifier's config.json holds -> the words the one line must carry (None: no config.json at all)
VERIFIER_CASES: dict[str, tuple[t.Callable[[Path], str | bytes | None], str]] = {
    "another model": (
        lambda td: good_config(td, **LLAMA_8B),
        "vocab_size is 128256, but the drafter's vocab_size is 512",
    ),
    "another width": (lambda td: good_config(td, hidden_size=4096), "hidden_size is 4096, but the drafter's"),
    "fewer layers": (lambda td: good_config(td, num_hidden_layers=4), "num_hidden_layers is 4, but the drafter's"),
    "missing": (lambda td: None, "cannot read"),
    "unreadable": (lambda td: b"\xff\xfe{not json", "is not JSON"),
    "a string": (lambda td: json.dumps("Qwen3ForCausalLM"), 'expected a JSON object, got "Qwen3ForCausalLM"'),
    "deeply nested": (lambda td: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "no architectures": (lambda td: good_config(td, architectures=None), "architectures missing"),
    "empty architectures": (lambda td: good_config(td, architectures=[]), "architectures is [], expected a non-empty"),
    "mixed architectures": (
        lambda td: good_config(td, architectures=[5, None, {"a": 1}]),
        'architectures is [5, null, {"a": 1}], expected a non-empty list of strings',
    ),
    "vocab a string": (lambda td: good_config(td, vocab_size="512"), 'vocab_size is "512", expected an integer'),
    "vocab 1e30": (lambda td: good_config(td, vocab_size=10**30), "vocab_size is 1000000000000000000000000000000"),
}


@pytest.mark.parametrize("case", list(VERIFIER_CASES))
def test_export_speculators_reads_the_verifier_like_the_target(
    case: str, tmp_path: Path, target_dir: Path, run_ckpt: Path
) -> None:
    """`export --format speculators --verifier DIR` exported a Llama-sized verifier for a 64-wide, 512-vocab
    drafter with exit 0, took the run's target's architectures for an unreadable, missing, string-valued or
    deeply nested DIR/config.json, and wrote `architectures: []` or `[5, null, {...}]` as given."""
    make, words = VERIFIER_CASES[case]
    verifier = verifier_folder(tmp_path, make(target_dir))
    out = tmp_path / "out"
    line = one_line(dflash("export", str(run_ckpt), str(out), "--format", "speculators", "--verifier", str(verifier)))
    assert line.startswith(f"dflash: --verifier {verifier}: "), line
    assert words in line, line
    assert not out.exists()


def test_export_speculators_names_the_verifier_it_read(tmp_path: Path, target_dir: Path, run_ckpt: Path) -> None:
    verifier = verifier_folder(tmp_path, good_config(target_dir, architectures=["Qwen3ForCausalLM", "Other"]))
    out = tmp_path / "out"
    proc = dflash("export", str(run_ckpt), str(out), "--format", "speculators", "--verifier", str(verifier))
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / "config.json").read_text())["speculators_config"]
    assert spec["verifier"] == {"architectures": ["Qwen3ForCausalLM", "Other"], "name_or_path": str(verifier)}


# --------------------------------------------------------------------------------------------
# best.json: a tau of NaN is no best (a warning), not a best no eval can beat


def train(tmp_path: Path, max_steps: int) -> subprocess.CompletedProcess[str]:
    prompts = tmp_path / "eval.jsonl"
    lines = (REPO / "configs" / "tiny-data.jsonl").read_text().splitlines()[:2]
    prompts.write_text("\n".join(lines) + "\n")
    args = ["train", "--config", str(REPO / "configs" / "tiny-random.toml")]
    for o in (
        f"output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"eval.prompts={prompts}",
        "log_every=2",
        "checkpoint.interval=0",
        "checkpoint.keep=1",
        "eval.max_new=4",
        "eval.every=2",
        f"max_steps={max_steps}",
    ):
        args += ["--set", o]
    return dflash(*args)


def test_a_best_json_whose_tau_is_nan_is_no_best(tmp_path: Path) -> None:
    """best.json with tau NaN (Python's json reads it; JSON has no NaN) was taken as the best so far, and
    every comparison with NaN is false: no later eval could become the best."""
    first = train(tmp_path, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    best = tmp_path / "ckpt" / "best.json"
    record = json.loads(best.read_text())
    best.write_text(json.dumps({**record, "tau": float("nan")}))  # json.dumps writes NaN
    resumed = train(tmp_path, 4)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = [x for x in resumed.stderr.splitlines() if "best.json" in x]
    assert said and "NaN" in said[0] and said[0].endswith("taken as no best (the next eval sets one)"), said
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in evals if r.get("kind") == "eval" and r["step"] > record["step"]]
    assert evals and evals[0]["is_best"], evals
    after = json.loads(best.read_text())
    assert after["step"] == evals[0]["step"] and after["tau"] == evals[0]["tau"]


# --------------------------------------------------------------------------------------------
# checkpoint.json: read field by field wherever a checkpoint is found, loaded or exported

DEEP = "[" * 100_000 + "]" * 100_000

MANIFEST_CASES: dict[str, tuple[t.Callable[[dict[str, t.Any]], str], str]] = {
    "deeply nested": (lambda m: DEEP, "nested too deeply"),
    "not JSON": (lambda m: "{half", "is not JSON"),
    "a list": (lambda m: "[1, 2]", "expected a JSON object"),
    "a size a string": (
        lambda m: json.dumps({**m, "files": {**m["files"], "config.json": "12"}}),
        'files.config.json is "12", expected an integer >= 0',
    ),
    "a sum outside the checkpoint": (
        lambda m: json.dumps({**m, "sha256": {**m["sha256"], "../../outside": "0" * 64}}),
        "sha256.../../outside",
    ),
    "a step a string": (lambda m: json.dumps({**m, "step": "5"}), 'step is "5", expected an integer'),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_a_checkpoint_json_written_by_someone_else_is_one_line(
    case: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, target_dir: Path
) -> None:
    """checkpoint.json was read with json.loads: 100,000 levels deep was a RecursionError traceback from
    every reader (export, eval, resume), and one that was no JSON object made export skip the sha256 check
    and export the checkpoint unverified."""
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=MASK)
    torch.manual_seed(0)
    ck = save_checkpoint(tmp_path / "checkpoints", step=5, drafter=DFlashDraftModel(cfg), trainer_state={})
    manifest = json.loads((ck / "checkpoint.json").read_text())
    make, words = MANIFEST_CASES[case]
    (ck / "checkpoint.json").write_text(make(manifest))
    line = one_line(dflash("export", str(ck), str(tmp_path / "out")))
    assert line.startswith(f"dflash: {ck}: checkpoint.json unreadable: ") and words in line, line
    assert not (tmp_path / "out").exists()
    # under its root: skipped with a warning naming it, and nothing else is there
    proc = dflash("export", str(tmp_path / "checkpoints"), str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"skipping checkpoint {ck}: checkpoint.json unreadable: " in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"dflash: {tmp_path / 'checkpoints'}: no drafter here"), proc.stderr


# --------------------------------------------------------------------------------------------
# a token store's meta.json and offsets.bin, as `dflash train` opens them


def store(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    proc = dflash(
        "prepare-data",
        "--config",
        str(REPO / "configs" / "tiny-random.toml"),
        "--in",
        str(REPO / "configs" / "tiny-data.jsonl"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    return out


def train_on(tmp_path: Path, data: Path) -> subprocess.CompletedProcess[str]:
    args = ["train", "--config", str(REPO / "configs" / "tiny-random.toml"), "--set", f"data.path={data}"]
    for o in (f"output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "max_steps=2"):
        args += ["--set", o]
    return dflash(*args)


def _counts(m: dict[str, t.Any], **change: t.Any) -> str:
    return json.dumps({**m, "counts": {**m["counts"], **change}})


STORE_CASES: dict[str, tuple[t.Callable[[dict[str, t.Any]], str], str]] = {
    "sequences a string": (lambda m: _counts(m, sequences="200"), 'counts.sequences is "200", expected an integer'),
    "sequences missing": (lambda m: json.dumps({k: v for k, v in m.items() if k != "counts"}), "counts missing"),
    "sequences huge": (lambda m: _counts(m, sequences=10**30), "counts.sequences is 1000000000000000000000000000000"),
    "max_token_id a float": (lambda m: _counts(m, max_token_id=499.5), "counts.max_token_id is 499.5"),
    "tokenizer a list": (lambda m: json.dumps({**m, "tokenizer": [1]}), "tokenizer is [1], expected a JSON object"),
    "max_length a string": (lambda m: json.dumps({**m, "max_length": "90"}), 'max_length is "90", expected'),
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_a_store_meta_json_written_by_someone_else_is_one_line(case: str, tmp_path: Path) -> None:
    """meta.json's counts were taken with int(meta["counts"]["sequences"]): a missing key was a KeyError
    traceback, "200" was taken as 200, a string max_length a ValueError mid-start."""
    s = store(tmp_path)
    meta = json.loads((s / "meta.json").read_text())
    make, words = STORE_CASES[case]
    (s / "meta.json").write_text(make(meta))
    line = one_line(train_on(tmp_path, s))
    assert line.startswith(f"dflash: data.path: {s / 'meta.json'}: ") and words in line, line


def test_offsets_that_do_not_rise_are_a_damaged_store(tmp_path: Path) -> None:
    """offsets.bin of the right size whose offsets go down read samples of other sequences' tokens (or
    none) without a word."""
    import numpy as np

    s = store(tmp_path)
    offsets = np.fromfile(s / "offsets.bin", dtype=np.int64)
    offsets[3], offsets[4] = offsets[4], offsets[3]
    offsets.tofile(s / "offsets.bin")
    line = one_line(train_on(tmp_path, s))
    assert line == (
        f"dflash: data.path: {s / 'offsets.bin'}: offsets do not start at 0 and rise (a damaged store; run dflash "
        "prepare-data again)"
    )


# --------------------------------------------------------------------------------------------
# prepare-data's resumable work: plan.json and each finished part's part.json


def prepare(out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = ["prepare-data", "--config", str(REPO / "configs" / "tiny-random.toml")]
    args += ["--in", str(REPO / "configs" / "tiny-data.jsonl"), "--out", str(out), "--shard-lines", "50"]
    return subprocess.run(
        [sys.executable, "-m", "dflash", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("damage", ["plan.json", "part.json"])
def test_a_damaged_plan_or_part_is_made_again(damage: str, tmp_path: Path) -> None:
    """A resumed prepare-data read WORK/plan.json and each part's part.json with json.loads and took their
    keys as written: a deep plan.json was a RecursionError traceback, a part.json whose counts were no
    object an AttributeError after every shard had run."""
    killed = prepare(tmp_path / "a", env={"DFLASH_PREPARE_DIE_AFTER_SHARDS": "2"})
    assert killed.returncode == -9, killed.stderr
    work = tmp_path / "a.partial"
    done = sorted(p for p in (work / "parts").iterdir() if not p.name.endswith(".tmp"))
    assert done, list((work / "parts").iterdir())
    if damage == "plan.json":
        (work / "plan.json").write_text(DEEP)
    else:
        info = json.loads((done[0] / "part.json").read_text())
        (done[0] / "part.json").write_text(json.dumps({**info, "counts": "many"}))
    again = prepare(tmp_path / "a")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    if damage == "plan.json":
        assert "plan.json: " in again.stderr and "nested too deeply" in again.stderr and "starting over" in again.stderr
    else:
        said = f'{done[0] / "part.json"}: counts is "many", expected a JSON object: making that shard again'
        assert said in again.stderr, again.stderr
    whole = prepare(tmp_path / "b")
    assert whole.returncode == 0, whole.stderr
    for name in ("tokens.bin", "loss_mask.bin", "offsets.bin", "first_anchor.bin", "token_counts.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a, b = (json.loads((tmp_path / x / "meta.json").read_text()) for x in "ab")
    assert a["counts"] == b["counts"]


# --------------------------------------------------------------------------------------------
# the run's target config.json, where dflash reads it without loading the model


def test_prepare_data_reads_the_target_vocabulary_checked(tmp_path: Path, target_dir: Path) -> None:
    """Pre-tokenized data is checked against the target's vocabulary from its config.json; a vocab_size of
    "512" (or none, or a folder of another kind) left the ids unchecked without a word."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    text = (REPO / "configs" / "tiny-random.toml").read_text()
    head, tiny = text.split("[target.tiny]")
    rest = tiny[tiny.index("\n[") :]
    config = tmp_path / "run.toml"
    config.write_text(head.replace("[target]\n", f'[target]\npath = "{target}"\n') + rest)
    good = dflash(
        "prepare-data",
        "--config",
        str(config),
        "--in",
        str(REPO / "configs" / "tiny-data.jsonl"),
        "--out",
        str(tmp_path / "s"),
    )
    assert good.returncode == 0, good.stderr
    data = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**data, "vocab_size": "512"}))
    line = one_line(
        dflash(
            "prepare-data",
            "--config",
            str(config),
            "--in",
            str(REPO / "configs" / "tiny-data.jsonl"),
            "--out",
            str(tmp_path / "t"),
        )
    )
    assert (
        line
        == f'prepare-data: target.path: {target / "config.json"}: vocab_size is "512", expected an integer in 1..16777216'
    )
    assert not (tmp_path / "t").exists()


# --------------------------------------------------------------------------------------------
# a drafter's config.json: a checkpoint's, an export's, drafter.init_from's

DRAFTER_CASES = {
    "dflash_config a list": ({"dflash_config": [1]}, "dflash_config is [1], expected a JSON object"),
    "rope_theta negative": ({"rope_theta": -1.0}, "rope_theta is -1.0, expected a number > 0"),
    "rms_norm_eps zero": ({"rms_norm_eps": 0.0}, "rms_norm_eps is 0.0, expected a number > 0"),
    "vocab_size 1e30": ({"vocab_size": 10**30}, "vocab_size is 1000000000000000000000000000000, expected an integer"),
}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter folder as export writes it (config.json + model.safetensors, no manifest)."""
    root = tmp_path_factory.mktemp("published")
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=8, mask_token_id=MASK)
    torch.manual_seed(0)
    ck = save_checkpoint(root / "checkpoints", step=1, drafter=DFlashDraftModel(cfg), trainer_state={})
    proc = dflash("export", str(ck), str(root / "drafter"), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    return root / "drafter"


@pytest.mark.parametrize("case", list(DRAFTER_CASES))
def test_a_drafter_config_json_out_of_range_is_one_line(case: str, tmp_path: Path, published: Path) -> None:
    """A drafter config.json whose dflash_config was a list was an AttributeError traceback; a negative
    rope_theta or norm epsilon, or a vocabulary of 10**30, was exported (and warm-started) as given."""
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(published, folder)
    change, words = DRAFTER_CASES[case]
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **change}))
    line = one_line(dflash("export", str(folder), str(tmp_path / "out")))
    assert line == f"dflash: {folder / 'config.json'}: {words}" or (words in line and "Traceback" not in line), line
    assert not (tmp_path / "out").exists()
    if case == "rope_theta negative":  # the same file as drafter.init_from: refused before training starts
        args = ["train", "--config", str(REPO / "configs" / "tiny-random.toml"), "--set", f"drafter.init_from={folder}"]
        for o in (f"output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "max_steps=2"):
            args += ["--set", o]
        line = one_line(dflash(*args))
        assert "drafter.init_from" in line and words in line, line
        assert not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------------------------
# make-tiny's tiny.json: whether an output is complete and ours


def test_a_tiny_json_not_ours_is_no_manifest(tmp_path: Path) -> None:
    """load_manifest read tiny.json with json.loads (100,000 levels: a RecursionError out of make-tiny) and
    hashed whatever its files named, a file outside the output included."""
    import hashlib

    from dflash.data.tiny import FORMAT, MANIFEST, load_manifest

    out = tmp_path / "tiny"
    out.mkdir()
    (out / MANIFEST).write_text(DEEP)
    assert load_manifest(out) is None
    outside = tmp_path / "outside.txt"
    outside.write_text("not make-tiny's")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {"../outside.txt": digest}}))
    assert load_manifest(out) is None
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": ["train.jsonl"]}))
    assert load_manifest(out) is None


@pytest.mark.parametrize("target", [["Qwen3"], {"tiny": {"vocab_size": 512, "hidden_size": 64, "num_layers": "8"}}])
def test_a_saved_target_of_another_shape_is_no_target(target: t.Any, tmp_path: Path) -> None:
    """The run config a trainer state saved names the target; one of another shape (a list; a layer count
    "8") was an AttributeError / TypeError traceback out of export."""
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=MASK)
    torch.manual_seed(0)
    ck = save_checkpoint(
        tmp_path / "c", step=1, drafter=DFlashDraftModel(cfg), trainer_state={"config": {"target": target}}
    )
    proc = dflash("export", str(ck), str(tmp_path / "out"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    line = one_line(dflash("export", str(ck), str(tmp_path / "spec"), "--format", "speculators"))
    assert line.startswith("dflash: --format speculators: name the target it serves with"), line
