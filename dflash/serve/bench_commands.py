"""`dflash bench pipeline | serve`: the benchmarks of the training core (a click group `dflash` adds)."""

from __future__ import annotations

import logging
import typing as t

import click

from dflash import inputs, outputs
from dflash.errors import Failed
from dflash.eval import suites


@click.group()
def bench() -> None:
    """Benchmarks of the training core."""


def _slowdowns(values: t.Sequence[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for v in values:
        idx, sep, factor = v.partition(":")
        try:
            out[int(idx)] = float(factor)
            if not sep or out[int(idx)] <= 0:
                raise ValueError
        except ValueError:
            raise click.BadParameter(
                f'expected INDEX:FACTOR such as "2:1.5", got "{v}"', param_hint="--drafter-slowdown"
            ) from None
    return out


@bench.command("pipeline")
@click.option("--targets", default=5, show_default=True, type=click.IntRange(1), help="Target threads.")
@click.option("--drafters", default=3, show_default=True, type=click.IntRange(1), help="Drafter threads.")
@click.option(
    "--target-ms",
    default=80.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Target cost per batch.",
)
@click.option(
    "--drafter-ms",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Drafter cost per batch.",
)
@click.option(
    "--drafter-slowdown", multiple=True, metavar="I:FACTOR", help="Make drafter I slower, e.g. 0:1.5 (repeatable)."
)
@click.option("--queue", "mode", default="shared", show_default=True, type=click.Choice(["shared", "per-drafter"]))
@click.option("--capacity", default=64, show_default=True, type=click.IntRange(1), help="Queue capacity (batches).")
@click.option("--steps", default=1500, show_default=True, type=click.IntRange(10), help="Global steps to run.")
@click.option("--tokens-per-batch", default=4096, show_default=True, type=click.IntRange(1))
@click.option(
    "--payload-mb", default=1.0, show_default=True, type=click.FloatRange(0), help="Tensor bytes per queue item."
)
@click.option(
    "--kill-drafter-at",
    default=None,
    type=click.IntRange(1),
    help="Kill a drafter (CUDA OOM, retried once) at this step.",
)
@click.option(
    "--kill-drafter",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Which drafter --kill-drafter-at kills.",
)
@click.option(
    "--average-every",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Barrier + averaging every N steps (0: off).",
)
@click.option(
    "--average-ms", default=0.0, show_default=True, type=click.FloatRange(0), help="Simulated averaging cost."
)
@click.option("--no-accounting", is_flag=True, help="Leave per-worker time accounting out (to measure its cost).")
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Also write the result as JSON."
)
def bench_pipeline(
    targets: int,
    drafters: int,
    target_ms: float,
    drafter_ms: float,
    drafter_slowdown: tuple[str, ...],
    mode: str,
    capacity: int,
    steps: int,
    tokens_per_batch: int,
    payload_mb: float,
    kill_drafter_at: int | None,
    kill_drafter: int,
    average_every: int,
    average_ms: float,
    no_accounting: bool,
    json_path: str | None,
) -> None:
    """The real pipeline with simulated workers: Ktok/s against min(target supply, drafter demand)."""
    from dflash.train.simulate import BenchSpec, dump_json, format_result, run_bench

    if json_path:
        outputs.check_out(json_path, what="bench pipeline: --json", kind="file")
    slow = _slowdowns(drafter_slowdown)
    for j in slow:
        if j >= drafters:
            raise click.BadParameter(
                f"drafter {j} does not exist (there are {drafters})", param_hint="--drafter-slowdown"
            )
    if kill_drafter >= drafters:
        raise click.BadParameter(
            f"drafter {kill_drafter} does not exist (there are {drafters})", param_hint="--kill-drafter"
        )
    if kill_drafter_at is not None and kill_drafter_at >= steps:
        raise click.BadParameter(f"must be below --steps ({steps})", param_hint="--kill-drafter-at")
    if mode == "per-drafter" and capacity < drafters:
        raise click.BadParameter(
            f"per-drafter queues need at least one slot each ({drafters})", param_hint="--capacity"
        )
    spec = BenchSpec(
        targets=targets,
        drafters=drafters,
        target_ms=target_ms,
        drafter_ms=drafter_ms,
        slowdowns=slow,
        mode=mode,
        capacity=capacity,
        steps=steps,
        tokens_per_batch=tokens_per_batch,
        payload_mb=payload_mb,
        kill_drafter_at=kill_drafter_at,
        kill_drafter=kill_drafter,
        average_every=average_every,
        average_ms=average_ms,
        accounting=not no_accounting,
    )
    quiet = logging.getLogger("dflash.pipeline")  # the injected kill's traceback is expected
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        res = run_bench(spec)
    finally:
        quiet.setLevel(level)
    click.echo(format_result(res))
    if json_path:
        with outputs.writing(command="bench pipeline", where=json_path), open(json_path, "w") as f:
            f.write(dump_json(res) + "\n")


@bench.command("serve")
@click.option(
    "--server", required=True, metavar="URL", help="The OpenAI-compatible server, e.g. http://127.0.0.1:8000."
)
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    type=click.Path(dir_okay=False),
    help='JSONL or JSON: chat records (messages / conversations), {"prompt": text} or {"input_ids": [...]}.',
)
@click.option(
    "--suite",
    "suite_spec",
    default=None,
    metavar="NAMES",
    help="Instead of --prompts: the published tables' suites (as dflash eval --suite; NAME=PATH a local copy), "
    "each conversation's first user turn (needs dflash[datasets]).",
)
@click.option(
    "--suite-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="With --suite: read suite NAME from DIR/NAME.",
)
@click.option("--limit", type=click.IntRange(1), default=None, help="With --suite: the first N of each suite.")
@click.option(
    "--concurrency", default="1,8,32", show_default=True, metavar="C1,C2,...", help="Requests in flight, per level."
)
@click.option("--model", default=None, help="The served model name (default: the one the server lists).")
@click.option(
    "--max-new-tokens",
    "--max-new",
    "max_new_tokens",
    type=click.IntRange(1),
    default=None,
    help="New tokens per prompt at most (default: the --eval report's, else 64; 2048 with --suite).",
)
@click.option("--ignore-eos", is_flag=True, help="Decode --max-new tokens past EOS (default: as the --eval report).")
@click.option(
    "--template-kwargs",
    default=None,
    metavar="JSON",
    help="chat_template_kwargs of chat requests (default: the --eval report's), e.g. '{\"enable_thinking\": false}'.",
)
@click.option(
    "--eval",
    "eval_path",
    type=click.Path(dir_okay=False),
    metavar="REPORT.json",
    help="A `dflash eval --json` report on the same prompts: its tau is shown beside the server's.",
)
@click.option("--drafter", "drafter_path", type=click.Path(), help="Compute the offline tau here with this drafter.")
@click.option("--target", "target_path", type=click.Path(), help="With --drafter: the target (default: the run's).")
@click.option("--device", default="cpu", show_default=True, help="With --drafter: where dflash eval runs.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0), help="Requests sent before measuring.")
@click.option(
    "--timeout", default=600.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Seconds per request."
)
@click.option("--retries", default=2, show_default=True, type=click.IntRange(0), help="Retries of a 5xx/timeout.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON.")
def bench_serve(
    server: str,
    prompts_path: str | None,
    suite_spec: str | None,
    suite_dir: str | None,
    limit: int | None,
    concurrency: str,
    model: str | None,
    max_new_tokens: int | None,
    ignore_eos: bool,
    template_kwargs: str | None,
    eval_path: str | None,
    drafter_path: str | None,
    target_path: str | None,
    device: str,
    warmup: int,
    timeout: float,
    retries: int,
    json_path: str | None,
) -> None:
    """Acceptance, output tokens/s and latency of a running server (target + drafter), beside dflash eval's tau."""
    import json
    from pathlib import Path

    from dflash.data.regen import ServerError
    from dflash.serve.serve_bench import (
        Prompt,
        ServeBenchError,
        bench,
        offline_computed,
        offline_from_report,
        parse_concurrency,
        read_prompts,
        sha256_file,
        suite_prompts,
    )

    if json_path:
        outputs.check_out(json_path, what="bench serve: --json", kind="file")
    try:
        levels = parse_concurrency(concurrency)
        if eval_path and drafter_path:
            raise ServeBenchError("bench serve: give --eval REPORT or --drafter CKPT, not both")
        if target_path and not drafter_path:
            raise ServeBenchError("bench serve: --target goes with --drafter")
        if (prompts_path is None) == (suite_spec is None):
            raise ServeBenchError("bench serve: give --prompts FILE or --suite NAMES (one of them)")
        if suite_spec is None and (suite_dir is not None or limit is not None):
            raise ServeBenchError("bench serve: --suite-dir and --limit go with --suite")
        suite: tuple[list[Prompt], str] | None = None
        if suite_spec is not None:
            prompts, prompts_name, prompts_sha256 = suite_prompts(
                suites.parse_suites(suite_spec, suite_dir), limit=limit
            )
            suite = (prompts, prompts_sha256)
        else:
            assert prompts_path is not None
            prompts, prompts_name = read_prompts(prompts_path), prompts_path
            prompts_sha256 = sha256_file(Path(prompts_path))
        kwargs = None
        if template_kwargs is not None:
            try:
                kwargs = inputs.loads(template_kwargs)
            except inputs.JsonProblem as e:
                raise ServeBenchError(f"bench serve: --template-kwargs: {e}") from None
            if not isinstance(kwargs, dict):
                raise ServeBenchError("bench serve: --template-kwargs: expected a JSON object")
        offline = offline_from_report(eval_path, prompts_sha256) if eval_path else None
        if offline is not None:
            max_new_tokens = max_new_tokens or offline.max_new_tokens
            ignore_eos = ignore_eos or offline.stop_at_eos is False
            kwargs = offline.chat_template_kwargs if kwargs is None else kwargs
        max_new_tokens = max_new_tokens or (2048 if suite is not None else 64)  # the tables' figure, as eval --suite
        if drafter_path:  # before the server run: a drafter or target it cannot load is said first
            offline = offline_computed(
                drafter=drafter_path,
                target=target_path,
                prompts_path=prompts_path,
                chat=any(p.messages is not None for p in prompts),
                template_kwargs=None if kwargs is None else json.dumps(kwargs),
                max_new_tokens=max_new_tokens,
                ignore_eos=ignore_eos,
                device=device,
                suite=suite,
            )
        report = bench(
            server,
            prompts,
            levels,
            prompts_name=prompts_name,
            prompts_sha256=prompts_sha256,
            model=model,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            chat_template_kwargs=kwargs,
            offline=offline,
            warmup=warmup,
            timeout=timeout,
            retries=retries,
            log=lambda m: click.echo(m, err=True),
        )
    except ServerError as e:  # a server that fails mid-run: one line, exit 1 (bad input is ServeBenchError: exit 2)
        raise Failed(str(e)) from None
    for line in report.lines():
        click.echo(line)
    if json_path:
        outputs.write_json(json_path, report.to_json(), command="bench serve")
