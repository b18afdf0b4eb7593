"""bench/drafter_kinds.py's options, the commands it runs and its table (no training here: fixed figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.drafter_kinds import (
    COMBOS,
    eval_args,
    long_prompts,
    mean_ktok_s,
    parse_args,
    table,
    train_args,
    window_table,
)

ROWS = [
    {"kind": "dflash", "weighting": "decay", "steps": 800, "tau": 3.456, "ktok_s": 4.125,
     "acceptance": [0.91, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]},
    {"kind": "dflash2", "weighting": "dpace", "steps": 800, "tau": 2.0, "ktok_s": 1.5,
     "acceptance": [0.5, 0.25]},
]  # fmt: skip


def test_the_table_has_a_row_per_run_and_a_column_per_position() -> None:
    lines = table(ROWS).splitlines()
    assert lines[0] == (
        "| kind | weighting | steps | tau | acc 1 | acc 2 | acc 3 | acc 4 | acc 5 | acc 6 | acc 7 | train Ktok/s |"
    )
    assert lines[1] == "|---|---|" + "---:|" * 10
    assert lines[2] == "| dflash | decay | 800 | 3.46 | 0.91 | 0.80 | 0.70 | 0.60 | 0.50 | 0.40 | 0.30 | 4.12 |"
    assert lines[3] == "| dflash2 | dpace | 800 | 2.00 | 0.50 | 0.25 |  |  |  |  |  | 1.50 |"  # blank past the block
    assert len(lines) == 4 and all(ln.count("|") == 13 for ln in lines)


def test_the_options_and_their_defaults_from_the_make_tiny_folder(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    a = parse_args(["--tiny", str(tiny), "--steps", "600", "--out", str(tmp_path / "out")])
    assert (a.steps, a.seed, a.max_new, a.threads) == (600, 0, 128, 1)
    assert (a.data, a.target, a.prompts) == (tiny / "train.jsonl", tiny / "target", tiny / "eval.jsonl")
    (tiny / "store").mkdir(parents=True)
    (tiny / "store" / "meta.json").write_text("{}")
    assert parse_args(["--tiny", str(tiny)]).data == tiny / "store"  # the demo's store when it is there
    assert parse_args(["--tiny", str(tiny), "--data", str(tmp_path / "d.jsonl")]).data == tmp_path / "d.jsonl"
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


def test_every_run_has_the_same_seed_steps_data_and_one_worker_of_each(tmp_path: Path) -> None:
    a = parse_args(["--tiny", str(tmp_path), "--steps", "700", "--seed", "3"])
    runs = [train_args(a, kind, w, tmp_path / f"{kind}-{w}") for kind, w in COMBOS]
    sets = [{v for k, v in zip(r, r[1:]) if k == "--set"} for r in runs]
    common = set.intersection(*sets)
    assert {"max_steps=700", "seed=3", 'devices.targets=["cpu"]', 'devices.drafters=["cpu"]'} <= common
    assert [sorted(s - common) for s in sets] == [
        sorted([f"drafter.kind={k}", f"loss.position_weight={w}", f"output_dir={(tmp_path / f'{k}-{w}').resolve()}"])
        for k, w in COMBOS
    ]
    ev = eval_args(a, tmp_path / "dflash-decay")
    assert ev[:3] == ["eval", "--drafter", str(tmp_path / "dflash-decay" / "checkpoints")]
    assert ev[ev.index("--prompts") + 1] == str((tmp_path / "eval.jsonl").resolve())


def test_ktok_s_is_the_mean_of_the_step_records_only(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    recs = [
        {"step": 50, "ktok_s": 2.0},
        {"kind": "eval", "step": 50, "tau": 3.0, "ktok_s": 99.0},
        {"step": 100, "ktok_s": 4.0},
    ]
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert mean_ktok_s(m) == 3.0


def test_window_mode_sets_the_window_and_builds_prompts_past_the_training_length(tmp_path: Path) -> None:
    data, prompts = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i] * 40, "loss_mask": [1] * 40}) + "\n" for i in range(3)))
    prompts.write_text("".join(json.dumps({"input_ids": [90 + i] * 5}) + "\n" for i in range(2)))
    a = parse_args(["--data", str(data), "--prompts", str(prompts), "--window", "64", "--max-length", "100"])
    assert train_args(a, "dflash", "decay", tmp_path / "r", "drafter.sliding_window=64")[-4:] == [
        "--set",
        "data.max_length=100",
        "--set",
        "drafter.sliding_window=64",
    ]
    rows = [json.loads(line)["input_ids"] for line in long_prompts(a, tmp_path / "long.jsonl").read_text().splitlines()]
    # whole conversations in order (wrapping around) until past 100 tokens, then the held-out prompt
    assert rows == [[0] * 40 + [1] * 40 + [2] * 40 + [90] * 5, [0] * 40 + [1] * 40 + [2] * 40 + [91] * 5]
    with pytest.raises(SystemExit):
        parse_args(["--window", "0"])
    row = {**ROWS[0], "attention": "sliding 64", "tau_long": 3.0}
    lines = window_table([row]).splitlines()
    assert lines[0].startswith("| attention | steps | tau | acc 1 |") and lines[0].endswith(
        "| tau long | train Ktok/s |"
    )
    assert lines[2] == "| sliding 64 | 800 | 3.46 | 0.91 | 0.80 | 0.70 | 0.60 | 0.50 | 0.40 | 0.30 | 3.00 | 4.12 |"
