"""`dflash` / `python -m dflash`: the training core's command line.

    dflash train --config configs/tiny-cpu.toml [--set drafter.block_size=8 ...]
    dflash make-tiny --out .dflash/tiny [--seed 0]
    dflash prepare-data --config RUN.toml --in chats.jsonl --out STORE [--workers N] [--strict] [--max-len L]
    dflash regen --config RUN.toml --in RAW --out NEW [--backend hf|openai --server URL --concurrency N]
    dflash export CKPT OUT [--dtype bf16|fp16|fp32] [--eval eval.json] [--force] [--format zlab|speculators]
    dflash eval --drafter .dflash/runs/dflash/checkpoints [--untrained] [--json eval.json]
                [--prompts FILE [--chat [--template-kwargs JSON]]] [--max-new N] [--ignore-eos]
                [--plot eval.png [--compare eval-before.json]]
    dflash bench pipeline --targets 5 --drafters 3 --target-ms 80 --drafter-ms 60 --queue shared
    dflash bench serve --server URL --prompts FILE [--concurrency 1,8,32] [--eval eval.json] [--json bench.json]

Exit codes of ``train``: 0 finished (final checkpoint written); 1 the run failed (a traceback on stderr:
a worker error that left no drafter or no target, an injected fault, a checkpoint that could not be
written); 2 bad config or arguments (one line naming the key); 143 stopped by SIGTERM after writing a
checkpoint (128 + 15, so a supervisor sees a signal; 130 for SIGINT). A second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import typing as t

import click

from dflash import eval_plot
from dflash.chat import Renderer, load_tokenizer
from dflash.config import ConfigError, load_config
from dflash.corpus import drop_lines
from dflash.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, BadInput, DataError, DflashError, Failed

# The modules above import neither torch nor transformers. A command imports the rest inside its function:
# they pull in torch and transformers (seconds), which `--help`, a usage error or another command need not pay.


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
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config value, e.g. --set drafter.block_size=8 (repeatable).",
)
def train(config_path: str, overrides: tuple[str, ...]) -> int:
    """Train a drafter: target threads -> one shared queue -> drafter threads."""
    from dflash.train import run_training

    cfg = load_config(config_path, overrides)
    return run_training(cfg)  # the run's own exit status: 0, 1, or 128 + the signal that stopped it


@cli.command("make-tiny")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Output folder (the demo uses <workdir>/tiny)."
)
@click.option("--seed", default=0, show_default=True, type=int, help="Same seed, same bytes.")
@click.option("--force", is_flag=True, help="Build again even when a complete output of the same spec is there.")
@click.option(
    "--target-steps", type=click.IntRange(0), default=None, help="Training steps of the tiny target (default 300)."
)
@click.option(
    "--samples", type=click.IntRange(1), default=None, help="Training samples the target writes (default 1024)."
)
@click.option("--eval-prompts", type=click.IntRange(1), default=None, help="Held-out prompts (default 32).")
def make_tiny_cmd(
    out: str, seed: int, force: bool, target_steps: int | None, samples: int | None, eval_prompts: int | None
) -> None:
    """A tiny target that learned a synthetic language, and training data it wrote itself (greedy)."""
    from dflash.tiny import TinySpec, load_manifest, make_tiny

    spec = TinySpec(seed=seed)
    changes = {
        k: v
        for k, v in (("target_steps", target_steps), ("train_samples", samples), ("eval_prompts", eval_prompts))
        if v is not None
    }
    spec = dataclasses.replace(spec, **changes)
    t0 = time.monotonic()
    path, built = make_tiny(out, spec, force=force, log=lambda m: click.echo(f"make-tiny: {m}"))
    if not built:
        click.echo(f"make-tiny: {path} is already there (seed {seed}); --force builds it again")
        return
    m = load_manifest(path) or {}
    click.echo(
        f"make-tiny: wrote {path} in {time.monotonic() - t0:.0f}s: target/ (loss {m.get('target_loss')}), "
        f"train.jsonl ({m.get('train_samples')} answers), eval.jsonl ({m.get('eval_prompts')} held-out prompts); "
        f"MASK id {m.get('mask_token_id')}"
    )


@cli.command("prepare-data")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Run config: its target's tokenizer (or data.tokenizer), data.chat_template_kwargs and data.max_length.",
)
@click.option("--tokenizer", "tokenizer_path", type=click.Path(), help="A tokenizer folder, instead of --config.")
@click.option(
    "--template-kwargs",
    "template_kwargs",
    default=None,
    metavar="JSON",
    help="With --tokenizer: chat template kwargs, e.g. '{\"enable_thinking\": false}'.",
)
@click.option(
    "--in",
    "src",
    required=True,
    type=click.Path(),
    help="JSONL, a JSON array, parquet or a datasets save_to_disk folder: messages, conversations or input_ids.",
)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="The store folder to write.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1), help="Worker processes.")
@click.option("--strict", is_flag=True, help="Any dropped record is an error (exit 2).")
@click.option(
    "--max-len",
    type=click.IntRange(2),
    default=None,
    help="Cut sequences to L tokens (default: data.max_length, else 3072).",
)
@click.option(
    "--shard-lines", default=10_000, show_default=True, type=click.IntRange(1), help="Lines per resumable shard."
)
def prepare_data_cmd(
    config_path: str | None,
    tokenizer_path: str | None,
    template_kwargs: str | None,
    src: str,
    out: str,
    workers: int,
    strict: bool,
    max_len: int | None,
    shard_lines: int,
) -> None:
    """Render a chat corpus with the target's chat template into a memory-mapped token store."""
    from dflash.store import PrepareSpec, StoreError, prepare

    def fail(msg: str) -> t.NoReturn:
        raise BadInput(msg)

    if (config_path is None) == (tokenizer_path is None):
        fail("prepare-data: give exactly one of --config RUN.toml or --tokenizer PATH")
    kwargs: dict[str, t.Any] = {}
    if config_path is not None:
        if template_kwargs is not None:
            fail("prepare-data: --template-kwargs goes with --tokenizer; with --config set data.chat_template_kwargs")
        try:
            cfg = load_config(config_path, ())
        except ConfigError as e:
            fail(f"prepare-data: {e}")
        kwargs = dict(cfg.data.chat_template_kwargs)
        max_len = max_len or cfg.data.max_length
        tokenizer_path = cfg.data.tokenizer or cfg.target.path
        if tokenizer_path is not None and cfg.data.tokenizer is None:
            try:  # a target folder without a tokenizer still prepares pre-tokenized data
                load_tokenizer(tokenizer_path)
            except DataError:
                tokenizer_path = None
    elif template_kwargs is not None:
        try:
            kwargs = json.loads(template_kwargs)
        except json.JSONDecodeError as e:
            fail(f"prepare-data: --template-kwargs: not valid JSON: {e}")
        if not isinstance(kwargs, dict):
            fail("prepare-data: --template-kwargs: expected a JSON object")
    spec = PrepareSpec(
        src=src,
        out=out,
        tokenizer_path=tokenizer_path,
        kwargs=kwargs,
        max_len=max_len or 3072,
        workers=workers,
        strict=strict,
        shard_lines=shard_lines,
    )
    try:
        meta = prepare(spec, log=lambda m: click.echo(m, err=True))
    except (StoreError, DataError) as e:
        fail(str(e))
    c = meta["counts"]
    secs = meta["seconds"]
    sup = 100.0 * c["supervised"] / max(c["tokens"], 1)
    click.echo(
        f"prepare-data: {c['records']} records -> {c['sequences']} sequences, {c['tokens']} tokens "
        f"({sup:.0f}% supervised) in {secs:.1f}s ({c['records'] / max(secs, 1e-9):.0f} records/s, "
        f"{workers} worker{'s' if workers > 1 else ''}); wrote {out}"
    )
    if c["cut"]:
        click.echo(f"prepare-data: {c['cut']} sequences cut to {spec.max_len} tokens")
    if c["dropped_turns"]:
        click.echo(f"prepare-data: {c['dropped_turns']} assistant turns not rendered as serving shows them (left out)")
    for line in drop_lines("prepare-data", meta["drops"]):
        click.echo(line)


