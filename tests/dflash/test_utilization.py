"""Where every worker's time goes (busy / waiting on the queue / barrier / other), and TensorBoard.

The pipeline is the real one (threads, queue, barrier, metrics); the workers are the bench's simulated ones
(a sleep per batch releases the GIL the way a CUDA kernel does), so the expected fractions follow from the
costs. The machine is loaded: the checks are wide bands and orderings, never a timing to the millisecond.
"""

from __future__ import annotations

import io
import json
import re
import sys
import typing as t
from pathlib import Path

import pytest

from dflash.train.metrics import Metrics
from dflash.train.pipeline import Pipeline, PipelineOptions
from dflash.train.simulate import BenchSpec, SimDrafter, SimSource, SimTarget, format_result, run_bench

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def by_name(workers: t.Sequence[dict[str, t.Any]]) -> dict[str, dict[str, t.Any]]:
    return {w["name"]: w for w in workers}


def assert_shares_add_up(w: dict[str, t.Any]) -> None:
    shares = [w["busy"], w["wait"], w["barrier"], w["other"]]
    assert all(0.0 <= x <= 1.0 for x in shares), w
    assert sum(shares) == pytest.approx(1.0, abs=0.02), w


def test_a_slow_drafter_is_busy_while_the_targets_are_blocked_by_the_right_amount() -> None:
    # 2 targets x 10 ms supply 200 batches/s; drafter-0 (10 ms) and drafter-1 (40 ms) take 125/s: both
    # drafters are always busy, drafter-1 does a quarter of drafter-0's batches, and each target spends
    # 62.5 batches/s x 10 ms = 62.5% in its forward and the rest blocked on the full queue.
    res = run_bench(
        BenchSpec(
            targets=2,
            drafters=2,
            target_ms=10,
            drafter_ms=10,
            slowdowns={1: 4.0},
            capacity=8,
            steps=250,
            payload_mb=0.01,
        )
    )
    w = by_name(res.workers)
    for x in w.values():
        assert_shares_add_up(x)
    assert w["drafter-0"]["busy"] > 0.8 and w["drafter-1"]["busy"] > 0.8, w
    assert w["drafter-0"]["wait"] < 0.15 and w["drafter-1"]["wait"] < 0.15, w
    assert 2.5 < w["drafter-0"]["batches_s"] / w["drafter-1"]["batches_s"] < 5.5, w
    for name in ("target-0", "target-1"):
        assert 0.2 < w[name]["wait"] < 0.6, w[name]  # expected 0.375 (blocked: the queue is full)
        assert 0.4 < w[name]["busy"] < 0.8, w[name]  # expected 0.625
    assert re.search(r"busy T \d+ \d+ \| D \d+ \d+", format_result(res))


def run_round_robin(accounting: bool = True) -> tuple[list[dict[str, t.Any]], list[str]]:
    """The seed's night, small: 3 targets on 2 per-drafter queues = [2, 1]; targets 30 ms, drafters 20 ms.

    drafter-0 gets 2 x 33/s > its 50/s: always busy, its targets blocked 25% (each delivers 25/s x 30 ms).
    drafter-1 gets target-1's 33/s: busy 67%, starved 33%; target-1 never waits.
    """
    out = io.StringIO()
    metrics = Metrics(log_every=50, stream=out)
    T, D = 3, 2
    pipe = Pipeline(
        targets=[SimTarget("cpu", 0.030, 64) for _ in range(T)],
        sources=[SimSource(i, T, 100) for i in range(T)],
        drafters=[SimDrafter("cpu", 0.020) for _ in range(D)],
        on_step=metrics.record,
        options=PipelineOptions(max_steps=250, capacity=4, mode="per-drafter", accounting=accounting),
    )
    metrics.snapshot = pipe.snapshot
    metrics.start()
    pipe.run()
    return metrics.records, out.getvalue().splitlines()


