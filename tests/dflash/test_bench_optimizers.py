"""bench/optimizers.py's runs and table (no training here: fixed figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.optimizers import parse_args, runs, table, train_args


def test_every_seed_trains_each_optimizer_with_only_the_optimizer_changed(tmp_path: Path) -> None:
    a = parse_args(["--tiny", str(tmp_path), "--seeds", "0,1", "--muon-lr", "0.01"])
    assert a.steps == 300 and a.out.name == "optimizers"
    todo = runs(a)
    assert [(label, seed) for label, seed, _ in todo] == [
        ("adamw", 0), ("muon", 0), ("muon lr 0.01", 0), ("adamw", 1), ("muon", 1), ("muon lr 0.01", 1)
    ]  # fmt: skip
    sets = [{v for k, v in zip(r, r[1:]) if k == "--set"} for r in (train_args(a, s, x, tmp_path) for _, s, x in todo)]
    assert sets[0] ^ sets[1] == {"optim.name=adamw", "optim.name=muon"}
    assert sets[1] ^ sets[2] == {"optim.muon_lr=0.01"}
    assert sets[0] ^ sets[3] == {"seed=0", "seed=1"}
    assert {"drafter.kind=dflash", "max_steps=300", 'devices.drafters=["cpu"]'} <= sets[0]
    with pytest.raises(SystemExit, match=r"^optimizers: --seeds: expected integers, got 'x'$"):
        parse_args(["--seeds", "x"])


def test_the_table_has_a_row_per_run() -> None:
    row = {"optimizer": "muon", "seed": 1, "steps": 300, "tau": 4.567, "acceptance": [0.9, 0.5], "ktok_s": 3.21}
    lines = table([row]).splitlines()
    assert lines[0].startswith("| optimizer | seed | steps | tau | acc 1 |") and lines[0].endswith("| train Ktok/s |")
    assert lines[2] == "| muon | 1 | 300 | 4.57 | 0.90 | 0.50 |  |  |  |  |  | 3.21 |"