@cli.command("regen")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Run config: its target, data.chat_template_kwargs, data.max_length, devices.targets.",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value (repeatable).")
@click.option(
    "--in",
    "src",
    required=True,
    type=click.Path(),
    help="JSONL, a JSON array, parquet or a datasets save_to_disk folder: messages or conversations.",
)
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False), help="The JSONL to write (OpenAI messages)."
)
@click.option(
    "--backend",
    type=click.Choice(["hf", "openai"]),
    default="hf",
    show_default=True,
    help="hf: the target in this process; openai: an OpenAI-compatible server (--server).",
)
@click.option(
    "--server", default=None, metavar="URL", help="openai: the server, e.g. http://127.0.0.1:8000 (/v1 optional)."
)
@click.option("--model", default=None, help="openai: the served model name (default: the one the server lists).")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(1), help="openai: requests in flight.")
@click.option(
    "--timeout",
    default=600.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="openai: seconds per request.",
)
@click.option(
    "--retries",
    default=6,
    show_default=True,
    type=click.IntRange(0),
    help="openai: retries of a 5xx/timeout (backoff 1, 2, 4 .. 30 s).",
)
@click.option(
    "--batch-size", default=8, show_default=True, type=click.IntRange(1), help="hf: prompts per generate call."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=None,
    help="Tokens per answer at most (default: data.max_length; also at most max_length minus the prompt).",
)
@click.option(
    "--shard-lines", default=1000, show_default=True, type=click.IntRange(1), help="Lines per resumable shard."
)
@click.option(
    "--log-every",
    default=1000,
    show_default=True,
    type=click.IntRange(1),
    help="Not a TTY: a progress line every N conversations.",
)
def regen_cmd(
    config_path: str,
    overrides: tuple[str, ...],
    src: str,
    out: str,
    backend: str,
    server: str | None,
    model: str | None,
    concurrency: int,
    timeout: float,
    retries: int,
    batch_size: int,
    max_new_tokens: int | None,
    shard_lines: int,
    log_every: int,
) -> None:
    """The target rewrites every assistant turn (temperature 0, the serving chat template and kwargs)."""
    from dflash.regen import OpenAIGenerator, RegenError, RegenSpec, ServerError, check_io, load_hf, regen

    def fail(msg: str) -> t.NoReturn:
        raise BadInput(msg)

    if backend == "openai" and not server:
        fail("regen: --backend openai needs --server URL")
    if backend == "hf" and server:
        fail("regen: --server goes with --backend openai")
    cfg = load_config(config_path, overrides)
    kwargs = dict(cfg.data.chat_template_kwargs)
    tok_path = cfg.data.tokenizer or cfg.target.path
    renderer = None
    try:
        if tok_path is None:
            raise DataError("no data.tokenizer and no target.path")
        tok = load_tokenizer(tok_path)
        if not getattr(tok, "chat_template", None):
            raise DataError(f"the tokenizer in {tok_path} has no chat template")
        renderer = Renderer(tok, kwargs)
    except DataError as e:
        if backend == "hf":
            fail(f"regen: the hf backend renders prompts with the target's tokenizer and chat template: {e}")
        click.echo(f"regen: no local tokenizer ({e}): answers bounded by --max-new-tokens only", err=True)
    spec = RegenSpec(
        src=src,
        out=out,
        kwargs=kwargs,
        max_new_tokens=max_new_tokens or cfg.data.max_length,
        max_len=cfg.data.max_length if renderer is not None else None,
        shard_lines=shard_lines,
        log_every=log_every,
    )
    gens: list[t.Any] = []
    try:
        check_io(spec)
        if backend == "hf":
            from transformers.utils import logging as hf_logging  # the hf backend only: seconds to import

            hf_logging.disable_progress_bar()
            assert renderer is not None
            gens = list(load_hf(cfg, renderer.tokenizer, batch_size=batch_size))
        else:
            assert server is not None
            gens = [
                OpenAIGenerator(
                    server, model=model, kwargs=kwargs, concurrency=concurrency, timeout=timeout, retries=retries
                )
            ]
        summary = regen(spec, gens, renderer, log=lambda m: click.echo(m, err=True))
    except RegenError as e:
        fail(str(e))
    except ServerError as e:
        raise Failed(f"{e} (finished shards are kept: run again to go on)") from None
    finally:
        for g in gens:
            if hasattr(g, "close"):
                g.close()
    c = summary["counts"]
    secs = summary["seconds"]
    click.echo(
        f"regen: {c['records']} records -> {c['written']} written, {c['turns']} assistant turns "
        f"regenerated in {secs:.1f}s ({summary['done_now'] / max(secs, 1e-9):.2f} conv/s, {backend}); wrote {out}"
    )
    if c["cut_answers"]:
        click.echo(
            f"regen: {c['cut_answers']} answers stopped at the token limit ({spec.max_new_tokens}, or "
            f"max_length {spec.max_len} minus the prompt)"
        )
    if c["cut_conversations"]:
        click.echo(
            f"regen: {c['cut_conversations']} conversations end before a turn whose prompt fills "
            f"max_length ({spec.max_len} tokens)"
        )
    for line in drop_lines("regen", summary["drops"]):
        click.echo(line)


