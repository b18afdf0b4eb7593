"""The threaded pipeline with tiny real modules: one queue, dead workers, the barrier, stop, metrics."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import threading
import time
import typing as t
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.train.faults import FaultInjector, cuda_oom, faults_from_env
from dflash.train.metrics import Metrics, format_step_line
from dflash.train.pipeline import InjectedFault, Pipeline, PipelineError, PipelineOptions, StepStats, SyncEvent

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass
class Batch:
    index: int
    n_tokens: int
    x: torch.Tensor


class Source:
    """Shard j of T: global batches j, j+T, ... with deterministic inputs."""

    def __init__(self, start: int, stride: int, limit: int | None = None) -> None:
        self.next, self.stride, self.limit = start, stride, limit

    def __next__(self) -> Batch:
        if self.limit is not None and self.next >= self.limit:
            raise StopIteration
        g = self.next
        self.next += self.stride
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(g))
        return Batch(g, 10 + g % 3, x)


class TinyTarget:
    """A frozen linear 'target' producing features under no_grad."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        torch.manual_seed(0)
        self.model = nn.Linear(6, 8).requires_grad_(False)

    def produce(self, batch: Batch) -> tuple[int, torch.Tensor]:
        with torch.no_grad():
            return batch.index, self.model(batch.x)


