"""`dflash` / `python -m dflash`: the training core's command line.

    dflash train --config configs/tiny-cpu.toml [--set drafter.block_size=8 ...]
    dflash make-tiny --out .dflash/tiny [--seed 0]
    dflash prepare-data --config RUN.toml --in chats.jsonl --out STORE [--workers N] [--strict] [--max-len L]
    dflash regen --config RUN.toml --in RAW --out NEW [--backend hf|openai --server URL --concurrency N]
    dflash export CKPT OUT [--dtype bf16|fp16|fp32] [--eval eval.json] [--force] [--format zlab|speculators]
    dflash eval --drafter .dflash/runs/dflash/checkpoints [--untrained] [--json eval.json]
                [--prompts FILE [--chat [--template-kwargs JSON]]] [--max-new N] [--ignore-eos]
                [--plot eval.png [--compare eval-before.json]]
                [--suite gsm8k,mt-bench,NAME=PATH [--suite-dir DIR]] [--temperature T --seed S] [--count zlab]
    dflash bench pipeline --targets 5 --drafters 3 --target-ms 80 --drafter-ms 60 --queue shared
    dflash bench serve --server URL --prompts FILE [--concurrency 1,8,32] [--eval eval.json] [--json bench.json]
    dflash bench serve --server URL --suite gsm8k,humaneval [--suite-dir DIR] [--limit N] [--drafter CKPT]

Exit codes of ``train``: 0 finished (final checkpoint written); 1 the run failed (a traceback on stderr:
a worker error that left no drafter or no target, an injected fault, a checkpoint that could not be
written); 2 bad config or arguments (one line naming the key); 3 diverged (a non-finite loss, gradient norm
or weights: one line naming the step, the figure and the last finite checkpoint; no checkpoint written
after it: ``dflash.divergence``); 143 stopped by SIGTERM after writing a
checkpoint (128 + 15, so a supervisor sees a signal; 130 for SIGINT). A second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import typing as t
from pathlib import Path

import click

from dflash import eval_plot, inputs, model_config, outputs, suites
from dflash.bench_commands import bench
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
    from dflash.lifeline import die_with_agent

    die_with_agent()  # first, before torch loads: a torchrun worker must not outlive its agent
    from dflash.config import load_config
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
    vocab_size: int | None = None
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
        if tokenizer_path is None:  # pre-tokenized ids are checked against the target's vocabulary instead
            vocab_size = _target_vocab(cfg)
    elif template_kwargs is not None:
        try:
            kwargs = inputs.loads(template_kwargs)
        except inputs.JsonProblem as e:
            fail(f"prepare-data: --template-kwargs: {e}")
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
        vocab_size=vocab_size,
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


def _target_vocab(cfg: t.Any) -> int | None:
    """The vocabulary of the run's target without loading it: target.tiny, else its config.json (None: no
    config.json there; one that is no model's is one line, never a vocabulary left unchecked)."""
    if cfg.target.tiny is not None:
        return int(cfg.target.tiny.vocab_size)
    if not (Path(cfg.target.path).expanduser() / model_config.CONFIG_FILE).exists():
        return None
    try:
        return model_config.read_vocab_size(cfg.target.path, "target.path")
    except (inputs.InputFileError, inputs.RecordError) as e:
        raise BadInput(f"prepare-data: target.path: {e}") from None


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
    help="A checkpoint dir, or a folder of step-* checkpoints (checkpoints/best when training chose one, else the latest).",
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
    "--suite",
    "suite_spec",
    default=None,
    metavar="NAMES",
    help="The published tables' suites, comma-separated (gsm8k, math500, aime24, aime25, humaneval, mbpp, "
    "livecodebench, swe-bench, mt-bench, alpaca, lbpp), from the hub, or NAME=PATH a local folder or file "
    "(needs dflash[datasets]); z-lab's wording and samples; docs/evaluation.md.",
)
@click.option(
    "--suite-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="With --suite: read suite NAME from DIR/NAME (a save_to_disk folder or a hub snapshot).",
)
@click.option(
    "--max-new-tokens",
    "--max-new",
    "max_new_tokens",
    default=None,
    type=int,
    help="New tokens per prompt at most (1..2048; default 64, with --suite 2048); decoding stops at EOS before.",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, max_open=False),
    help="0: greedy. T > 0: the target's tokens sampled at T (seeded), drafts greedy, as z-lab's T=1 rows.",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0), help="With --temperature > 0.")
