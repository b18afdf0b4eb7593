"""Held-out tau during training, checkpoints/best, W&B (offline), the tau panel.

Real parts: the tiny random target and drafter of tests/dflash/test_train.py (2 targets + 2 drafters on CPU),
an eval prompt file in the layout `dflash eval --prompts` reads (the first records of the training data),
a real `python -m dflash train` killed with SIGKILL and resumed, wandb itself in offline mode (its run files
read back), `dflashctl plot`'s own functions drawing the run's metrics.jsonl.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import typing as t
from pathlib import Path

import numpy as np
import pytest

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.best import best_of, read_best, set_best
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError, RunConfig
from dflash.eval.evaluate import resolve_checkpoint
from dflash.serve.export import export
from dflash.train.run import Run
from testkit import retry_until
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(600)

# Small on purpose: an eval decodes every prompt with target + drafter (CI has 2 cores).
EVAL = ["eval.max_new=4", "eval.every=4"]


def prompts_file(root: Path) -> Path:
    path = root / "eval.jsonl"
    lines = (REPO / "configs" / "tiny-data.jsonl").read_text().splitlines()[:2]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny(root: Path, *overrides: str) -> RunConfig:
    return tiny_config(
        root, f"eval.prompts={prompts_file(root)}", "log_every=2", "checkpoint.keep=1", *EVAL, *overrides
    )


def metrics(root: Path) -> list[dict[str, t.Any]]:
    path = root / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def evals(root: Path) -> list[dict[str, t.Any]]:
    return [r for r in metrics(root) if r.get("kind") == "eval"]


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (root / "ckpt").glob("step-*"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One in-process run of 8 steps with [eval] every 4 and W&B offline; returns its root and stdout."""
    root = tmp_path_factory.mktemp("besteval")
    out = io.StringIO()
    cfg = tiny(root, "max_steps=8", "metrics.wandb.project=dflash-test", "metrics.wandb.mode=offline")
    old = {k: os.environ.get(k) for k in ("WANDB_SILENT", "WANDB_DISABLE_GIT")}
    os.environ.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    try:
        assert Run(cfg, environ={}, stream=out).train() == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return root, out.getvalue()


# --------------------------------------------------------------------------------------------
# [eval] every: tau in metrics.jsonl and the step line, checkpoints/best, pruning


def test_eval_every_writes_held_out_tau_and_points_best_at_the_best_checkpoint(trained: tuple[Path, str]) -> None:
    root, out = trained
    got = evals(root)
    # every 4 steps (the barrier of the step that passes a multiple), and the final checkpoint
    assert len(got) >= 2 and got[-1]["step"] == 8, got
    assert [r["step"] for r in got] == sorted({r["step"] for r in got})
    for r in got:
        assert r["prompts"] == 2 and r["tau"] >= 1.0, r  # every verify step yields at least the target's token
        assert r["new_tokens"] == 2 * 4 and r["verify_steps"] >= 1
    best = max(got, key=lambda r: (r["tau"], -r["step"]))  # the first of the highest: ties do not switch
    assert [r["step"] for r in got if r["is_best"]][-1] == best["step"]
    assert got[-1]["best_step"] == best["step"] and got[-1]["best_tau"] == best["tau"]
    link = root / "ckpt" / "best"
    assert link.is_symlink() and os.readlink(link) == f"step-{best['step']}", "relative: the folder can move"
    record = json.loads((root / "ckpt" / "best.json").read_text())
    assert record["step"] == best["step"] and record["tau"] == pytest.approx(best["tau"])
    assert record["protocol"]["max_new_tokens"] == 4 and record["protocol"]["num_prompts"] == 2
    # keep = 1: the latest and the best survive pruning, nothing else
    assert steps_on_disk(root) == sorted({8, best["step"]})
    # the eval's own line, and its tau at the end of the step lines after it
    lines = out.splitlines()
    first = lines.index(next(x for x in lines if x.startswith(f"eval step {got[0]['step']} | tau {got[0]['tau']:.3f}")))
    assert lines[first].endswith(
        f"best {got[0]['tau']:.3f} @{got[0]['step']} (new best) | 2 prompts, 8 new tokens in {got[0]['seconds']:.1f} s"
    ), lines[first]
    before = [x for x in lines[:first] if x.startswith("step ")]
    after = [x for x in lines[first:] if x.startswith("step ")]
    assert before and all("| tau " not in x for x in before), "no held-out tau before the first eval ended"
    assert all(" | tau " in x and x.split(" | busy ")[0].count("|") == 6 for x in after), after
    assert all(x.endswith(f"| best {got[0]['best_tau']:.2f} @{got[0]['step']}") for x in after[:1]), after


