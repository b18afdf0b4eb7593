"""`dflash` / `python -m dflash`: the training core's command line.

    dflash train --config configs/tiny-cpu.toml [--set drafter.block_size=8 ...]
    dflash plan --config RUN.toml [--set ...] [--gpu-memory 96GiB] [--host-memory 512GiB]
    dflash make-tiny --out .dflash/tiny [--seed 0]
    dflash prepare-data --config RUN.toml --in chats.jsonl --out STORE [--workers N] [--strict] [--max-len L]
    dflash regen --config RUN.toml --in RAW --out NEW [--backend hf|openai --server URL --concurrency N]
    dflash export CKPT OUT [--dtype bfloat16|float16|float32] [--eval eval.json] [--force] [--format zlab|speculators]
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
after it: ``dflash.train.divergence``); 4 disk full (the run's last checkpoint found no room on disk: one
line naming the checkpoint that stays: ``dflash.checkpoint.room.DiskFull``); 143 stopped by SIGTERM after writing a
checkpoint (128 + 15, so a supervisor sees a signal; 130 for SIGINT). A second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import typing as t

import click

from dflash.dtypes import ALIASES, NAMES, canonical
from dflash.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, DflashError, Failed
from dflash.serve.bench_commands import bench

# The modules above import neither torch nor transformers (nor anything the base install lacks: `pip install
# dflash` alone is the operator's dflashctl; main() names the [train] extra before any command runs). A command imports the rest inside its function:
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
    from dflash.train.lifeline import die_with_agent

    die_with_agent()  # first, before torch loads: a torchrun worker must not outlive its agent
    from dflash.config import load_config

    cfg = load_config(config_path, overrides)  # before torch too: a bad config is one line in a second, not ~6 s
    from dflash.train.plan import check_before_loading
    from dflash.train.run import run_training

    check_before_loading(cfg)  # on GPUs this machine knows: a run that cannot fit is one line, nothing loaded
    return run_training(cfg)  # the run's own exit status: 0, 1, or 128 + the signal that stopped it


@cli.command("plan")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Run config (TOML).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value (repeatable).")
@click.option(
    "--gpu-memory",
    default=None,
    metavar="SIZE",
    help="Memory of every GPU, e.g. 96GiB, 80GB, 141G (default: this machine's devices, when it has them).",
)
@click.option(
    "--host-memory",
    default=None,
    metavar="SIZE",
    help="The host's RAM, e.g. 512GiB (default: this machine's, when it has the run's GPUs; else not checked).",
)
def plan_cmd(config_path: str, overrides: tuple[str, ...], gpu_memory: str | None, host_memory: str | None) -> None:
    """Will this run fit? Memory per GPU and on the host, from the configs alone (no weights, no GPU needed)."""
    from dflash.config import load_config
    from dflash.train.plan import parse_size, run_plan

    cfg = load_config(config_path, overrides)
    gpu = None if gpu_memory is None else parse_size(gpu_memory, "--gpu-memory")
    host = None if host_memory is None else parse_size(host_memory, "--host-memory")
    source = cfg.target.path + "/config.json" if cfg.target.path else "[target.tiny]"
    run_plan(cfg, source=source, gpu=gpu, host=host, say=click.echo)


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
@click.option(
    "--tool-share",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="Share of conversations that list a tool and are answered with a tool call (default 0): "
    "`dflash eval --chat` then reports tau on tool-call prompts.",
)
def make_tiny_cmd(
    out: str,
    seed: int,
    force: bool,
    target_steps: int | None,
    samples: int | None,
    eval_prompts: int | None,
    tool_share: float | None,
) -> None:
    """A tiny target that learned a synthetic language, and training data it wrote itself (greedy)."""
    from dflash.data.tiny import TinySpec, load_manifest, make_tiny

    spec = TinySpec(seed=seed)
    changes: dict[str, t.Any] = {
        k: v
        for k, v in (
            ("target_steps", target_steps),
            ("train_samples", samples),
            ("eval_prompts", eval_prompts),
            ("tool_share", tool_share),
        )
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
def prepare_data_cmd(**options: t.Any) -> None:
    """Render a chat corpus with the target's chat template into a memory-mapped token store."""
    from dflash.data.store import PrepareRequest, run_prepare

    run_prepare(PrepareRequest(**options), say=click.echo, note=lambda line: click.echo(line, err=True))


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
def regen_cmd(**options: t.Any) -> None:
    """The target rewrites every assistant turn (temperature 0, the serving chat template and kwargs)."""
    from dflash.data.regen_command import RegenRequest, run_regen

    run_regen(RegenRequest(**options), say=click.echo, note=lambda line: click.echo(line, err=True))


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
def eval_cmd(**options: t.Any) -> None:
    """Exact speculative decoding on held-out prompts or the published suites: tau, acceptance,
    target-equivalence."""
    from dflash.eval.command import BadOption, EvalRequest, run_eval

    try:
        run_eval(EvalRequest(**options), say=click.echo, note=lambda line: click.echo(line, err=True))
    except BadOption as e:
        raise click.BadParameter(e.message, param_hint=e.option) from None


@cli.command("export")
@click.argument("source", metavar="CKPT", type=click.Path())
@click.argument("out", metavar="OUT", type=click.Path())
@click.option(
    "--dtype",
    type=click.Choice([*NAMES, *ALIASES]),
    default="bfloat16",
    show_default=True,
    help="Weights dtype of the exported model (bf16, fp16, fp32: the same, short).",
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
    from dflash.serve.export import export

    dtype = canonical(dtype) or dtype
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


TRAINING_CORE = ("torch", "transformers", "safetensors", "accelerate")  # the [train] extra's modules
TRAIN_EXTRA = "pip install 'dflash[train]'"


def require_training_core() -> None:
    """Every command needs the [train] extra: without it one line naming it (found without importing torch)."""
    import importlib.util

    missing = [name for name in TRAINING_CORE if importlib.util.find_spec(name) is None]
    if missing:
        raise Failed(f"dflash: the training core is not installed (no {', '.join(missing)}): {TRAIN_EXTRA}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; maps errors to the exit codes above (the only place that does: ``dflash.errors``)."""
    try:
        require_training_core()
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


def entry() -> t.NoReturn:
    """The console script and ``python -m dflash``: :func:`main`'s code, through Python's own exit (threads
    joined, atexit callbacks, the streams flushed, a failed flush reported)."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
