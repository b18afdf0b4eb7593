"""Held-out tau during training (``[eval]``): the averaged drafter of a checkpoint, decoded in the background.

Every ``eval.every`` global steps the drafters meet at a barrier that averages them and writes a checkpoint
(an eval step is always a checkpoint step, so that ``checkpoints/best`` can point to what was measured). The
barrier costs what a checkpoint costs: the CPU snapshot the background writer writes is also what this
module evaluates, in its own thread, with its own copies of the target and the drafter on ``eval.device``
(default: the first target device; a spare GPU keeps the eval off the training GPUs). The drafters go on
training meanwhile. One eval at a time: when the next eval step comes while the last eval still runs, the
barrier waits for it (and says how long), as the checkpoint writer waits for its last write.

What is measured is what ``dflash eval --drafter step-N --prompts FILE --max-new M`` prints as tau (the same
prompts, the same decode, the dflash count: tokens per target forward, greedy, stop at EOS), but without the
second decode by the target alone that ``dflash eval`` makes to check the output (speculative decoding
never changes it; the check would cost a plain decode, several times the speculative one).

Prompts (``eval.prompts``): a file as ``dflash eval --prompts`` reads it (token records, or chat records
rendered with the run's tokenizer and chat template and ``data.chat_template_kwargs``), or one suite as
``dflash eval --suite`` names it (``gsm8k``, ``mt-bench=PATH``: ``dflash.eval.suites``, the ``datasets`` extra);
default: ``eval.jsonl`` next to ``data.path`` (make-tiny writes it). ``eval.limit``: the first N.

The best: an eval whose tau is higher than every earlier one of the same protocol switches
``checkpoints/best -> step-N`` (``best.set_best``) and best.json; pruning never removes it. A resumed
run reads best.json and goes on comparing against it; when the eval protocol changed (other prompts, another
``max_new``), the old best is not compared with (a warning says so) and the first eval of this run replaces it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
import typing as t
from pathlib import Path

import torch

from dflash import inputs
from dflash.checkpoint.best import BEST_LINK, read_best, set_best
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError, RunConfig, is_suite
from dflash.data.chat import BadRecord, Renderer
from dflash.dtypes import torch_dtype
from dflash.errors import DflashError
from dflash.eval import suites
from dflash.eval.evaluate import DeferredPrompt, EvalError, eos_ids, load_prompts, read_records
from dflash.eval.spec_decode import speculative_generate, step_credits
from dflash.eval.suite_report import suite_prompts
from dflash.model.drafter import DFlashDraftConfig
from dflash.models import initial_drafter, load_target

# The run's log lines keep the name train.log has always shown (dflash.train.run).
logger = logging.getLogger("dflash.train")

__all__ = ["EvalResult", "Validator", "default_prompts"]

Prompt = t.Sequence[int] | DeferredPrompt


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """One held-out eval: the tau of the checkpoint at ``step``, and the best so far after it."""

    step: int
    tau: float
    prompts: int
    new_tokens: int
    verify_steps: int
    seconds: float
    best_step: int | None
    best_tau: float | None
    is_best: bool  # this eval switched checkpoints/best to its step

    def record(self) -> dict[str, t.Any]:
        """Its metrics.jsonl record (``kind`` tells it from the step records)."""
        return {
            "kind": "eval",
            "step": self.step,
            "tau": round(self.tau, 6),
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "verify_steps": self.verify_steps,
            "seconds": round(self.seconds, 3),
            "best_step": self.best_step,
            "best_tau": None if self.best_tau is None else round(self.best_tau, 6),
            "is_best": self.is_best,
        }


def default_prompts(cfg: RunConfig) -> str:
    """``eval.prompts``, else the eval.jsonl next to the training data (what ``dflash eval`` reads by default)."""
    if cfg.eval.prompts is not None:
        return cfg.eval.prompts
    return str(Path(cfg.data.path).parent / "eval.jsonl")


# Room on the eval device beyond the target's weights: the eval's drafter copy and its decode (at least).
_ROOM_MARGIN = 1 << 30


def _free_bytes(device: str) -> int | None:
    """Free memory on a CUDA device (``cudaMemGetInfo``), None for another device or when unknown."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        return int(torch.cuda.mem_get_info(dev)[0])
    except (RuntimeError, AssertionError):  # no such device, or CUDA not initialised
        return None