@cli.command("eval")
@click.option(
    "--drafter",
    "drafter_path",
    type=click.Path(),
    help="A checkpoint dir, or a folder of step-* checkpoints (the latest).",
)
@click.option(
    "--untrained", is_flag=True, help="Measure the drafter the run started from (step 0: same config and seed)."
)
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="Run config (with --untrained and no --drafter)."
)
@click.option(
    "--target", "target_path", type=click.Path(), help="Target checkpoint (default: the one the run trained against)."
)
@click.option(
    "--prompts",
    "prompts_path",
    type=click.Path(dir_okay=False),
    help="JSONL or JSON: input_ids, or chat records (messages / conversations; with --chat) whose turns "
    "before the first assistant turn are the prompt (default: eval.jsonl next to the training data).",
)
@click.option("--chat", is_flag=True, help="Render chat prompts with the target's chat template, as serving does.")
@click.option(
    "--template-kwargs",
    "template_kwargs",
    default=None,
    metavar="JSON",
    help="With --chat: chat template kwargs (default: data.chat_template_kwargs), e.g. '{\"enable_thinking\": false}'.",
)
@click.option(
    "--max-new-tokens",
    "--max-new",
    "max_new_tokens",
    default=64,
    show_default=True,
    type=int,
    help="New tokens per prompt at most (1..2048); decoding stops at EOS before.",
)
@click.option("--ignore-eos", is_flag=True, help="Decode exactly --max-new tokens, past EOS.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Only the first N prompts.")
@click.option(
    "--ddtree-budget",
    default=32,
    show_default=True,
    type=click.IntRange(0),
    help="Nodes of the offline DDTree tree (0: skip).",
)
@click.option("--device", default="cpu", show_default=True, help='"cpu" or "cuda:<index>".')
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON.")
@click.option("--strict", is_flag=True, help="Exit 1 when an output differs from plain greedy decoding.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Draw acceptance by position and the accepted-drafts histogram (.png or .svg; needs dflash[plot]).",
)
@click.option(
    "--compare",
    "compare_path",
    type=click.Path(dir_okay=False),
    metavar="REPORT.json",
    help="With --plot: an earlier report (--json) drawn side by side, as before / after.",
)
def eval_cmd(
    drafter_path: str | None,
    untrained: bool,
    config_path: str | None,
    target_path: str | None,
    prompts_path: str | None,
    chat: bool,
    template_kwargs: str | None,
    max_new_tokens: int,
    ignore_eos: bool,
    limit: int | None,
    ddtree_budget: int,
    device: str,
    json_path: str | None,
    strict: bool,
    plot_path: str | None,
    compare_path: str | None,
) -> None:
    """Exact greedy speculative decoding on held-out prompts: tau, acceptance, target-equivalence."""
    from dflash.evaluate import check_max_new

    check_max_new(max_new_tokens)  # said before loading anything
    before = None
    if compare_path and not plot_path:
        raise click.BadParameter("needs --plot FILE", param_hint="--compare")
    if plot_path:  # said before the (long) eval, not after it
        eval_plot.check_out(plot_path)
        eval_plot.require_matplotlib()
        before = eval_plot.load_report(compare_path) if compare_path else None

    import torch
    from transformers.utils import logging as hf_logging

    from dflash.evaluate import evaluate, load_setup

    hf_logging.disable_progress_bar()  # "Loading weights" bars are noise in a report

    if device != "cpu" and not torch.cuda.is_available():
        raise click.BadParameter(f"{device} asked for, but this torch has no CUDA device", param_hint="--device")
    s = load_setup(
        drafter=drafter_path,
        untrained=untrained,
        config=config_path,
        target=target_path,
        prompts=prompts_path,
        device=device,
        limit=limit,
        chat=chat,
        template_kwargs=template_kwargs,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
    )
    if before is not None:  # said before the (long) eval, not after it
        warning = eval_plot.protocol_warning(before, s.protocol(max_new_tokens), compare_path or "")
        if warning:
            click.echo(warning, err=True)
    report = evaluate(
        s.target,
        s.drafter,
        s.prompts,
        max_new_tokens=max_new_tokens,
        drafter_name=s.drafter_name,
        untrained=s.untrained,
        step=s.step,
        target_name=s.target_name,
        prompts_name=s.prompts_name,
        ddtree_budget=ddtree_budget or None,
        stop_token_ids=s.stop_token_ids,
        protocol=s.prompt_protocol,
    )
    for line in report.lines():
        click.echo(line)
    if json_path:
        with open(json_path, "w") as f:
            f.write(json.dumps(report.to_json(), indent=1) + "\n")
    if plot_path:
        eval_plot.draw(plot_path, [before, report.to_json()] if before else [report.to_json()])
        click.echo(f"plot: {plot_path}")
    if strict and not report.all_equal:
        raise Failed()  # the report above says which outputs differ


