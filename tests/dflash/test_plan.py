"""``dflash plan``: the recipe configs fit the users' box, a run that does not fit is one line with the nearest
setting that does (``dflash train`` refuses it before loading), and the plan bounds a real step's peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.__main__ import main
from dflash.config import load_config
from dflash.train import plan

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tests" / "dflash" / "targets"  # config.json only, from the public model cards
RECIPES = {
    "qwen3-8b-4k.toml": "Qwen3-8B",
    "qwen3-8b-64k.toml": "Qwen3-8B",
    "qwen3.6-27b-4k.toml": "Qwen3.6-27B",
    "qwen3.6-27b-64k.toml": "Qwen3.6-27B",
}
MEASURE = Path(__file__).with_name("plan_measure.py")


def test_every_recipe_config_fits_the_box(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(RECIPES) == sorted(p.name for p in (REPO / "configs").glob("qwen*.toml"))
    for name, target in RECIPES.items():
        args = ["plan", "--config", str(REPO / "configs" / name), "--set", f"target.path={TARGETS / target}"]
        assert main([*args, "--gpu-memory", "96GiB", "--host-memory", "512GiB"]) == 0, name
        out = capsys.readouterr().out
        assert out.splitlines()[1].startswith("drafter  dflash, 5 layers") and out.splitlines()[-1].startswith(
            "fits: every GPU"
        ), out
        assert sum(line.startswith(("cuda:0 ", "cuda:4 ", "cuda:7 ")) for line in out.splitlines()) == 3
    # without the target there (the recipes name /models/...): the reader's one line, said once
    assert main(["plan", "--config", str(REPO / "configs" / "qwen3-8b-4k.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dflash: target.path: cannot read /models/Qwen3-8B/config.json: No such file or directory", err


def test_a_run_that_does_not_fit_is_one_line_with_the_nearest_setting(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--config", str(REPO / "configs" / "qwen3.6-27b-64k.toml"), "--gpu-memory", "96GiB"]
    args += ["--set", f"target.path={TARGETS / 'Qwen3.6-27B'}", "--set", "activation_checkpointing=false"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("dflash plan: cuda:5 (drafter) needs ") and "of 96.0 GiB" in err
    assert err.endswith("it fits with --set activation_checkpointing=true"), err
    # past what checkpointing saves: fewer anchors, the most that fit, with it
    assert main([*args, "--gpu-memory", "70GiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert "it fits with --set activation_checkpointing=true --set drafter.num_anchors=" in err, err
    anchors = int(err.rsplit("=", 1)[1])
    cfg = load_config(REPO / "configs" / "qwen3.6-27b-64k.toml", [f"target.path={TARGETS / 'Qwen3.6-27B'}"])
    shapes = plan.read_shapes(cfg)
    for a, fits in ((anchors, True), (anchors + 64, False)):
        p = plan.make_plan(
            load_config(
                REPO / "configs" / "qwen3.6-27b-64k.toml",
                [f"target.path={TARGETS / 'Qwen3.6-27B'}", f"drafter.num_anchors={a}"],
            ),
            shapes,
            gpu_memory=lambda _d: 70 << 30,
            host_memory=None,
        )
        assert p.fits is fits


def test_train_refuses_before_loading_on_gpus_it_knows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # the GPUs' memory is the one double (no GPU here); the target folder has no weights: loading would fail otherwise
    monkeypatch.setattr(plan, "local_gpu_memory", lambda dev: 96 << 30 if dev.startswith("cuda") else None)
    monkeypatch.setattr(plan, "host_ram", lambda: 512 << 30)
    args = [
        "train",
        "--config",
        str(REPO / "configs" / "qwen3-8b-64k.toml"),
        "--set",
        f"target.path={TARGETS / 'Qwen3-8B'}",
    ]
    args += [
        "--set",
        f"output_dir={tmp_path}",
        "--set",
        "drafter.num_anchors=8192",
        "--set",
        "activation_checkpointing=false",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dflash plan: cuda:5 (drafter) needs "), err
    assert not any(tmp_path.iterdir())  # nothing written, nothing loaded
    # on the CPU the tiny runs are never judged
    plan.check_before_loading(load_config(REPO / "configs" / "tiny-random.toml"))


def test_doctor_shows_the_plan_of_the_hosts_run_where_it_lives(tmp_path: Path) -> None:
    from ops import doctor
    from ops.hosts import parse_inventory
    from ops.transport import LocalTransport
    from testkit.hostsfile import dump_hosts

    work = tmp_path / "w"
    (work / "current").mkdir(parents=True)  # the deployed release: the run config's paths start there
    recipe = (REPO / "configs" / "qwen3-8b-64k.toml").read_text()
    (work / "current" / "run.toml").write_text(recipe.replace('"/models/Qwen3-8B"', f'"{TARGETS / "Qwen3-8B"}"'))
    (work / "current" / "gone.toml").write_text(recipe)
    env = {"PYTHONPATH": str(REPO)}
    for name, status, words in (
        ("run.toml", "ok", "cuda:5   drafter"),
        ("gone.toml", "skip", "cannot plan gone.toml: dflash: target.path: cannot read /models/Qwen3-8B/config.json"),
    ):
        text = dump_hosts(
            None,
            {
                "l": {
                    "transport": "local",
                    "workdir": str(work),
                    "python": sys.executable,
                    "env": env,
                    "command": f"python -m dflash train --config {name}",
                }
            },
        )
        check = doctor.plan_check(parse_inventory(text, path=None, base=tmp_path).get(), LocalTransport())
        assert check.status == status and words in check.detail, check
    assert check.detail.endswith("(exit 2)")


def test_the_optimizer_state_is_counted_by_optimizer_and_an_own_head_by_its_rows() -> None:
    sets = [f"target.path={TARGETS / 'Qwen3-8B'}"]
    adamw = load_config(REPO / "configs" / "qwen3-8b-4k.toml", sets)
    muon = load_config(REPO / "configs" / "qwen3-8b-4k.toml", [*sets, "optim.name=muon"])
    s = plan.read_shapes(adamw)
    assert 0.9 * s.drafter_params < s.drafter_muon_params < s.drafter_params  # norms stay with AdamW
    assert plan.optimizer_bytes(adamw, s) == 8 * s.drafter_params
    assert plan.optimizer_bytes(muon, s) == 4 * s.drafter_muon_params + 8 * (s.drafter_params - s.drafter_muon_params)
    own = plan.read_shapes(
        load_config(REPO / "configs" / "qwen3-8b-4k.toml", [*sets, "drafter.draft_vocab_size=32000"])
    )
    assert own.drafter_params - s.drafter_params == 32000 * s.hidden


def test_sizes() -> None:
    assert plan.parse_size("96GiB", "--gpu-memory") == 96 << 30
    assert plan.parse_size("96G", "--gpu-memory") == 96 << 30
    assert plan.parse_size("80GB", "--gpu-memory") == 80 * 10**9
    assert plan.parse_size("512 GiB", "--host-memory") == 512 << 30
    with pytest.raises(plan.ConfigError, match="--gpu-memory: 'lots' is not a size"):
        plan.parse_size("lots", "--gpu-memory")


def test_the_plan_bounds_a_real_drafter_step_on_the_cpu() -> None:
    """The plan's drafter figures (optimizer state, gradients, activations) against the peak RSS of one real
    step on the CPU, in a process of its own (the peak reset just before the step; large blocks mmapped, so
    that freed memory leaves the RSS): never under it, and within 30% over it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run(
        [sys.executable, str(MEASURE)], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    figures = json.loads(out.splitlines()[-1])
    ratio = figures["measured"] / figures["planned"]
    assert 0.7 <= ratio <= 1.0, figures