def _no_room(device: str, need: int, free: int | None) -> str:
    """One line for an eval device without room for the eval's copies, naming what would fit."""
    gib = 1 << 30
    others = []
    try:
        count = torch.cuda.device_count()
    except (RuntimeError, AssertionError):
        count = 0
    for i in range(count):
        room = _free_bytes(f"cuda:{i}")
        if torch.device(f"cuda:{i}") != torch.device(device) and room is not None and room >= need:
            others.append(f'"cuda:{i}"')
    has = f"{free / gib:.1f} GiB free" if free is not None else "not enough free"
    where = f"{' or '.join(others)} (room enough now), " if others else ""
    return (
        f"the eval's own copy of the target needs about {need / gib:.1f} GiB on {device}, which has {has} "
        f'(training target 0 is there unless eval.device says otherwise); set eval.device to {where}"cpu" '
        "(slow), or train without [eval] every and run `dflash eval` on the checkpoints"
    )


def check_eval_room(device: str, need: int) -> None:
    """Refuse an eval device that cannot hold ``need`` bytes now, in one line (``ConfigError`` for
    ``eval.device``); a device whose room is unknown (the CPU) passes."""
    free = _free_bytes(device)
    if free is not None and need > 0 and free < need:
        raise ConfigError("eval.device", _no_room(device, need, free))


