"""`dflash regen`'s command: its options -> the target's generators -> ``dflash.data.regen.regen`` -> the summary
lines. The job itself (shards, resume, the backends) is ``dflash.data.regen``; docs/training.md."""

from __future__ import annotations

import dataclasses
import typing as t

from dflash.data.chat import Renderer
from dflash.data.regen import OpenAIGenerator, RegenError, RegenSpec, ServerError, check_io, regen
from dflash.data.regen_hf import load_hf
from dflash.errors import Failed


@dataclasses.dataclass(frozen=True)
class RegenRequest:
    """What `dflash regen` was asked, one field per option (docs/training.md)."""

    config_path: str
    src: str
    out: str
    overrides: tuple[str, ...] = ()
    backend: str = "hf"
    server: str | None = None
    model: str | None = None
    concurrency: int = 8
    timeout: float = 600.0
    retries: int = 6
    batch_size: int = 8
    max_new_tokens: int | None = None
    shard_lines: int = 1000
    log_every: int = 1000


def run_regen(req: RegenRequest, *, say: t.Callable[[str], None], note: t.Callable[[str], None]) -> None:
    """Run `dflash regen`: the summary's lines to ``say`` (stdout), progress to ``note`` (stderr)."""
    from dflash.config import load_config
    from dflash.data.chat import load_tokenizer
    from dflash.data.corpus import drop_lines
    from dflash.errors import BadInput, DataError

    def fail(msg: str) -> t.NoReturn:
        raise BadInput(msg)

    if req.backend == "openai" and not req.server:
        fail("regen: --backend openai needs --server URL")
    if req.backend == "hf" and req.server:
        fail("regen: --server goes with --backend openai")
    cfg = load_config(req.config_path, req.overrides)
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
        if req.backend == "hf":
            fail(f"regen: the hf backend renders prompts with the target's tokenizer and chat template: {e}")
        note(f"regen: no local tokenizer ({e}): answers bounded by --max-new-tokens only")
    spec = RegenSpec(
        src=req.src,
        out=req.out,
        kwargs=kwargs,
        max_new_tokens=req.max_new_tokens or cfg.data.max_length,
        max_len=cfg.data.max_length if renderer is not None else None,
        shard_lines=req.shard_lines,
        log_every=req.log_every,
    )
    gens: list[t.Any] = []
    try:
        check_io(spec)
        if req.backend == "hf":
            from transformers.utils import logging as hf_logging  # the hf backend only: seconds to import

            hf_logging.disable_progress_bar()
            assert renderer is not None
            gens = list(load_hf(cfg, renderer.tokenizer, batch_size=req.batch_size))
        else:
            assert req.server is not None
            gens = [
                OpenAIGenerator(
                    req.server,
                    model=req.model,
                    kwargs=kwargs,
                    concurrency=req.concurrency,
                    timeout=req.timeout,
                    retries=req.retries,
                )
            ]
        summary = regen(spec, gens, renderer, log=note)
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
    say(
        f"regen: {c['records']} records -> {c['written']} written, {c['turns']} assistant turns "
        f"regenerated in {secs:.1f}s ({summary['done_now'] / max(secs, 1e-9):.2f} conv/s, {req.backend}); "
        f"wrote {req.out}"
    )
    if c["cut_answers"]:
        say(
            f"regen: {c['cut_answers']} answers stopped at the token limit ({spec.max_new_tokens}, or "
            f"max_length {spec.max_len} minus the prompt)"
        )
    if c["cut_conversations"]:
        say(
            f"regen: {c['cut_conversations']} conversations end before a turn whose prompt fills "
            f"max_length ({spec.max_len} tokens)"
        )
    if c["tool_call_turns"]:
        say(f"regen: {c['tool_call_turns']} regenerated turns call tools")
    if c["changed_calls"]:
        say(
            f"regen: {c['changed_calls']} conversations end after a regenerated turn whose tool calls are not the "
            "record's (the recorded tool results answer other calls)"
        )
    for line in drop_lines("regen", summary["drops"]):
        say(line)


__all__ = ["RegenRequest", "run_regen"]