@cli.command("export")
@click.argument("source", metavar="CKPT", type=click.Path())
@click.argument("out", metavar="OUT", type=click.Path())
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default="bf16",
    show_default=True,
    help="Weights dtype of the exported model.",
)
@click.option(
    "--eval",
    "eval_path",
    type=click.Path(dir_okay=False),
    metavar="REPORT.json",
    help="A `dflash eval --json` report: its tau goes into the model card.",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["zlab", "speculators"]),
    default="zlab",
    show_default=True,
    help="zlab: what vLLM, SGLang and transformers read; speculators: vllm-project/speculators' layout "
    "(`vllm serve OUT` alone starts target and drafter).",
)
@click.option(
    "--verifier",
    default=None,
    metavar="TARGET",
    help="With --format speculators: the target the config names (default: the run's target folder).",
)
def export_cmd(
    source: str, out: str, dtype: str, eval_path: str | None, force: bool, fmt: str, verifier: str | None
) -> None:
    """A serving folder from a checkpoint: config.json, model.safetensors, dflash.py (AutoModel remote code), README.md."""
    from dflash.export import export

    path = export(source, out, dtype=dtype, eval_report=eval_path, force=force, fmt=fmt, verifier=verifier)
    if fmt == "speculators":
        click.echo(f"exported {dtype} drafter to {path} in the speculators layout (vllm serve {path}; README.md)")
    else:
        click.echo(
            f"exported {dtype} drafter to {path} (AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True))"
        )


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
    from dflash.simulate import BenchSpec, dump_json, format_result, run_bench

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
        with open(json_path, "w") as f:
            f.write(dump_json(res) + "\n")