class Validator:
    """The eval of ``[eval]``: built at start-up (prompts read, target and drafter copies made: a bad
    ``eval.*`` value stops the run before training), then ``submit(step, weights)`` per eval step."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        draft_config: DFlashDraftConfig,
        tokenizer: t.Any,
        ckpt_dir: Path,
        run_id: str | None,
        written: t.Callable[[int, float], bool],
        on_result: t.Callable[[EvalResult], None],
        target_bytes: int = 0,
    ) -> None:
        self.cfg = cfg
        self.ckpt_dir = ckpt_dir
        self.run_id = run_id
        self.max_new = cfg.eval.max_new
        self.device = cfg.eval.device or cfg.devices.targets[0]
        self._written = written  # (step, timeout) -> whether the checkpoint writer is done with that step
        self._on_result = on_result
        # the eval's own target sits beside training target 0 by default: a 27B one twice is ~108 GB
        need = target_bytes + max(_ROOM_MARGIN, target_bytes // 10)  # + its drafter copy and decode
        check_eval_room(self.device, need)
        try:  # a copy of its own: a training target's feature hooks belong to its thread
            self.target = load_target(cfg, self.device, layer_ids=draft_config.target_layer_ids)
            self.head = self.target.head()
            self.drafter = initial_drafter(draft_config, seed=cfg.seed)  # weights come with each submit
            self.drafter.to(device=self.device, dtype=torch_dtype(cfg.drafter.dtype))
        except OSError as e:
            raise ConfigError("target.path", f"cannot load a model from {cfg.target.path}: {e}") from e
        except torch.OutOfMemoryError:
            raise ConfigError("eval.device", _no_room(self.device, need, _free_bytes(self.device))) from None
        self.drafter.requires_grad_(False)
        self.drafter.eval()
        source = default_prompts(cfg)
        self.prompts, self.source, prompts_sha = self._load(source, tokenizer)
        stops_from = [self.target.model.config, getattr(self.target.model, "generation_config", None), tokenizer]
        self.stops = eos_ids(*stops_from)
        self.protocol: dict[str, t.Any] = {
            "prompts_source": self.source,
            "prompts_sha256": prompts_sha,
            "num_prompts": len(self.prompts),
            "max_new_tokens": self.max_new,
            "stop_token_ids": self.stops,
            "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
            "block_size": draft_config.block_size,
            "decoding": "greedy",
            "count": "dflash",
        }
        self.protocol_key = hashlib.sha256(json.dumps(self.protocol, sort_keys=True).encode()).hexdigest()[:16]
        self.best_step: int | None = None
        self.best_tau: float | None = None
        self._read_best()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._loaded.set()
        self._abandon = threading.Event()
        self._pending: set[int] = set()  # steps submitted and not done: pruning leaves them (CheckpointWriter)
        self._lock = threading.Lock()
        self.failed = False  # an eval raised: logged, and the run goes on without evals
        self.waits: list[float] = []
        logger.info(
            "eval: every %d steps, %d prompts from %s, up to %d new tokens each%s, on %s",
            cfg.eval.every,
            len(self.prompts),
            self.source,
            self.max_new,
            " (stop at EOS)" if self.stops else "",
            self.device,
        )

    # start-up ---------------------------------------------------------------------------

    def _load(self, source: str, tokenizer: t.Any) -> tuple[list[Prompt], str, str]:
        """The prompts (token ids, or deferred turns of a multi-turn suite), where they came from, their sha256."""
        limit = self.cfg.eval.limit
        vocab = self.target.vocab_size
        if is_suite(source):
            (name, suite_dir), *_ = suites.parse_suites(source)
            suite_renderer = self._renderer(tokenizer, f"suite {name}")
            try:
                convs = suites.load(name, suite_dir, limit=limit)
                prompts = suite_prompts(convs, suite_renderer, vocab, name)
            except (suites.SuiteError, EvalError) as e:
                raise ConfigError("eval.prompts", str(e)) from None
            sha = hashlib.sha256(json.dumps(convs).encode()).hexdigest()
            return prompts, f"suite {name} ({suite_dir or suites.SUITES[name].repo})", sha
        path = Path(source)
        if not path.is_file():
            why = "(eval.prompts not set: eval.jsonl next to data.path)" if self.cfg.eval.prompts is None else ""
            raise ConfigError("eval.prompts", f"{path} is not a file {why}".rstrip())
        try:
            data = inputs.read_bytes(path, "eval.prompts")
            first = next(read_records(inputs.without_bom(data).decode("utf-8"), path), None)
        except inputs.InputFileError as e:
            raise ConfigError("eval.prompts", str(e).removeprefix("eval.prompts: ")) from None
        except (UnicodeDecodeError, EvalError) as e:
            raise ConfigError("eval.prompts", f"cannot read {path}: {e}") from None
        rec = first[1] if first is not None else None
        chat = isinstance(rec, dict) and ("messages" in rec or "conversations" in rec) and "input_ids" not in rec
        renderer = self._renderer(tokenizer, str(path)) if chat else None
        try:
            loaded = load_prompts(path, limit=limit, vocab_size=vocab, renderer=renderer)
        except EvalError as e:
            raise ConfigError("eval.prompts", str(e).removeprefix("--prompts: ")) from None
        limit_pos = getattr(self.target.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in loaded)
        if isinstance(limit_pos, int) and longest + self.max_new > limit_pos:
            raise ConfigError(
                "eval.max_new",
                f"the longest prompt of {path} has {longest} tokens; {longest} + {self.max_new} passes the "
                f"target's max_position_embeddings ({limit_pos})",
            )
        return list(loaded), str(path.resolve()), hashlib.sha256(data).hexdigest()

    def _renderer(self, tokenizer: t.Any, what: str) -> Renderer:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "eval.prompts",
                f"{what} holds chat prompts: they are rendered with the run's chat template, and this run has "
                "no tokenizer with one (set data.tokenizer)",
            )
        return Renderer(tokenizer, dict(self.cfg.data.chat_template_kwargs))

    def _read_best(self) -> None:
        """The best so far, from best.json (a resumed run), when it was measured the same way."""
        rec = read_best(self.ckpt_dir)
        if rec is None:
            return
        tau, step = rec.get("tau"), rec.get("step")
        if rec.get("protocol_key") != self.protocol_key:
            logger.warning(
                "eval: the best so far (%s -> step-%s, held-out tau %s) was measured otherwise (other prompts or "
                "settings); not compared with it: the first eval of this run replaces it",
                self.ckpt_dir / BEST_LINK,
                step,
                tau,
            )
            return
        if isinstance(tau, (int, float)) and isinstance(step, int):
            self.best_step, self.best_tau = step, float(tau)
            logger.info("eval: the best so far is step %d (held-out tau %.3f)", step, tau)

    # the barrier's side -------------------------------------------------------------------

    def submit(self, step: int, weights: t.Mapping[str, torch.Tensor]) -> None:
        """Evaluate ``weights`` (CPU tensors the caller leaves alone until ``released``) as the checkpoint of
        ``step``, in the background. Waits for the eval before it, if it still runs."""
        if self.failed:
            return
        waited = 0.0
        if self._thread is not None and self._thread.is_alive():
            started = time.monotonic()
            self._thread.join()
            waited = time.monotonic() - started
            logger.warning(
                "eval: the barrier at step %d waited %.1f s for the eval before it; an eval takes longer than "
                "eval.every steps (fewer prompts, a smaller eval.max_new or another eval.device shorten it)",
                step,
                waited,
            )
        self.waits.append(waited)  # per eval barrier: what it waited for the eval before it (bench/eval_barrier.py)
        with self._lock:
            self._pending.add(step)
        self._loaded.clear()
        self._thread = threading.Thread(target=self._run, args=(step, weights), name=f"eval-{step}", daemon=True)
        self._thread.start()

    def released(self) -> None:
        """Block until the eval in flight has copied its weights (the snapshot may then be written over)."""
        self._loaded.wait()

    def pending(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def close(self, *, wait: bool) -> None:
        """``wait``: let the eval in flight finish (the end of a run); else abandon it (a stop, a failure)."""
        if self._thread is None:
            return
        if not wait:
            self._abandon.set()
        self._thread.join(None if wait else 30.0)
        if self._thread.is_alive():
            logger.warning("eval: the eval in flight did not stop within 30 s; leaving it")

    # the eval's thread ------------------------------------------------------------------------

    def _run(self, step: int, weights: t.Mapping[str, torch.Tensor]) -> None:
        try:
            try:
                self.drafter.load_state_dict(dict(weights), strict=True)  # a copy onto eval.device
            finally:
                self._loaded.set()
            result = self._decode(step)
            if result is None or self._abandon.is_set():
                return
            self._on_result(self._judge(result))
        except (DflashError, RuntimeError, ValueError, OSError) as e:  # torch raises RuntimeError (OOM included)
            self.failed = True
            logger.error("eval of step %d failed (%s: %s); training goes on without evals", step, type(e).__name__, e)
        finally:
            with self._lock:
                self._pending.discard(step)

    @torch.no_grad()
    def _decode(self, step: int) -> EvalResult | None:
        started = time.monotonic()
        taus: list[float] = []
        outputs: list[list[int]] = []
        new_tokens = verify_steps = 0
        for item in self.prompts:
            if self._abandon.is_set():
                return None
            try:
                prompt = list(item(outputs) if callable(item) else item)
            except (BadRecord, EvalError) as e:
                raise EvalError(f"eval.prompts: {e}") from None
            res = speculative_generate(
                self.target,
                self.drafter,
                torch.tensor([prompt], dtype=torch.long),
                max_new_tokens=self.max_new,
                head=self.head,
                stop_token_ids=self.stops or None,
            )
            new = res.tokens[0, res.num_prompt_tokens :].tolist()
            outputs.append(new)
            stop_at = len(new) - 1 if self.stops and new and new[-1] in self.stops else None
            credits = step_credits(res.accept_lengths, max_new=self.max_new, stop_at=stop_at, rule="dflash")
            taus.append(sum(credits) / len(credits) if credits else 0.0)  # as dflash.eval.evaluate counts a prompt
            new_tokens += len(new)
            verify_steps += len(credits)
        return EvalResult(
            step=step,
            tau=sum(taus) / len(taus),
            prompts=len(taus),
            new_tokens=new_tokens,
            verify_steps=verify_steps,
            seconds=time.monotonic() - started,
            best_step=None,
            best_tau=None,
            is_best=False,
        )

    def _judge(self, r: EvalResult) -> EvalResult:
        """Switch checkpoints/best when ``r`` beats the best so far (once its checkpoint is on disk)."""
        is_best = self.best_tau is None or r.tau > self.best_tau
        if is_best:
            while not self._written(r.step, 1.0):  # the writer may still be writing step-N
                if self._abandon.is_set():
                    return r
            record = {
                "step": r.step,
                "tau": r.tau,
                "run_id": self.run_id,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "protocol_key": self.protocol_key,
                "protocol": self.protocol,
            }
            try:
                set_best(self.ckpt_dir, record)
            except (CheckpointError, OSError) as e:
                logger.warning("eval: step %d has the best tau, but checkpoints/best stays: %s", r.step, e)
                is_best = False
            else:
                self.best_step, self.best_tau = r.step, r.tau
        return dataclasses.replace(r, best_step=self.best_step, best_tau=self.best_tau, is_best=is_best)