@click.option(
    "--count",
    type=click.Choice(["dflash", "zlab"]),
    default="dflash",
    show_default=True,
    help="How tau counts steps: dflash (tokens in the output per target forward) or zlab (z-lab's "
    "dflash_generate: full blocks past the budget and EOS counted; what its tables print).",
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
    suite_spec: str | None,
    suite_dir: str | None,
    max_new_tokens: int | None,
    temperature: float,
    seed: int,
    count: str,
    ignore_eos: bool,
    limit: int | None,
    ddtree_budget: int,
    device: str,
    json_path: str | None,
    strict: bool,
    plot_path: str | None,
    compare_path: str | None,
) -> None:
    """Exact speculative decoding on held-out prompts or the published suites: tau, acceptance,
    target-equivalence."""
    from dflash.evaluate import check_max_new

    if max_new_tokens is None:
        max_new_tokens = 2048 if suite_spec else 64
    check_max_new(max_new_tokens)  # said before loading anything
    specs = None
    if suite_spec is not None:  # said before loading anything
        if plot_path:
            raise suites.SuiteError("--plot draws one report: give --prompts, not --suite")
        specs = suites.parse_suites(suite_spec, suite_dir)
    elif suite_dir is not None:
        raise suites.SuiteError("--suite-dir goes with --suite")
    before = None
    if compare_path and not plot_path:
        raise click.BadParameter("needs --plot FILE", param_hint="--compare")
    if json_path:  # said before the (long) eval, not after it
        outputs.check_out(json_path, what="eval: --json", kind="file")
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
        suite=specs is not None,
        log=lambda line: click.echo(line, err=True),  # which checkpoint a folder meant (checkpoints/best)
    )
    decoding: dict[str, t.Any] = {"temperature": temperature, "seed": seed, "count": count}
    if specs is not None:
        from dflash.suite_report import run_suites

        suite_report = run_suites(
            s,
            specs,
            max_new_tokens=max_new_tokens,
            limit=limit,
            ddtree_budget=ddtree_budget or None,
            log=lambda line: click.echo(line, err=True),
            **decoding,
        )
        for line in suite_report.lines():
            click.echo(line)
        if json_path:
            with open(json_path, "w") as f:
                f.write(json.dumps(suite_report.to_json(), indent=1) + "\n")
        if strict and not suite_report.all_equal:
            raise Failed()  # the report above says which outputs differ
        return
    if before is not None:  # said before the (long) eval, not after it
        warning = eval_plot.protocol_warning(before, s.protocol(max_new_tokens, **decoding), compare_path or "")
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
        **decoding,
    )
    for line in report.lines():
        click.echo(line)
    if json_path:  # the report is on stdout already: a failure here loses nothing
        outputs.write_json(json_path, report.to_json(), command="eval")
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

    path = export(
        source,
        out,
        dtype=dtype,
        eval_report=eval_path,
        force=force,
        fmt=fmt,
        verifier=verifier,
        log=lambda line: click.echo(f"export: {line}", err=True),  # which checkpoint a folder meant
    )
    if fmt == "speculators":
        click.echo(f"exported {dtype} drafter to {path} in the speculators layout (vllm serve {path}; README.md)")
    else:
        click.echo(
            f"exported {dtype} drafter to {path} (AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True))"
        )


cli.add_command(bench)


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
