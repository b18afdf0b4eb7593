"""A diverging run: the finite check of every update, on_nonfinite stop/skip, loss spikes, and the real CLI
with ``DFLASH_FAULT=nan-at-step:N`` (exit 3, the one line, no checkpoint from non-finite weights)."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.best import best_of, read_best
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError, load_config
from dflash.data.samples import collate
from dflash.errors import EXIT_DIVERGED
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config
from dflash.train.divergence import Diverged, LossSpike, NonfiniteGuard, nonfinite_code
from dflash.train.metrics import Metrics
from dflash.train.pipeline import StepStats
from dflash.train.replicas import FeatureBatch
from dflash.train.run import Run
from ops.diagnosis import diagnose, last_finite_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(600)

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------
# The rules, pure


@pytest.mark.parametrize(
    ("loss", "norm", "code"),
    [(1.0, 2.0, 0), (NAN, 2.0, 1), (INF, 2.0, 1), (1.0, NAN, 2), (1.0, INF, 2), (NAN, NAN, 1), (NAN, None, 1)],
)
def test_the_code_names_the_figure_that_went_bad(loss: float, norm: float | None, code: int) -> None:
    got = nonfinite_code(torch.tensor(loss, dtype=torch.float64), None if norm is None else torch.tensor(norm))
    assert got.shape == () and got.dtype == torch.float32 and int(got) == code


def test_stop_raises_the_one_line_at_the_first_bad_step() -> None:
    guard = NonfiniteGuard("stop", 10, lambda: "/r/checkpoints/step-5 (step 5)")
    with pytest.raises(Diverged) as e:
        guard.bad(7, 2.0)
    assert (
        e.value.line()
        == "dflash: diverged at step 7: grad-norm not finite; last finite checkpoint: /r/checkpoints/step-5 (step 5)"
    )
    assert e.value.exit_code == EXIT_DIVERGED == 3 and e.value.traceback is False


def test_skip_counts_resets_on_a_finite_step_and_stops_after_the_limit_in_a_row() -> None:
    guard = NonfiniteGuard("skip", 3, lambda: "none")
    assert guard.bad(4, 1.0).record() == {
        "event": "nonfinite-skip",
        "step": 4,
        "figure": "loss",
        "in_row": 1,
        "skipped": 1,
    }
    assert guard.bad(5, 2.0).in_row == 2
    guard.finite()
    assert (guard.bad(9, 1.0).in_row, guard.total) == (1, 3)
    guard.bad(10, 1.0)
    with pytest.raises(Diverged) as e:
        guard.bad(11, 1.0)
    assert e.value.line() == (
        "dflash: diverged at step 11: loss not finite (3 updates in a row skipped); last finite checkpoint: none"
    )


def test_a_spike_is_told_once_after_m_steps_above_k_times_the_running_median() -> None:
    watch = LossSpike(factor=3.0, steps=3, window=10)
    told = [s for k, x in enumerate([2.0] * 10 + [7.0, 7.0, 2.0] + [7.0] * 5, 1) if (s := watch.observe(k, x))]
    assert [(s.step, s.median, s.steps) for s in told] == [(16, 2.0, 3)], "two high steps are no spike; five are one"
    assert told[0].record()["event"] == "loss-spike"
    assert watch.observe(19, NAN) is None and watch.observe(20, 2.0) is None
    assert [s.step for k in range(21, 24) if (s := watch.observe(k, 6.5))] == [23], "a new episode is told again"
    assert all(LossSpike(factor=3.0, steps=3, window=10).observe(k, 100.0) is None for k in range(3)), "no median yet"


def test_the_config_keys_are_checked(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["train.on_nonfinite=skip", "train.nonfinite_limit=4", "train.spike_factor=0"])
    assert (cfg.train.on_nonfinite, cfg.train.nonfinite_limit, cfg.train.spike_factor) == ("skip", 4, 0)
    assert load_config(TINY).train.on_nonfinite == "stop"
    with pytest.raises(ConfigError, match=r"train.on_nonfinite: expected one of 'stop', 'skip', got \"retry\""):
        load_config(TINY, ["train.on_nonfinite=retry"])
    with pytest.raises(ConfigError, match="train.spike_factor: must be > 1"):
        load_config(TINY, ["train.spike_factor=0.5"])


def test_metrics_skip_the_bad_steps_figures_and_record_the_skip(tmp_path: Path) -> None:
    path, out = tmp_path / "metrics.jsonl", io.StringIO()
    m = Metrics(log_every=2, path=path, stream=out, guard=NonfiniteGuard("skip", 5, lambda: "none"))
    m.record(1, StepStats(loss=2.0, acc=0.5, tau_tf=1.0), 10)
    m.record(2, StepStats(loss=NAN, acc=0.0, tau_tf=1.0, nonfinite=1.0), 10)
    m.close()
    skip, step = (json.loads(x) for x in path.read_text().splitlines())
    assert skip["event"] == "nonfinite-skip" and skip["step"] == 2
    assert step["step"] == 2 and step["loss"] == 2.0, "the interval's loss is the finite steps' mean"

    stop = Metrics(
        log_every=1, path=tmp_path / "stop.jsonl", stream=out, guard=NonfiniteGuard("stop", 5, lambda: "none")
    )
    with pytest.raises(Diverged):
        stop.record(3, StepStats(loss=1.0, acc=0.0, tau_tf=1.0, nonfinite=2.0), 10)
    stop.close()
    rec = json.loads((tmp_path / "stop.jsonl").read_text())
    assert {k: rec[k] for k in ("event", "step", "figure", "last_finite")} == {
        "event": "diverged",
        "step": 3,
        "figure": "grad-norm",
        "last_finite": "none",
    }


def test_the_checkpoint_writer_refuses_non_finite_weights(tmp_path: Path) -> None:
    drafter = DFlashDraftModel(draft_config_for(tiny_target_config(), num_layers=1, block_size=4, mask_token_id=511))
    ckpt.save_checkpoint(tmp_path, step=1, drafter=drafter, trainer_state={})
    with torch.no_grad():
        next(drafter.parameters())[0] = NAN
    with pytest.raises(CheckpointError, match="step 2: .* is not finite"):
        ckpt.save_checkpoint(tmp_path, step=2, drafter=drafter, trainer_state={})
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


# --------------------------------------------------------------------------------------------
# The real update: a poisoned step leaves the weights and AdamW's step count as they were


def test_a_nan_update_is_skipped_on_the_device_and_a_finite_one_is_not(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "max_steps=4"])
    run = Run(cfg, environ={}, stream=io.StringIO())
    r = run.drafters[0]
    batch = collate([run.dataset.read(i) for i in range(2)], index=0)
    payload = FeatureBatch(batch.input_ids, batch.loss_mask, run.targets[0].produce(batch).features, 0)
    before = [p.detach().clone() for p in r.masters]
    r.poison = lambda step: step == 1
    stats = r.step(payload, step=1)
    assert int(t.cast(torch.Tensor, stats.nonfinite)) == 1 and math.isnan(float(stats.loss))
    assert all(torch.equal(a, b) for a, b in zip(before, r.masters)), "a NaN update never reaches the weights"
    assert all(float(s["step"]) == 0 for s in r.optimizer.state.values()), "nor AdamW's step count"
    stats = r.step(payload, step=2)
    assert int(t.cast(torch.Tensor, stats.nonfinite)) == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, r.masters))
    assert all(float(s["step"]) == 1 for s in r.optimizer.state.values())


# --------------------------------------------------------------------------------------------
# The real CLI: python -m dflash train with DFLASH_FAULT=nan-at-step:N


def dflash_train(tmp_path: Path, *overrides: str, fault: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dflash", "train", "--config", str(TINY)]
    for o in (f"output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "log_every=1", *overrides):
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DFLASH_FAULT": fault}
    env.pop("DFLASH_RUN_DIR", None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)


def records(tmp_path: Path) -> list[dict[str, t.Any]]:
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]


def on_disk(root: Path) -> dict[int, Path]:
    return {int(p.name.split("-")[1]): p for p in root.glob("step-*")}


def finite(path: Path) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in load_file(str(path / "model.safetensors")).values())


def test_nan_at_step_stops_with_exit_3_one_line_and_no_checkpoint_after_it(tmp_path: Path) -> None:
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join((REPO / "configs" / "tiny-data.jsonl").read_text().splitlines()[:2]) + "\n")
    res = dflash_train(
        tmp_path,
        "max_steps=14",
        "checkpoint.interval=3",
        "checkpoint.keep=10",
        "eval.every=3",
        "eval.max_new=4",
        f"eval.prompts={prompts}",
        fault="nan-at-step:8",
    )
    assert res.returncode == 3, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    m = re.fullmatch(
        r"dflash: diverged at step (\d+): loss not finite; last finite checkpoint: (.+) \(step (\d+)\)", last
    )
    assert m, last
    bad, path, good = int(m.group(1)), Path(m.group(2)), int(m.group(3))
    # step lines number updates as they complete; two drafters race, so the one poisoned as the 8th claimed
    # can complete 7th (the fault counts claims, the line counts completions)
    assert bad >= 7 and good < bad and path == tmp_path / "ckpt" / f"step-{good}"
    assert "Traceback" not in res.stderr, "a diverged run ends with its line, not a traceback"
    steps = on_disk(tmp_path / "ckpt")
    assert good in steps and max(steps) == good, f"no checkpoint after the bad update: {sorted(steps)}"
    assert all(finite(p) for p in steps.values())
    best = best_of(tmp_path / "ckpt")
    assert best is not None and int(best.name.split("-")[1]) <= good and finite(best), "best never moves to it"
    assert (read_best(tmp_path / "ckpt") or {}).get("step", 99) <= good
    diverged = [r for r in records(tmp_path) if r.get("event") == "diverged"]
    assert [(r["step"], r["figure"]) for r in diverged] == [(bad, "loss")]
    # what dflashctl makes of this real log and exit code: crashed/diverged, and restart-on-crash gives up
    diag = diagnose(res.stderr.splitlines(), exit_code=res.returncode, signal=None)
    assert (diag.cause, diag.detail) == ("diverged", last.removeprefix("dflash: "))
    assert last_finite_checkpoint(diag.detail) == f"{path} (step {good})"


def test_on_nonfinite_skip_goes_on_counts_and_ends_with_a_finite_checkpoint(tmp_path: Path) -> None:
    res = dflash_train(
        tmp_path, "max_steps=8", "checkpoint.interval=0", "train.on_nonfinite=skip", fault="nan-at-step:5"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    skips = [r for r in records(tmp_path) if r.get("event") == "nonfinite-skip"]
    assert len(skips) == 1 and skips[0]["step"] >= 5 and skips[0]["figure"] == "loss", skips
    assert f"step {skips[0]['step']}: loss not finite; update skipped (1 in a row, 1 in this attempt)" in res.stderr
    steps = on_disk(tmp_path / "ckpt")
    assert max(steps) == 8 and finite(steps[8])
    figures = [r for r in records(tmp_path) if "event" not in r and r.get("kind") != "eval"]
    assert all(math.isfinite(r["loss"]) for r in figures)


def test_after_the_first_diverged_step_later_bad_steps_are_neither_recorded_nor_raised_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    m = Metrics(log_every=1, path=path, stream=io.StringIO(), guard=NonfiniteGuard("stop", 5, lambda: "none"))
    with pytest.raises(Diverged) as first:
        m.record(7, StepStats(loss=NAN, acc=0.0, tau_tf=1.0, nonfinite=1.0), 10)
    m.record(8, StepStats(loss=NAN, acc=0.0, tau_tf=1.0, nonfinite=1.0), 10)  # another drafter's, in flight
    m.close()  # the run ends with the first: close does not raise a second, later one
    assert first.value.step == 7
    assert [json.loads(x).get("step") for x in path.read_text().splitlines()] == [7]