def test_export_and_eval_take_best_and_say_so(trained: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = trained
    best = best_of(root / "ckpt")
    assert best is not None
    said: list[str] = []
    assert resolve_checkpoint(root / "ckpt", log=said.append) == best
    assert len(said) == 1 and f"best -> {best.name}: the best checkpoint (held-out tau" in said[0], said
    if best.name != "step-8":
        assert "the latest is step-8" in said[0]
    said.clear()
    export(root / "ckpt", tmp_path / "out", dtype="fp32", log=said.append)
    assert len(said) == 1 and f"-> {best.name}: the best checkpoint" in said[0], said
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # a checkpoint dir given as such is taken as it is, silently
    said.clear()
    assert resolve_checkpoint(root / "ckpt" / "step-8", log=said.append) == root / "ckpt" / "step-8"
    assert said == []


# --------------------------------------------------------------------------------------------
# W&B offline: the same scalars as TensorBoard


def wandb_records(path: Path) -> t.Iterator[t.Any]:
    """The protobuf records of a W&B run file (``run-<id>.wandb``: a ':W&B' header, then LevelDB-log blocks of
    32 KiB, each record a 7-byte header (crc, length, type) and its bytes; FIRST/MIDDLE/LAST make one)."""
    from wandb.proto import wandb_internal_pb2 as pb  # the [wandb] extra (in [test])

    data = path.read_bytes()
    assert data[:4] == b":W&B", "a W&B run file"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec
        elif kind == 0 and n == 0:
            continue


def test_wandb_offline_run_holds_the_tensorboard_scalars_grouped_by_run_id(trained: tuple[Path, str]) -> None:
    root, _ = trained
    files = list((root / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, "one W&B run for the attempt"
    runs, history = [], []
    for rec in wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            runs.append(rec.run)
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    run_id = ckpt.load_checkpoint(root / "ckpt" / "step-8").run_id
    assert runs and runs[0].run_group == run_id and runs[0].project == "dflash-test"
    steps = [r for r in metrics(root) if r.get("kind") is None]
    logged = {h["global_step"]: h for h in history if "train/loss" in h}
    assert sorted(logged) == [r["step"] for r in steps]
    for r in steps:
        h = logged[r["step"]]
        assert h["train/loss"] == pytest.approx(r["loss"]) and h["train/ktok_s"] == pytest.approx(r["ktok_s"])
        assert {k for k in h if k.startswith("busy/")} == {f"busy/{w['name']}" for w in r["workers"]}
    taus = {h["global_step"]: h["eval/tau"] for h in history if "eval/tau" in h}
    assert taus == {r["step"]: pytest.approx(r["tau"]) for r in evals(root)}


def test_wandb_missing_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    with pytest.raises(ConfigError) as e:
        Run(tiny(tmp_path, "max_steps=2", "metrics.wandb.project=p"), environ={})
    assert str(e.value) == "metrics.wandb: needs the wandb package: pip install 'dflash[wandb]'"


# --------------------------------------------------------------------------------------------
# kill -9, then resume: the resumed run knows the best so far


def test_a_killed_run_resumes_knowing_its_best_and_keeps_it_through_pruning(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dflash", "train", "--config", str(TINY)]
    for o in (
        f"output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"eval.prompts={prompts_file(tmp_path)}",
        "log_every=1",
        "checkpoint.interval=0",
        "checkpoint.keep=1",
        "eval.max_new=4",
        "eval.every=3",
        "max_steps=100000",
    ):
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("DFLASH_RUN_DIR", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        retry_until(lambda: len(evals(tmp_path)) >= 2 or proc.poll() is not None, 400, interval=0.2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    root = tmp_path / "ckpt"
    best = read_best(root)
    seen_before = evals(tmp_path)
    top = max(seen_before, key=lambda r: (r["tau"], -r["step"]))  # the first of the highest: ties do not switch
    assert best is not None and (best["step"] == top["step"] or best["step"] > seen_before[-1]["step"]), best
    # As if that eval had measured a tau no later eval can reach: the resumed run must compare with it.
    (root / "best.json").write_text(json.dumps({**best, "tau": 99.0}))
    latest = ckpt.latest_complete(root)
    assert latest is not None
    start = ckpt.load_checkpoint(latest).step
    out = io.StringIO()
    run = Run(tiny(tmp_path, f"max_steps={start + 6}", "eval.every=3"), environ={}, stream=out)
    assert run.start_step == start
    assert run.validator is not None and (run.validator.best_step, run.validator.best_tau) == (best["step"], 99.0)
    seen = len(evals(tmp_path))
    assert run.train() == 0
    after = evals(tmp_path)[seen:]
    assert after and not any(r["is_best"] for r in after) and after[-1]["step"] == start + 6
    assert all(r["best_step"] == best["step"] and r["best_tau"] == 99.0 for r in after)
    assert os.readlink(root / "best") == f"step-{best['step']}"
    assert steps_on_disk(tmp_path) == sorted({best["step"], start + 6}), "pruned, except the best"


# --------------------------------------------------------------------------------------------
# The best checkpoint's file operations


def test_set_best_switches_by_rename_and_choose_falls_back_to_the_latest(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    import shutil

    src, _ = trained
    root = tmp_path / "ckpt"
    root.mkdir()
    for p in (src / "ckpt").glob("step-*"):
        shutil.copytree(p, root / p.name)
    steps = steps_on_disk(tmp_path)
    with pytest.raises(CheckpointError, match=r"step-12345: not a complete checkpoint"):
        set_best(root, {"step": 12345, "tau": 2.0})
    assert not (root / "best").exists() and not (root / "best.json").exists()
    for s in steps:
        set_best(root, {"step": s, "tau": 1.5})
        assert os.readlink(root / "best") == f"step-{s}" and read_best(root)["step"] == s
    assert sorted(p.name for p in root.iterdir()) == sorted(["best", "best.json", *(f"step-{s}" for s in steps)])
    # a best whose checkpoint went missing: the latest, with a warning, not an error
    set_best(root, {"step": steps[0], "tau": 1.5})
    shutil.rmtree(root / f"step-{steps[0]}")
    chosen, note = ckpt.choose(root)
    assert chosen == root / f"step-{steps[-1]}" and note is None  # the latest, as without best (a warning logs it)
    # checkpoint.resume = "never": best and best.json go aside with the run
    aside = ckpt.move_aside(root)
    assert not (root / "best").is_symlink() and not (root / "best.json").exists()
    assert any((a / "best.json").exists() for a in aside)


# --------------------------------------------------------------------------------------------
# dflashctl plot: the held-out tau in the tau panel


def test_plot_draws_the_held_out_tau_beside_tau_tf(trained: tuple[Path, str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from ops import plot

    root, _ = trained
    cache = plot.Cache(tmp_path / "state", "l", "s")
    raw = cache.metrics("1")
    raw.parent.mkdir(parents=True)
    raw.write_bytes((root / "run" / "metrics.jsonl").read_bytes())
    attempts = plot.load_attempts(cache, {"attempts": {"1": {}}, "current": 1})
    cols = attempts[0].columns
    assert cols.skipped == 0, cols.first_skip  # an eval record is read, not skipped as a wrong-typed line
    drawn = plot.lines(attempts)
    got = [(s, v) for ln in drawn if ln.series == "eval_tau" for s, v in zip(ln.steps, ln.values)]
    assert got == [(r["step"], pytest.approx(r["tau"])) for r in evals(root)]
    step_recs = [r for r in metrics(root) if r.get("kind") is None]
    assert sum(len(ln.steps) for ln in drawn if ln.series == "loss") == len(step_recs), (
        "eval records are no loss points"
    )
    assert not any(map(np.isnan, cols.time)), "an eval record leaves the records' times fine-grained"
    fig = plot.figure(attempts, drawn, [], title="t")
    (tau_axes,) = [ax for ax in fig.axes if ax.get_title().startswith("tau")]
    labels = {ln.get_label() for ln in tau_axes.get_lines()}
    assert {"tau_tf", "eval_tau", "eval_best_tau"} <= labels, labels
    out = tmp_path / "dash.png"
    plot.draw(str(out), attempts, drawn, [], title="t")
    assert out.stat().st_size > 10_000