def test_round_robin_queues_starve_the_drafter_with_fewer_targets_and_the_step_line_shows_it() -> None:
    records, lines = run_round_robin()
    assert [r["step"] for r in records] == [50, 100, 150, 200, 250]
    for r in records:  # a wait that spans windows is spread over them: the shares never exceed the interval
        for x in r["workers"]:
            assert_shares_add_up(x)
    steady = records[1:]  # the first window fills the queues

    def mean(name: str, key: str) -> float:
        return sum(by_name(r["workers"])[name][key] for r in steady) / len(steady)

    assert mean("drafter-0", "busy") > 0.85 and mean("drafter-0", "wait") < 0.1
    assert 0.5 < mean("drafter-1", "busy") < 0.8 and 0.2 < mean("drafter-1", "wait") < 0.45  # 0.67 / 0.33
    assert mean("target-1", "busy") > 0.85 and mean("target-1", "wait") < 0.1
    for name in ("target-0", "target-2"):
        assert 0.6 < mean(name, "busy") < 0.9 and 0.1 < mean(name, "wait") < 0.4  # 0.75 / 0.25
    # the step line's last field carries the same figures, in percent
    m = re.search(r"\| busy T (\d+) (\d+) (\d+) \| D (\d+) (\d+)$", lines[-1])
    assert m, lines[-1]
    last = by_name(records[-1]["workers"])
    names = ["target-0", "target-1", "target-2", "drafter-0", "drafter-1"]
    assert [int(g) for g in m.groups()] == [round(100 * last[n]["busy"]) for n in names]
    assert all(x["batches_s"] > 0 and x["clock"] == "host" for x in last.values())


def test_the_bench_reports_the_figures_metrics_records() -> None:
    records, _ = run_round_robin()
    res = run_bench(BenchSpec(targets=2, drafters=1, target_ms=5, drafter_ms=5, steps=20, payload_mb=0.01))
    assert set(res.workers[0]) == set(records[-1]["workers"][0])
    off = run_bench(
        BenchSpec(targets=2, drafters=1, target_ms=5, drafter_ms=5, steps=20, payload_mb=0.01, accounting=False)
    )
    assert off.workers == [] and off.steps == 20 and "accounting off" in format_result(off)


def test_without_accounting_the_workers_stay_at_zero() -> None:
    records, lines = run_round_robin(accounting=False)
    assert all(x["busy"] == 0.0 and x["wait"] == 0.0 for r in records for x in r["workers"])
    assert records[-1]["step"] == 250


# --------------------------------------------------------------------------------------------
# TensorBoard


def tiny_cfg(tmp_path: Path, *overrides: str) -> t.Any:
    from tests.dflash.conftest import tiny_config

    return tiny_config(tmp_path, "log_every=2", "max_steps=6", *overrides)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_scalars_of_metrics_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from dflash.train.run import Run

    assert Run(tiny_cfg(tmp_path, "metrics.tensorboard=true"), environ={}).train() == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = scalars(tmp_path / "run")
    assert [r["step"] for r in recs] == [2, 4, 6]
    for key in ("loss", "acc", "tau_tf", "ktok_s", "lr", "queue_depth", "drafters_live"):
        assert [s for s, _ in got[f"train/{key}"]] == [2, 4, 6]
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([r[key] for r in recs], rel=1e-5), key
    for w in recs[-1]["workers"]:
        assert got[f"busy/{w['name']}"][-1] == (6, pytest.approx(w["busy"], abs=1e-6))
    # a second attempt (a resume) continues the curve: its steps follow the first one's
    assert (
        Run(
            tiny_cfg(tmp_path, "metrics.tensorboard=true", "max_steps=10", f"output_dir={tmp_path / 'run2'}"),
            environ={},
        ).train()
        == 0
    )
    assert [s for s, _ in scalars(tmp_path / "run2")["train/loss"]] == [8, 10]


def test_tensorboard_without_the_package_is_one_line_and_exit_2_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash.__main__ import main

    # the package made unimportable, as on a machine without the extra (None in sys.modules: ImportError)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    code = main(
        [
            "train",
            "--config",
            str(REPO / "configs" / "tiny-random.toml"),
            "--set",
            f"output_dir={tmp_path / 'run'}",
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set",
            "metrics.tensorboard=true",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "dflash: metrics.tensorboard: needs the tensorboard package: pip install 'dflash[tensorboard]'"
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "ckpt").exists()


def test_a_window_never_counts_more_than_all_of_its_time() -> None:
    # CI saw busy + wait + barrier + other = 1.0104 on a loaded machine: the window's end and each worker's
    # open phase were read from different clock readings, and a phase closed just after the end was counted.
    from dflash.train.metrics import worker_window
    from dflash.train.pipeline import WorkerState

    w = WorkerState(role="target", index=1, device="cpu", busy_s=0.61, wait_s=0.45)
    fig = worker_window(w, None, 1.0)
    parts = [fig["busy"], fig["wait"], fig["barrier"], fig["other"]]
    assert sum(parts) == pytest.approx(1.0, abs=0.001) and fig["busy"] > fig["wait"] > 0
    late = WorkerState(role="target", index=1, device="cpu", busy_s=0.5, phase="wait", since=10.0)
    assert late.settled(9.99).wait_s == 0.0, "a phase opened after the reading adds nothing (never negative)"