@bench.command("serve")
@click.option(
    "--server", required=True, metavar="URL", help="The OpenAI-compatible server, e.g. http://127.0.0.1:8000."
)
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(dir_okay=False),
    help='JSONL or JSON: chat records (messages / conversations), {"prompt": text} or {"input_ids": [...]}.',
)
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
    help="New tokens per prompt at most (default: the --eval report's, else 64).",
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
    prompts_path: str,
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

    from dflash.regen import ServerError
    from dflash.serve_bench import (
        ServeBenchError,
        bench,
        offline_computed,
        offline_from_report,
        parse_concurrency,
        read_prompts,
        sha256_file,
    )

    try:
        levels = parse_concurrency(concurrency)
        if eval_path and drafter_path:
            raise ServeBenchError("bench serve: give --eval REPORT or --drafter CKPT, not both")
        if target_path and not drafter_path:
            raise ServeBenchError("bench serve: --target goes with --drafter")
        # TODO(lead, at merge): `--suite NAME` gives its prompts here (bench() takes any list of Prompt)
        prompts = read_prompts(prompts_path)
        kwargs = None
        if template_kwargs is not None:
            try:
                kwargs = json.loads(template_kwargs)
            except ValueError as e:
                raise ServeBenchError(f"bench serve: --template-kwargs: not valid JSON: {e}") from None
            if not isinstance(kwargs, dict):
                raise ServeBenchError("bench serve: --template-kwargs: expected a JSON object")
        offline = offline_from_report(eval_path, prompts_path) if eval_path else None
        if offline is not None:
            max_new_tokens = max_new_tokens or offline.max_new_tokens
            ignore_eos = ignore_eos or offline.stop_at_eos is False
            kwargs = offline.chat_template_kwargs if kwargs is None else kwargs
        max_new_tokens = max_new_tokens or 64
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
            )
        report = bench(
            server,
            prompts,
            levels,
            prompts_name=prompts_path,
            prompts_sha256=sha256_file(Path(prompts_path)),
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
        with open(json_path, "w") as f:
            f.write(json.dumps(report.to_json(), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point; maps errors to the exit codes above (the only place that does: ``dflash.errors``)."""
    try:
        # a command's return value, or the code of a click ``Exit`` (``--help``: 0)
        rv = cli.main(args=argv, prog_name="dflash", standalone_mode=False)
    except SystemExit as e:  # sys.exit() deep in a library
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_FAILED
    except click.exceptions.Abort:
        click.echo("dflash: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return EXIT_CONFIG
    except DflashError as e:
        if e.traceback:  # a run's failure: its traceback is what train.log and the crash report keep
            raise
        text = e.line()  # a user's mistake (exit 2) or a failure the message names (exit 1); one line
        if text:
            click.echo(text, err=True)
        return e.exit_code
    return rv if type(rv) is int else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
