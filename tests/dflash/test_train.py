"""Training runs with the real tiny target and drafter: 2 target threads and 2 drafter threads on CPU.

In-process runs check what the threads did; real ``python -m dflash train`` subprocesses check the
signals, kill -9 mid-checkpoint, the exit codes and resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.config import ConfigError, RunConfig
from dflash.data.samples import collate
from dflash.model.loss import drafter_loss
from dflash.train.pipeline import PipelineError
from dflash.train.replicas import LRSchedule
from dflash.train.run import Run
from ops.far.history import resumed_from
from testkit import retry_until
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(240)


def tiny(tmp_path: Path, *overrides: str) -> RunConfig:
    return tiny_config(tmp_path, "log_every=5", "max_steps=10", *overrides)


def fixed_loss(run: Run, replica: int = 0) -> float:
    """The drafter's loss on a fixed batch with fixed anchors (comparable before and after training)."""
    r = run.drafters[replica]
    batch = collate([run.dataset.read(i) for i in range(8)], index=0)
    feats = t.cast(torch.Tensor, run.targets[0].model.features(batch.input_ids, batch.attention_mask))
    with torch.no_grad():
        out = drafter_loss(
            r.model,
            r.head,
            batch.input_ids,
            batch.loss_mask,
            feats,
            num_anchors=16,
            gamma=4.0,
            generator=torch.Generator().manual_seed(0),
            chunk_size=64,
        )
    return float(out.loss)


def params(run: Run, replica: int) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.drafters[replica].model.parameters()]


# --------------------------------------------------------------------------------------------
# In process


def test_two_by_two_trains_loss_falls_and_replicas_end_averaged(tmp_path: Path) -> None:
    import io

    out = io.StringIO()
    run = Run(tiny(tmp_path, "max_steps=40", "optim.lr=1e-2", "average_every=10"), environ={}, stream=out)
    assert len(run.targets) == 2 and len(run.drafters) == 2
    assert run.targets[0].model is not run.targets[1].model, "each target thread owns its replica"
    head_before = run.drafters[0].head.lm_head.weight.clone()
    before = fixed_loss(run)
    assert run.train() == 0
    after = fixed_loss(run)
    assert after < before - 0.05, (before, after)
    # the final sync averaged the two replicas: they hold the same weights
    for a, b in zip(params(run, 0), params(run, 1)):
        assert torch.equal(a, b)
    assert torch.equal(run.drafters[0].head.lm_head.weight, head_before), "the frozen target head never changes"
    assert all(not p.requires_grad for p in run.drafters[0].head.parameters())
    # both drafters trained, every batch once
    trained = run.drafters[0].trained + run.drafters[1].trained
    assert run.drafters[0].trained and run.drafters[1].trained
    assert len(trained) == len(set(trained)) == 40
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == [f"step {n}" for n in range(5, 41, 5)]
    assert re.search(r"\| drafters 2/2 \| busy T \d+ \d+ \| D \d+ \d+$", lines[-1]), lines[-1]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(5, 41, 5)) and all(r["ktok_s"] > 0 for r in recs)
    assert ckpt.latest_complete(tmp_path / "ckpt").name == "step-40"


def test_a_drafter_oom_is_reported_and_the_run_finishes_on_the_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(tiny(tmp_path, "max_steps=12"), environ={"DFLASH_FAULT": "drafter-oom-at-step:4:1"})
    with caplog.at_level(logging.INFO):
        assert run.train() == 0
    assert run.pipeline is not None and run.pipeline.step == 12
    (f,) = run.pipeline.failures
    assert (f.role, f.index, f.device) == ("drafter", 1, "cpu")
    assert "drafter-1 (cpu) died at step" in caplog.text and "CUDA out of memory" in caplog.text
    assert "retrying once with the batch halved" in caplog.text
    assert (tmp_path / "ckpt" / ".dflash-fault-drafter-oom-at-step-4-1").exists()
    assert len(run.drafters[0].trained) >= 12 - 4