class TinyDrafter:
    """A linear regression 'drafter' with its own optimizer; records what it trained."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        torch.manual_seed(1)
        self.model = nn.Linear(8, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.trained: list[int] = []
        self.micro: list[int] = []
        self.recovered = 0

    def step(self, payload: tuple[int, torch.Tensor], *, step: int, micro_batches: int = 1) -> StepStats:
        index, feats = payload
        self.opt.zero_grad()
        loss = ((self.model(feats).squeeze(-1) - feats.sum(-1)) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.trained.append(index)
        self.micro.append(micro_batches)
        return StepStats(loss=float(loss.detach()), acc=0.5, tau_tf=2.0, blocks=4, lr=0.05, acc_per_slot=(0.6, 0.4))

    def recover(self) -> None:
        self.recovered += 1
        self.opt.zero_grad()


def build(
    T: int = 2,
    D: int = 2,
    *,
    max_steps: int = 40,
    sources: list[Source] | None = None,
    injector: FaultInjector | None = None,
    on_sync: t.Callable[[SyncEvent], None] | None = None,
    on_step: t.Callable[[int, StepStats, int], None] | None = None,
    shard_starts: list[int] | None = None,
    **opts: t.Any,
) -> tuple[Pipeline, list[TinyDrafter]]:
    drafters = [TinyDrafter("cpu") for _ in range(D)]
    pipe = Pipeline(
        targets=[TinyTarget() for _ in range(T)],
        sources=sources if sources is not None else [Source(i, T) for i in range(T)],
        drafters=drafters,
        options=PipelineOptions(max_steps=max_steps, **{"capacity": 4, "poll": 0.02, **opts}),
        injector=injector,
        on_sync=on_sync,
        on_step=on_step,
        shard_starts=shard_starts,
    )
    return pipe, drafters


def assert_all_joined(pipe: Pipeline) -> None:
    assert pipe.threads and not [th.name for th in pipe.threads if th.is_alive()]


# --------------------------------------------------------------------------------------------
# The shared queue


def test_every_batch_is_trained_exactly_once_and_the_step_count_is_exact() -> None:
    pipe, drafters = build(T=3, D=2, max_steps=60)
    result = pipe.run()
    assert result.steps == 60 and result.reason == "max-steps" and not result.failures
    trained = sorted(i for d in drafters for i in d.trained)
    assert len(trained) == 60 and len(set(trained)) == 60, "consume-once: no batch twice"
    assert all(d.trained for d in drafters), "both drafters took work from the one queue"
    # the data position: per shard, one past the last batch taken
    for shard, nxt in enumerate(result.position):
        taken = [i for i in trained if i % 3 == shard]
        assert nxt == (max(taken) + 3 if taken else shard)
        assert taken == list(range(shard, nxt, 3)), "each shard is consumed in order, without gaps"
    assert_all_joined(pipe)


class SlowTarget(TinyTarget):
    """A target whose forward takes longer than the join timeout (a long sequence's, on a large target)."""

    def produce(self, batch: Batch) -> tuple[int, torch.Tensor]:
        time.sleep(0.4)
        return super().produce(batch)


def test_a_stop_waits_for_a_forward_in_flight_longer_than_the_join_timeout() -> None:
    """At a fixed join timeout (0.1 s here, 8 s by default) a run whose target forwards take longer failed at its
    end, on time, with "threads still running after the stop": the forward in flight cannot be interrupted."""
    pipe = Pipeline(
        targets=[SlowTarget()],
        sources=[Source(0, 1)],
        drafters=[TinyDrafter()],
        options=PipelineOptions(max_steps=2, capacity=4, poll=0.02, join_timeout=0.1),
    )
    result = pipe.run()
    assert result.steps == 2 and result.reason == "max-steps" and not result.failures
    assert pipe.workers[("target", 0)].longest_s >= 0.4
    assert_all_joined(pipe)


def test_backpressure_bounds_what_targets_run_ahead() -> None:
    pipe, drafters = build(T=2, D=1, max_steps=30, capacity=3)
    pipe.run()
    produced = sum(w.items for w in pipe.workers.values() if w.role == "target")
    assert produced <= 30 + 3 + 2, "targets never get further ahead than the queue plus one batch each"


def test_per_drafter_mode_assigns_targets_round_robin() -> None:
    T, D = 5, 3
    pipe, drafters = build(T=T, D=D, max_steps=45, mode="per-drafter", capacity=6)
    pipe.run()
    for j, d in enumerate(drafters):
        shards = {i % T for i in d.trained}
        assert shards <= {i for i in range(T) if i % D == j}, f"drafter {j} got {shards}"
    assert [len(q.queue) <= q.maxsize == 2 for q in pipe.queues] == [True] * 3


# --------------------------------------------------------------------------------------------
# Dead workers


def test_a_drafter_oom_is_retried_once_with_the_batch_halved() -> None:
    inj = FaultInjector()
    inj.fail_at("drafter", 1, 10, cuda_oom)  # fires once: the retry succeeds
    pipe, drafters = build(max_steps=30, injector=inj)
    result = pipe.run()
    assert result.steps == 30 and not result.failures
    assert drafters[1].recovered == 1 and drafters[1].micro.count(2) == 1
    assert inj.counts[("drafter", 1)] == 1


def test_a_drafter_that_keeps_running_out_of_memory_dies_and_the_others_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inj = FaultInjector()
    inj.fail_at("drafter", 1, 12, cuda_oom, times=2)
    pipe, drafters = build(T=2, D=3, max_steps=50, injector=inj)
    with caplog.at_level(logging.ERROR, logger="dflash.pipeline"):
        result = pipe.run()
    assert result.steps == 50, "the run finished on the other drafters"
    (f,) = result.failures
    assert (f.role, f.index, f.device) == ("drafter", 1, "cpu") and f.step is not None and f.step >= 12
    assert isinstance(f.exc, torch.OutOfMemoryError)
    assert "drafter-1 (cpu) died at step" in caplog.text and "torch.OutOfMemoryError: CUDA out of memory" in caplog.text
    assert "2 drafters left" in caplog.text
    assert pipe.workers[("drafter", 1)].dead and pipe.snapshot().live("drafter") == 2
    trained = sorted(i for d in drafters for i in d.trained)
    assert len(trained) == len(set(trained)) == 50, "the dead drafter's claimed step was trained by another"
    assert_all_joined(pipe)


def test_all_drafters_dead_ends_the_run_with_an_error_and_no_thread_left() -> None:
    inj = FaultInjector()
    inj.fail_at("drafter", 0, 5, cuda_oom, times=2)
    inj.fail_at("drafter", 1, 8, cuda_oom, times=2)
    pipe, _ = build(max_steps=10_000, injector=inj)
    with pytest.raises(
        PipelineError,
        match=r"no drafter left at step \d+: drafter-\d \(cpu\) died at step \d+: "
        r"torch.OutOfMemoryError: CUDA out of memory",
    ) as err:
        pipe.run()
    assert {(f.role, f.index) for f in err.value.failures} == {("drafter", 0), ("drafter", 1)}
    assert_all_joined(pipe)


def test_all_targets_dead_ends_the_run_once_the_queue_is_drained() -> None:
    inj = FaultInjector()
    inj.fail_at("target", 0, 3, RuntimeError("CUDA error: an illegal memory access was encountered"))
    inj.fail_at("target", 1, 4, RuntimeError("CUDA error: an illegal memory access was encountered"))
    pipe, drafters = build(max_steps=10_000, injector=inj)
    with pytest.raises(PipelineError, match=r"no target left to feed the drafters .*target-\d \(cpu\) died"):
        pipe.run()
    trained = sum(len(d.trained) for d in drafters)
    assert trained == 2 + 3, "what the targets produced before dying was still trained"
    assert_all_joined(pipe)


def test_a_fatal_fault_stops_everything_and_is_raised_as_is() -> None:
    inj = FaultInjector()
    boom = InjectedFault("boom at step 7")
    inj.fail_at("drafter", None, 7, boom, fatal=True)
    pipe, _ = build(max_steps=1000, injector=inj)
    with pytest.raises(InjectedFault) as err:
        pipe.run()
    assert err.value is boom
    assert_all_joined(pipe)


def test_a_failing_checkpoint_at_the_barrier_fails_the_run() -> None:
    def on_sync(ev: SyncEvent) -> None:
        if not ev.final:
            raise OSError(28, "No space left on device")

    pipe, _ = build(max_steps=1000, on_sync=on_sync, checkpoint_every=5)
    with pytest.raises(OSError, match="No space left on device"):
        pipe.run()
    assert len(pipe.failures) == 1 and pipe.failures[0].fatal
    assert_all_joined(pipe)


def test_a_finite_source_ends_a_target_without_an_error() -> None:
    pipe, drafters = build(T=2, D=2, max_steps=1000, sources=[Source(0, 2, limit=10), Source(1, 2, limit=10)])
    with pytest.raises(PipelineError, match="the drafters stopped at step 10 of 1000"):
        pipe.run()
    assert not pipe.failures and sum(len(d.trained) for d in drafters) == 10


# --------------------------------------------------------------------------------------------
# The barrier


def test_syncs_come_at_the_intervals_with_no_step_in_flight() -> None:
    events: list[SyncEvent] = []
    in_flight = {"n": 0, "max_at_sync": 0}
    lock = threading.Lock()

    class Counting(TinyDrafter):
        def step(self, payload: t.Any, *, step: int, micro_batches: int = 1) -> StepStats:
            with lock:
                in_flight["n"] += 1
            try:
                return super().step(payload, step=step, micro_batches=micro_batches)
            finally:
                with lock:
                    in_flight["n"] -= 1

    def on_sync(ev: SyncEvent) -> None:
        with lock:
            in_flight["max_at_sync"] = max(in_flight["max_at_sync"], in_flight["n"])
        events.append(ev)

    drafters = [Counting() for _ in range(3)]
    pipe = Pipeline(
        targets=[TinyTarget(), TinyTarget()],
        sources=[Source(0, 2), Source(1, 2)],
        drafters=drafters,
        options=PipelineOptions(max_steps=40, capacity=4, poll=0.02, average_every=6, checkpoint_every=15),
        on_sync=on_sync,
    )
    pipe.run()
    periodic = [e for e in events if not e.final]
    assert in_flight["max_at_sync"] == 0, "averaging never overlaps a training step"
    assert len(periodic) >= 5 and all(e.replicas == (0, 1, 2) and not e.missing for e in periodic)
    assert any(e.checkpoint for e in periodic)
    final = events[-1]
    assert final.final and final.step == 40 and final.average and final.checkpoint
    for a, b in zip(periodic, periodic[1:]):
        assert b.step > a.step


def test_a_dead_drafter_does_not_block_the_barrier() -> None:
    events: list[SyncEvent] = []
    inj = FaultInjector()
    inj.fail_at("drafter", 2, 9, cuda_oom, times=2)
    pipe, _ = build(T=2, D=3, max_steps=60, injector=inj, on_sync=events.append, average_every=4, barrier_timeout=600)
    result = pipe.run()
    assert result.steps == 60
    # the fault fires at drafter 2's first step >= 9, whenever its thread gets there (on a loaded machine,
    # some barriers later): from the first barrier without it on, the parties are the two live drafters
    periodic = [e for e in events if not e.final]
    first = next((k for k, e in enumerate(periodic) if e.replicas == (0, 1)), None)
    assert first is not None, "a barrier after the death went on without it"
    assert all(e.replicas == (0, 1) for e in periodic[first:]), "the barrier's parties follow the live drafters"
    assert all(e.replicas == (0, 1, 2) for e in periodic[:first])
    assert events[-1].final and events[-1].replicas == (0, 1)


def test_a_drafter_that_misses_the_barrier_is_left_out_after_the_timeout() -> None:
    events: list[SyncEvent] = []
    inj = FaultInjector()
    inj.hang_at("drafter", 1, 3)
    pipe: Pipeline

    def on_step(n: int, stats: StepStats, tokens: int) -> None:
        if n >= 20:
            pipe.request_stop()

    pipe, drafters = build(
        max_steps=10_000, injector=inj, on_sync=events.append, on_step=on_step, average_every=5, barrier_timeout=0.3
    )
    result = pipe.run()
    assert result.reason == "stopped"
    # Under load drafter 1 may reach its step 3 only after a sync or two: look for the first miss.
    missed = [e for e in events if not e.final and e.missing]
    assert missed and missed[0].replicas == (0,) and missed[0].missing == (1,)
    assert_all_joined(pipe)


def test_request_stop_finishes_in_flight_steps_and_runs_the_final_sync() -> None:
    events: list[SyncEvent] = []
    pipe: Pipeline

    def on_step(n: int, stats: StepStats, tokens: int) -> None:
        if n == 7:
            pipe.request_stop()

    pipe, drafters = build(max_steps=10_000, on_sync=events.append, on_step=on_step)
    result = pipe.run()
    assert result.reason == "stopped" and 7 <= result.steps <= 8, "only the step in flight finishes"
    assert events[-1].final and events[-1].step == result.steps and events[-1].checkpoint
    assert sum(len(d.trained) for d in drafters) == result.steps
    assert_all_joined(pipe)


def test_a_resumed_pipeline_continues_the_step_count() -> None:
    seen: list[int] = []
    pipe, drafters = build(
        max_steps=30,
        start_step=20,
        on_step=lambda n, s, tk: seen.append(n),
        sources=[Source(40, 2), Source(41, 2)],
        shard_starts=[40, 41],
    )
    result = pipe.run()
    assert sorted(seen) == list(range(21, 31)) and result.steps == 30
    trained = sorted(i for d in drafters for i in d.trained)
    assert trained[0] in (40, 41) and len(trained) == 10
    assert all(p >= s for p, s in zip(result.position, (40, 41)))


# --------------------------------------------------------------------------------------------
# Fault specs from the environment


def test_fault_env_parses_and_fires_once_per_checkpoint_dir(tmp_path: Path) -> None:
    inj = faults_from_env("raise-at-step:5, drafter-oom-at-step:7:1", tmp_path)
    assert inj.check("drafter", 0, 4) is None
    hit = inj.check("drafter", 0, 5)
    assert hit is not None and hit.fatal and isinstance(hit.exc("cpu"), InjectedFault)
    assert (tmp_path / ".dflash-fault-raise-at-step-5").read_text().strip() == "raise-at-step:5"
    assert inj.check("drafter", 1, 6) is None and inj.check("drafter", 1, 7) is not None
    again = faults_from_env("raise-at-step:5, drafter-oom-at-step:7:1", tmp_path)
    assert again.check("drafter", 0, 50) is None and again.check("drafter", 1, 50) is None
    with pytest.raises(ValueError, match="unknown fault 'explode-at-step'"):
        faults_from_env("explode-at-step:3", tmp_path)
    with pytest.raises(ValueError, match="drafter-oom-at-step takes 2 number"):
        faults_from_env("drafter-oom-at-step:3", tmp_path)


def test_cuda_oom_text_names_the_gpu() -> None:
    e = cuda_oom("cuda:5")
    assert str(e).startswith("CUDA out of memory. Tried to allocate") and "GPU 5 " in str(e)


# --------------------------------------------------------------------------------------------
# Metrics


LINE = re.compile(
    r"^step \d+ \| loss \d+\.\d{3} \| acc \d\.\d{2} \| tau_tf \d+\.\d \| \d+\.\d Ktok/s \| "
    r"queue \d+/\d+ \| drafters \d+/\d+ \| busy T( (\d+|-))+ \| D( (\d+|-))+$"
)


def test_step_line_has_exactly_the_grepped_form() -> None:
    line = format_step_line(
        step=120,
        loss=2.3141,
        acc=0.612,
        tau_tf=3.21,
        ktok_s=19.43,
        queue_depth=37,
        queue_capacity=64,
        drafters_live=3,
        drafters_total=3,
    )
    assert line == "step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 3/3"
    workers = [
        {"role": "drafter", "index": 1, "busy": 0.544},
        {"role": "target", "index": 0, "busy": 0.971},
        {"role": "drafter", "index": 0, "busy": 0.99},
        {"role": "drafter", "index": 2, "busy": 0.0, "dead": True},
    ]
    with_busy = format_step_line(
        step=120,
        loss=2.3141,
        acc=0.612,
        tau_tf=3.21,
        ktok_s=19.43,
        queue_depth=37,
        queue_capacity=64,
        drafters_live=2,
        drafters_total=3,
        workers=workers,
    )
    assert with_busy == (
        "step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 2/3"
        " | busy T 97 | D 99 54 -"
    )


def test_metrics_lines_and_records_from_a_run(tmp_path: Path) -> None:
    out = io.StringIO()
    path = tmp_path / "run" / "metrics.jsonl"
    metrics = Metrics(log_every=5, path=path, stream=out)
    pipe, drafters = build(T=2, D=2, max_steps=20, on_step=metrics.record)
    metrics.snapshot = pipe.snapshot
    metrics.start()
    pipe.run()
    metrics.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 5", "step 10", "step 15", "step 20"]
    assert all(LINE.match(ln) for ln in lines), lines
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == [5, 10, 15, 20]
    r = recs[-1]
    assert r["queue_capacity"] == 4 and 0 <= r["queue_depth"] <= 4
    assert (r["drafters_live"], r["drafters_total"], r["targets_live"], r["targets_total"]) == (2, 2, 2, 2)
    assert r["acc_per_slot"] == [0.6, 0.4] and r["loss"] >= 0 and r["lr"] == 0.05
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["at"])
    names = {w["name"] for w in r["workers"]}
    assert names == {"target-0", "target-1", "drafter-0", "drafter-1"}
    for w in r["workers"]:
        parts = [w["busy"], w["wait"], w["barrier"], w["other"]]
        assert all(0.0 <= x <= 1.0 for x in parts) and sum(parts) == pytest.approx(1.0, abs=0.01), w
    assert sum(w["batches"] for w in r["workers"] if w["role"] == "drafter") == 5  # the interval's steps
    # Ktok/s counts the target tokens of the batches trained in the interval
    trained = [i for d in drafters for i in d.trained]
    assert sum(x["tokens"] for x in recs) == sum(10 + g % 3 for g in trained)
    assert all(x["ktok_s"] > 0 for x in recs)


