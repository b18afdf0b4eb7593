"""A tiny target with something to say, and the training data it says: ``dflash make-tiny``.

A random-init transformer's greedy output is noise that no small drafter can predict, so the demo's
target first learns a small synthetic language, then writes its own training data, as in the real
recipe where the target regenerates every response:

1. the language: ``phrases`` fixed phrases of 3..7 words over a pool of ``words`` token ids (a word
   sits in several phrases, so the context, not only the last token, says what comes next); after a
   phrase comes one of four others, with probabilities .40/.25/.20/.15 (the likeliest ones chain all
   phrases into one long cycle, so greedy text does not loop after a few words);
2. the target: a Qwen3 of 6 layers and width 64, trained for ``target_steps`` steps on text sampled
   from the language (half a minute on two cores);
3. the training data, made BY THE TARGET: prompts sampled from the language (``loss_mask`` 0), and
   the target's own greedy continuation of each (``loss_mask`` 1);
4. held-out eval prompts from another random stream (none of them is a training prompt).

Token ids are the words themselves: no tokenizer. Rows ``words .. vocab_size - 1`` of the target's
vocabulary are never used (like the padded rows of a real vocabulary); the last one is the drafter's
MASK.

Layout of the output directory (written to a temp dir, then renamed; same seed -> same bytes)::

    target/        config.json, generation_config.json, model.safetensors (from_pretrained, local)
    train.jsonl    {"input_ids": [...], "loss_mask": [0, ..., 1, ...]}   the target's own answers
    eval.jsonl     {"input_ids": [...]}                                   held-out prompts
    language.json  the phrases and what follows each (to read, or to check)
    tiny.json      the manifest, written last: spec, the target's final loss, sha256 of every file
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import typing as t
from pathlib import Path

import torch

__all__ = ["Language", "TinyError", "TinySpec", "greedy_batch", "load_manifest", "make_tiny"]

MANIFEST = "tiny.json"
FORMAT = "dflash-tiny/1"
SUCCESSOR_PROBS = (0.40, 0.25, 0.20, 0.15)


class TinyError(ValueError):
    """make-tiny cannot do what it was asked (a bad spec value, an output dir that is not ours)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinySpec:
    """Everything that decides the output; the manifest records it, so a rerun can tell it is done."""

    seed: int = 0
    vocab_size: int = 256  # embedding rows; the last is the drafter's MASK
    words: int = 200  # the language uses ids 0..words-1
    phrases: int = 64
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    target_steps: int = 150
    target_batch: int = 32
    target_seq: int = 48
    target_lr: float = 3e-3
    train_samples: int = 1024
    eval_prompts: int = 32
    prompt_min: int = 8
    prompt_max: int = 24
    response_len: int = 64
    gen_batch: int = 128
    threads: int = 2  # torch threads while building: fixed, so the same seed gives the same bytes

    def check(self) -> None:
        def at_least(name: str, low: int) -> None:
            value = getattr(self, name)
            if value < low:
                raise TinyError(f"{name}: must be >= {low}, got {value}")

        for name in ("phrases", "target_batch", "train_samples", "eval_prompts", "gen_batch", "threads",
                     "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size"):
            at_least(name, 1)
        at_least("target_steps", 0)
        at_least("words", 8)
        at_least("num_layers", 4)  # DFlash features come from layers 1..L-3
        at_least("prompt_min", 2)
        at_least("response_len", 2)
        at_least("target_seq", 8)
        if self.vocab_size <= self.words:
            raise TinyError(f"vocab_size: must exceed words ({self.words}) so that unused rows (and MASK) exist, "
                            f"got {self.vocab_size}")
        if self.prompt_max < self.prompt_min:
            raise TinyError(f"prompt_max: must be >= prompt_min ({self.prompt_min}), got {self.prompt_max}")
        if self.num_heads % self.num_kv_heads:
            raise TinyError(f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.target_lr <= 0:
            raise TinyError(f"target_lr: must be > 0, got {self.target_lr}")

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1

    def to_dict(self) -> dict[str, t.Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# The language


@dataclasses.dataclass(frozen=True)
class Language:
    """Phrases of word ids, and the four phrases that may follow each one (most likely first)."""

    phrases: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]

    @classmethod
    def generate(cls, spec: TinySpec) -> Language:
        rng = random.Random(f"language:{spec.seed}")
        phrases = tuple(tuple(rng.randrange(spec.words) for _ in range(rng.randint(3, 7))) for _ in range(spec.phrases))
        # The likeliest successors form ONE cycle through every phrase, so the target's greedy text
        # does not fall into a short loop: a drafter has to learn all of it.
        order = list(range(spec.phrases))
        rng.shuffle(order)
        first = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
        successors = tuple((first[i], *(rng.randrange(spec.phrases) for _ in SUCCESSOR_PROBS[1:]))
                           for i in range(spec.phrases))
        return cls(phrases, successors)

    def sample(self, rng: random.Random, length: int) -> list[int]:
        """``length`` tokens of running text, starting anywhere inside a random phrase."""
        i = rng.randrange(len(self.phrases))
        out = list(self.phrases[i][rng.randrange(len(self.phrases[i])):])
        while len(out) < length:
            i = rng.choices(self.successors[i], weights=SUCCESSOR_PROBS)[0]
            out.extend(self.phrases[i])
        return out[:length]

    def to_dict(self) -> dict[str, t.Any]:
        return {"phrases": [list(p) for p in self.phrases], "successors": [list(s) for s in self.successors],
                "successor_probs": list(SUCCESSOR_PROBS)}


# --------------------------------------------------------------------------------------------
# The target


def _target_config(spec: TinySpec) -> t.Any:
    from dflash.target import tiny_target_config

    return tiny_target_config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )


def train_target(spec: TinySpec, language: Language, *, log: t.Callable[[str], None] | None = None) -> tuple[t.Any, float]:
    """A Qwen3 trained on the language (AdamW, warmup then cosine). Returns (model in eval mode, final loss)."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(_target_config(spec))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.target_lr, weight_decay=0.0)
    rng = random.Random(f"target-data:{spec.seed}")
    warmup = max(1, spec.target_steps // 8)
    loss_value = math.nan
    for step in range(spec.target_steps):
        batch = torch.tensor([language.sample(rng, spec.target_seq) for _ in range(spec.target_batch)])
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.target_steps))
        for group in opt.param_groups:
            group["lr"] = spec.target_lr * scale
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if log is not None and (step + 1) % 50 == 0:
            log(f"target step {step + 1}/{spec.target_steps}: loss {loss_value:.3f}")
    model.eval()
    model.requires_grad_(False)
    return model, loss_value


@torch.no_grad()
def greedy_batch(model: t.Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The greedy continuation ``[N, new_tokens]`` of N prompts of the same length, one cached forward per token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in _forward_params(model) else "past_key_values"
    step_ids = prompts
    position = 0
    out = []
    for _ in range(new_tokens):
        positions = torch.arange(position, position + step_ids.shape[1]).expand(step_ids.shape[0], -1)
        logits = model(input_ids=step_ids, position_ids=positions, use_cache=True, **{kwarg: cache}).logits
        position += step_ids.shape[1]
        step_ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        out.append(step_ids)
    return torch.cat(out, dim=1)


def _save_quietly(model: t.Any, path: Path) -> None:
    """save_pretrained without its progress bar (it would land in the demo's output)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _forward_params(model: t.Any) -> t.Mapping[str, t.Any]:
    import inspect

    return inspect.signature(model.forward).parameters


def write_data(spec: TinySpec, language: Language, model: t.Any, train_path: Path, eval_path: Path) -> dict[str, int]:
    """train.jsonl: prompts from the language + the target's greedy answers; eval.jsonl: held-out prompts."""
    rng = random.Random(f"prompts:{spec.seed}")
    seen: set[tuple[int, ...]] = set()
    lines = []
    done = 0
    while done < spec.train_samples:
        n = min(spec.gen_batch, spec.train_samples - done)
        length = rng.randint(spec.prompt_min, spec.prompt_max)  # one length per batch: no padding
        prompts = [language.sample(rng, length) for _ in range(n)]
        answers = greedy_batch(model, torch.tensor(prompts), spec.response_len).tolist()
        for prompt, answer in zip(prompts, answers):
            bad = [tok for tok in answer if tok >= spec.words]
            if bad:  # a target that learned the language never says an unused row; say so instead of hiding it
                raise TinyError(f"the target answered with unused token {bad[0]} (ids >= {spec.words}); "
                                "train it longer (target_steps)")
            seen.add(tuple(prompt))
            lines.append(json.dumps({"input_ids": prompt + answer,
                                     "loss_mask": [0] * len(prompt) + [1] * len(answer)}, separators=(",", ":")))
        done += n
    train_path.write_text("\n".join(lines) + "\n")

    held = random.Random(f"eval:{spec.seed}")
    prompts_out: list[str] = []
    while len(prompts_out) < spec.eval_prompts:
        prompt = language.sample(held, held.randint(spec.prompt_min, spec.prompt_max))
        if tuple(prompt) in seen:
            continue
        seen.add(tuple(prompt))
        prompts_out.append(json.dumps({"input_ids": prompt}, separators=(",", ":")))
    eval_path.write_text("\n".join(prompts_out) + "\n")
    return {"train_samples": len(lines), "eval_prompts": len(prompts_out)}


# --------------------------------------------------------------------------------------------
# The whole thing


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(out: str | os.PathLike[str]) -> dict[str, t.Any] | None:
    """The manifest of a complete make-tiny output at ``out``, or None (absent, partial or not ours)."""
    try:
        manifest = json.loads((Path(out) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    for name, digest in (manifest.get("files") or {}).items():
        path = Path(out) / name
        if not path.is_file() or _sha256(path) != digest:
            return None
    return manifest


def make_tiny(out: str | os.PathLike[str], spec: TinySpec | None = None, *, force: bool = False,
              log: t.Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """Build the target and its data into ``out``. Returns (out, built): ``built`` is False when a
    complete output of the same spec was already there (nothing is rewritten; ``force`` rebuilds)."""
    spec = spec or TinySpec()
    spec.check()
    out = Path(out)
    existing = load_manifest(out)
    if existing is not None and existing.get("spec") == spec.to_dict() and not force:
        return out, False
    if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise TinyError(f"{out}: exists and is not a make-tiny output (no {MANIFEST}); give another --out")
    say = log or (lambda _msg: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        language = Language.generate(spec)
        (tmp / "language.json").write_text(json.dumps(language.to_dict(), separators=(",", ":")) + "\n")
        say(f"training the tiny target ({spec.num_layers} layers, width {spec.hidden_size}) for {spec.target_steps} steps")
        model, loss = train_target(spec, language, log=say)
        _save_quietly(model, tmp / "target")
        say(f"the target writes {spec.train_samples} answers of {spec.response_len} tokens (greedy)")
        counts = write_data(spec, language, model, tmp / "train.jsonl", tmp / "eval.jsonl")
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT,
            "spec": spec.to_dict(),
            "target_loss": round(loss, 4),
            "mask_token_id": spec.mask_token_id,
            **counts,
            "files": {name: _sha256(tmp / name) for name in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out.exists():
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out, True