def test_dflash_fault_raise_fires_once_then_the_rerun_goes_through(tmp_path: Path) -> None:
    from dflash.train.pipeline import InjectedFault

    env = {"DFLASH_FAULT": "raise-at-step:3"}
    with pytest.raises(InjectedFault, match=r"^DFLASH_FAULT raise-at-step:3: injected failure at step 3$"):
        Run(tiny(tmp_path, "max_steps=8"), environ=env).train()
    assert (tmp_path / "ckpt" / ".dflash-fault-raise-at-step-3").exists()
    assert Run(tiny(tmp_path, "max_steps=8"), environ=env).train() == 0
    with pytest.raises(ConfigError, match=r"^\$DFLASH_FAULT: unknown fault 'melt'"):
        Run(tiny(tmp_path), environ={"DFLASH_FAULT": "melt:3"})


def test_all_drafters_dead_raises_with_every_thread_joined(tmp_path: Path) -> None:
    run = Run(
        tiny(tmp_path, "max_steps=1000"), environ={"DFLASH_FAULT": "drafter-oom-at-step:3:0,drafter-oom-at-step:3:1"}
    )
    with pytest.raises(
        PipelineError, match=r"^no drafter left at step \d+: drafter-\d \(cpu\) died .*CUDA out of memory"
    ):
        run.train()
    assert run.pipeline is not None
    assert not [th.name for th in run.pipeline.threads if th.is_alive()]
    assert ckpt.latest_complete(tmp_path / "ckpt") is None, "no checkpoint from a failed run"


def test_resume_continues_the_step_count_and_the_data_position(tmp_path: Path) -> None:
    first = Run(tiny(tmp_path, "max_steps=8"), environ={})
    assert first.train() == 0
    saved = ckpt.load_checkpoint(ckpt.latest_complete(tmp_path / "ckpt"))
    assert saved.step == 8
    position = saved.trainer_state["data"]["next"]
    weights = {k: v.clone() for k, v in first.drafters[0].model.state_dict().items()}

    second = Run(tiny(tmp_path, "max_steps=16"), environ={})
    assert second.start_step == 8
    assert second.shard_starts == position
    for k, v in second.drafters[1].model.state_dict().items():
        assert torch.equal(v, weights[k]), f"replica 1 resumed with the saved {k}"
    assert second.drafters[0].optimizer.state_dict()["state"], "AdamW moments came back"
    assert second.train() == 0
    before = first.drafters[0].trained + first.drafters[1].trained
    after = second.drafters[0].trained + second.drafters[1].trained
    assert len(after) == 8
    both = before + after
    assert len(both) == len(set(both)), "no batch trained twice across the restart"
    T = len(position)
    for shard in range(T):
        got = sorted(g for g in both if g % T == shard)
        assert got == list(range(shard, shard + T * len(got), T)), f"shard {shard} skipped a batch: {got}"
        assert min(g for g in after if g % T == shard) == position[shard], (
            "the first batch after resume is the saved one"
        )
    assert ckpt.latest_complete(tmp_path / "ckpt").name == "step-16"


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    assert Run(tiny(tmp_path, "max_steps=2"), environ={}).train() == 0
    with pytest.raises(ConfigError, match=r"^drafter.layers: the checkpoint .* has num_hidden_layers=2, this run 3"):
        Run(tiny(tmp_path, "max_steps=4", "drafter.layers=3"), environ={})


def test_bf16_drafters_train_on_fp32_master_weights(tmp_path: Path) -> None:
    run = Run(tiny(tmp_path, "max_steps=4", "drafter.dtype=bfloat16", "devices.drafters=cpu"), environ={})
    r = run.drafters[0]
    assert r.separate_masters and all(m.dtype == torch.float32 for m in r.masters)
    assert all(p.dtype == torch.bfloat16 for p in r.params)
    assert run.train() == 0
    for p, m in zip(r.params, r.masters):
        assert torch.equal(p, m.to(torch.bfloat16)), "the model holds the rounded masters"
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in r.masters), "masters keep fp32 precision"
    saved = ckpt.load_checkpoint(ckpt.latest_complete(tmp_path / "ckpt"))
    assert saved.optimizer_state["masters"] is not None