def test_metrics_survive_an_unwritable_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = io.StringIO()
    m = Metrics(log_every=1, path=blocker / "metrics.jsonl", stream=out)
    m.start()
    m.record(1, StepStats(loss=1.0, acc=0.5, tau_tf=2.0), 100)
    m.record(2, StepStats(loss=1.0, acc=0.5, tau_tf=2.0), 100)
    assert out.getvalue().count("step ") == 2, "stdout keeps going when metrics.jsonl cannot be written"


# --------------------------------------------------------------------------------------------
# The bench command (figures come from bench/pipeline_matrix.py; here only what it prints)


def test_bench_pipeline_command() -> None:
    from click.testing import CliRunner

    from dflash.__main__ import cli

    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "bench",
            "pipeline",
            "--steps",
            "30",
            "--target-ms",
            "1",
            "--drafter-ms",
            "1",
            "--queue",
            "per-drafter",
            "--capacity",
            "6",
            "--drafter-slowdown",
            "2:1.5",
            "--kill-drafter-at",
            "20",
            "--kill-drafter",
            "1",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "round-robin assignment (targets per drafter): [2, 2, 1]" in res.output
    assert "drafter-1 killed (CUDA OOM, retried once) at step 20" in res.output
    assert re.search(r"after-kill .* Ktok/s +bound .* ratio \d\.\d{3}", res.output)
    assert re.search(r"drafter-1 +cuda:6 .*\(dead\)", res.output)
    bad = runner.invoke(cli, ["bench", "pipeline", "--drafter-slowdown", "3:1.5"])
    assert bad.exit_code == 2 and "drafter 3 does not exist (there are 3)" in bad.output
