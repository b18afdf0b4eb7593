"""`dflash` / `python -m dflash`: the training core's command line.

    dflash train --config configs/tiny-cpu.toml [--set drafter.block_size=8 ...]
    dflash bench pipeline --targets 5 --drafters 3 --target-ms 80 --drafter-ms 60 --queue shared

Exit codes of ``train``: 0 finished (final checkpoint written); 1 the run failed (a traceback on stderr:
a worker error that left no drafter or no target, an injected fault, a checkpoint that could not be
written); 2 bad config or arguments (one line naming the key); 143 stopped by SIGTERM after writing a
checkpoint (128 + 15, so a supervisor sees a signal; 130 for SIGINT). A second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import logging
import sys
import typing as t

import click

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


def init_logging(verbosity: int = 0) -> None:
    """One stderr handler for the whole process (libraries only log)."""
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output.")
@click.option("-q", "--quiet", count=True, help="Less log output.")
def cli(verbose: int, quiet: int) -> None:
    """Train DFlash drafters (the training core)."""
    init_logging(verbose - quiet)


@cli.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Run config (TOML).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set drafter.block_size=8 (repeatable).")
def train(config_path: str, overrides: tuple[str, ...]) -> None:
    """Train a drafter: target threads -> one shared queue -> drafter threads."""
    from dflash.config import load_config
    from dflash.train import run_training

    cfg = load_config(config_path, overrides)
    raise SystemExit(run_training(cfg))


@cli.group()
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
            raise click.BadParameter(f'expected INDEX:FACTOR such as "2:1.5", got "{v}"', param_hint="--drafter-slowdown") from None
    return out


@bench.command("pipeline")
@click.option("--targets", default=5, show_default=True, type=click.IntRange(1), help="Target threads.")
@click.option("--drafters", default=3, show_default=True, type=click.IntRange(1), help="Drafter threads.")
@click.option("--target-ms", default=80.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Target cost per batch.")
@click.option("--drafter-ms", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Drafter cost per batch.")
@click.option("--drafter-slowdown", multiple=True, metavar="I:FACTOR", help="Make drafter I slower, e.g. 0:1.5 (repeatable).")
@click.option("--queue", "mode", default="shared", show_default=True, type=click.Choice(["shared", "per-drafter"]))
@click.option("--capacity", default=64, show_default=True, type=click.IntRange(1), help="Queue capacity (batches).")
@click.option("--steps", default=1500, show_default=True, type=click.IntRange(10), help="Global steps to run.")
@click.option("--tokens-per-batch", default=4096, show_default=True, type=click.IntRange(1))
@click.option("--payload-mb", default=1.0, show_default=True, type=click.FloatRange(0), help="Tensor bytes per queue item.")
@click.option("--kill-drafter-at", default=None, type=click.IntRange(1), help="Kill a drafter (CUDA OOM, retried once) at this step.")
@click.option("--kill-drafter", default=0, show_default=True, type=click.IntRange(0), help="Which drafter --kill-drafter-at kills.")
@click.option("--average-every", default=0, show_default=True, type=click.IntRange(0), help="Barrier + averaging every N steps (0: off).")
@click.option("--average-ms", default=0.0, show_default=True, type=click.FloatRange(0), help="Simulated averaging cost.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Also write the result as JSON.")
def bench_pipeline(targets: int, drafters: int, target_ms: float, drafter_ms: float, drafter_slowdown: tuple[str, ...],
                   mode: str, capacity: int, steps: int, tokens_per_batch: int, payload_mb: float,
                   kill_drafter_at: int | None, kill_drafter: int, average_every: int, average_ms: float,
                   json_path: str | None) -> None:
    """The real pipeline with simulated workers: Ktok/s against min(target supply, drafter demand)."""
    from dflash.simulate import BenchSpec, dump_json, format_result, run_bench

    slow = _slowdowns(drafter_slowdown)
    for j in slow:
        if j >= drafters:
            raise click.BadParameter(f"drafter {j} does not exist (there are {drafters})", param_hint="--drafter-slowdown")
    if kill_drafter >= drafters:
        raise click.BadParameter(f"drafter {kill_drafter} does not exist (there are {drafters})", param_hint="--kill-drafter")
    if kill_drafter_at is not None and kill_drafter_at >= steps:
        raise click.BadParameter(f"must be below --steps ({steps})", param_hint="--kill-drafter-at")
    if mode == "per-drafter" and capacity < drafters:
        raise click.BadParameter(f"per-drafter queues need at least one slot each ({drafters})", param_hint="--capacity")
    spec = BenchSpec(targets=targets, drafters=drafters, target_ms=target_ms, drafter_ms=drafter_ms, slowdowns=slow,
                     mode=mode, capacity=capacity, steps=steps, tokens_per_batch=tokens_per_batch,
                     payload_mb=payload_mb, kill_drafter_at=kill_drafter_at, kill_drafter=kill_drafter,
                     average_every=average_every, average_ms=average_ms)
    quiet = logging.getLogger("dflash.pipeline")  # the injected kill's traceback is expected
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        res = run_bench(spec)
    finally:
        quiet.setLevel(level)
    click.echo(format_result(res))
    if json_path:
        with open(json_path, "w") as f:
            f.write(dump_json(res) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point; maps errors to the exit codes above (the only place that does)."""
    from dflash.config import ConfigError
    from dflash.data import DataError

    try:
        cli.main(args=argv, prog_name="dflash", standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_FAILED
    except click.exceptions.Abort:
        click.echo("dflash: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return EXIT_CONFIG
    except (ConfigError, DataError) as e:  # bad input, found before training starts; the message names the key
        click.echo(f"dflash: {e}", err=True)
        return EXIT_CONFIG
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