def test_lr_schedule_warms_up_then_decays() -> None:
    s = LRSchedule(lr=1.0, total_steps=100, warmup_ratio=0.04, schedule="cosine", min_lr_ratio=0.1)
    assert [s(k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s(52) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(100) == pytest.approx(0.1)
    lin = LRSchedule(lr=2.0, total_steps=10, warmup_ratio=0.0, schedule="linear", min_lr_ratio=0.0)
    assert lin(0) == 2.0 and lin(5) == pytest.approx(1.0) and lin(10) == 0.0
    const = LRSchedule(lr=3.0, total_steps=10, warmup_ratio=0.2, schedule="constant", min_lr_ratio=0.0)
    assert const(1) == 1.5 and const(9) == 3.0


# --------------------------------------------------------------------------------------------
# Real processes: python -m dflash train


def dflash(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "dflash",
        "train",
        "--config",
        str(TINY),
        "--set",
        f"output_dir={tmp_path / 'run'}",
        "--set",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "--set",
        "log_every=1",
    ]
    for o in overrides:
        cmd += ["--set", o]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("DFLASH_RUN_DIR", None)
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metrics_steps(tmp_path: Path) -> list[int]:
    path = tmp_path / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def test_kill_9_mid_checkpoint_keeps_the_previous_one_and_resume_goes_on_until_sigterm(tmp_path: Path) -> None:
    """A run killed (SIGKILL) while writing its second checkpoint; the rerun resumes from the first one, goes
    on, and a SIGTERM then makes it write a checkpoint and exit 143. One process per stop: the resumed run is
    the one SIGTERM stops."""
    env = {"DFLASH_FAULT": "kill-in-checkpoint:6"}
    proc = dflash(tmp_path, "max_steps=12", "checkpoint.interval=3", env=env)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL, err
    root = tmp_path / "ckpt"
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-step-")]
    assert partial and (partial[0] / "model.safetensors").exists(), "it died in the middle of writing"
    latest = ckpt.latest_complete(root)
    assert latest is not None and 3 <= ckpt.load_checkpoint(latest).step < 6
    killed_at, run_id = ckpt.load_checkpoint(latest).step, ckpt.load_checkpoint(latest).run_id

    seen = len(metrics_steps(tmp_path))
    # same env: the marker stops a 2nd kill; no checkpoint but SIGTERM's after the resume
    proc = dflash(tmp_path, "max_steps=100000", "checkpoint.interval=0", env=env)
    try:
        retry_until(lambda: len(metrics_steps(tmp_path)) >= seen + 3, 120)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert f"resuming from {latest}" in err
    assert "SIGTERM: finishing the steps in flight" in err and "stopped at step" in err
    # the line as the runner's train.log holds it is what `dflashctl history` reads (ops/far/history.py)
    (tmp_path / "train.log").write_text(err)
    found = resumed_from(str(tmp_path / "train.log"))
    assert found is not None and (found["path"], found["step"]) == (str(latest), killed_at), found
    assert run_id is not None and found["run"] == run_id, found  # the resumed run keeps its id (the pruned step's)
    resumed = metrics_steps(tmp_path)[seen:]
    assert resumed == list(range(killed_at + 1, killed_at + 1 + len(resumed))), "the step count continues"
    saved = ckpt.load_checkpoint(ckpt.latest_complete(root))
    assert saved.step >= max(resumed) >= killed_at + 3, "SIGTERM's checkpoint holds every step logged"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-step-")], "the stale temp dir was cleaned"


def test_cli_exit_codes_for_bad_config_and_dead_drafters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command in this process (the tests above run `python -m dflash train` as a process of its own):
    a bad config is exit 2 and one line; a run's failure leaves main with its traceback, which the
    interpreter prints, ending with the line below, and exits 1 (test_exit_codes: entry is sys.exit(main()))."""
    import traceback

    from dflash.__main__ import main

    base = ["train", "--config", str(TINY), "--set", f"output_dir={tmp_path / 'run'}"]
    base += ["--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "log_every=1"]
    assert main([*base, "--set", "drafter.block_size=x"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == 'dflash: drafter.block_size: expected an integer, got "x"'
    assert not (tmp_path / "run").exists(), "a bad config: nothing written"

    monkeypatch.setenv("DFLASH_FAULT", "drafter-oom-at-step:2:0,drafter-oom-at-step:2:1")
    monkeypatch.delenv("DFLASH_RUN_DIR", raising=False)
    with pytest.raises(PipelineError) as e:
        main([*base, "--set", "max_steps=1000"])
    last = traceback.format_exception_only(e.value)[-1].strip()
    assert (
        last.startswith("dflash.train.pipeline.PipelineError: no drafter left at step") and "CUDA out of memory" in last
    )
