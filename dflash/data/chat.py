"""Chat records -> token sequences with loss masks, rendered as the serving engine renders them.

Accepted records (one JSON object per line, or a JSON array of them):

- OpenAI ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}``
- ShareGPT ``{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}]}``
  (``user``/``assistant`` are accepted in ``from`` as well)
- pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask`` optional: all ones)

Rendering (``render_conversation``): for assistant turn k at message i, serving shows the model the text
``prompt_k = template(messages[:i], add_generation_prompt=True, **kwargs)`` tokenized as a whole, and the
model then generates the turn. So the training sequence for turn k is ``tok(prompt_k)`` (masked) followed
by ``tok(answer_k)`` (supervised), where ``answer_k`` is what ``template(messages[:i+1])`` adds after
``prompt_k``, cut after the last EOS text (the template's trailing newline is never generated). A turn
whose ``prompt_k`` is not a text prefix of ``template(messages[:i+1])`` (e.g. a Qwen3 template with
``enable_thinking = false`` and an answer that carries a ``<think>`` block) is dropped: serving never
produces it.

Several turns share one sequence when the sequence so far is a token prefix of the next turn's
``tok(prompt_k)`` (Llama-3-like templates: one sequence per conversation); when it is not (templates that
strip earlier turns' think blocks from the history), the next turn starts a new sequence, so each
supervised token is preceded by exactly the context serving shows. No prefix property is assumed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.errors import DataError, InputError

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}


class BadRecord(InputError, ValueError):
    """A record that cannot be used; ``reason`` is a short key for the drop counts."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class Sequence:
    input_ids: list[int]
    loss_mask: list[int]


@dataclasses.dataclass(slots=True)
class Rendered:
    sequences: list[Sequence]
    dropped_turns: int = 0  # assistant turns serving never shows (template mismatch)
    too_long: bool = False  # rendering stopped at a turn whose prompt alone fills max_len


def parse_record(raw: bytes) -> dict[str, t.Any]:
    """One record of a corpus (a JSON line): read by ``inputs.loads``, so its text is text a tokenizer
    encodes (``bad-text``: a lone surrogate) and its nesting bounded (``bad-json``)."""
    try:
        rec = inputs.loads(raw)
    except inputs.JsonProblem as e:
        raise BadRecord(e.reason, str(e)) from None
    if not isinstance(rec, dict):
        raise BadRecord("not-an-object", "expected a JSON object")
    return rec


def messages_of(rec: t.Mapping[str, t.Any], *, need_assistant: bool = True) -> list[dict[str, str]]:
    """OpenAI or ShareGPT turns as OpenAI messages; BadRecord when malformed or (``need_assistant``, as
    training needs) without an assistant turn. Eval prompts may be user turns only."""
    if "messages" in rec:
        turns, rk, ck = rec["messages"], "role", "content"
    elif "conversations" in rec:
        turns, rk, ck = rec["conversations"], "from", "value"
    else:
        raise BadRecord("unknown-format", 'expected "messages", "conversations" or "input_ids"')
    if not isinstance(turns, list) or not turns:
        raise BadRecord("bad-turns", f"{'messages' if rk == 'role' else 'conversations'}: expected a non-empty list")
    out = []
    for j, m in enumerate(turns):
        if not isinstance(m, dict) or not isinstance(m.get(rk), str) or not isinstance(m.get(ck), str):
            raise BadRecord("bad-turns", f"turn {j}: expected an object with string {rk!r} and {ck!r}")
        role = ROLES.get(m[rk])
        if role is None:
            raise BadRecord("unknown-role", f"turn {j}: unknown role {m[rk]!r}")
        out.append({"role": role, "content": m[ck]})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no-assistant", "no assistant turn")
    return out


def pretokenized(rec: t.Mapping[str, t.Any], *, vocab_size: int | None = None) -> Sequence:
    """A pre-tokenized record; with ``vocab_size`` (the tokenizer's), an id outside it is ``out-of-vocab``."""
    ids = rec.get("input_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in ids)
    ):
        raise BadRecord("bad-tokens", "input_ids: expected a non-empty list of token ids")
    if vocab_size is not None and max(ids) >= vocab_size:
        j = next(j for j, x in enumerate(ids) if x >= vocab_size)
        raise BadRecord(
            "out-of-vocab", f"input_ids[{j}] = {ids[j]} is outside the tokenizer's vocabulary ({vocab_size} ids)"
        )
    mask = rec.get("loss_mask")
    if mask is None:
        return Sequence(ids, [1] * len(ids))
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise BadRecord("bad-tokens", f"loss_mask: expected {len(ids)} values of 0 or 1")
    return Sequence(ids, [int(m) for m in mask])


class Renderer:
    """The target's tokenizer and chat template, with the serving ``chat_template_kwargs``."""

    def __init__(self, tokenizer: t.Any, kwargs: t.Mapping[str, t.Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(kwargs or {})
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text: str | None = eos if isinstance(eos, str) and eos else None

    def _text(self, messages: list[dict[str, str]], gen: bool) -> str:
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **self.kwargs)
        except Exception as e:  # a template may raise anything (jinja's raise_exception included)
            raise BadRecord("template-error", f"the chat template failed: {e}") from None
        return str(out)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """What serving feeds the model before it answers ``messages``: the template with the generation
        prompt, tokenized as a whole (the template writes BOS itself, so no special tokens are added)."""
        return list(self.tokenizer(self._text(messages, True), add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, str]], *, max_len: int | None = None) -> Rendered:
        """Every assistant turn serving shows, in the context it shows it (module doc). With ``max_len``
        rendering stops at the first turn whose prompt alone has ``max_len`` tokens: none of its tokens, nor
        of any later turn's (whose prompt holds this one), survives the cut to ``max_len``, and rendering
        them would cost the square of the turns."""
        out = Rendered([])
        ids: list[int] = []
        mask: list[int] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._text(messages[:i], True)
            full = self._text(messages[: i + 1], False)
            if not full.startswith(prompt):
                out.dropped_turns += 1  # serving never shows this turn after that prompt
                continue
            answer = full[len(prompt) :]
            if self.eos_text and self.eos_text in answer:  # the template's tail after EOS is not generated
                answer = answer[: answer.rindex(self.eos_text) + len(self.eos_text)]
            p_enc, a_enc = self.tokenizer([prompt, answer], add_special_tokens=False)["input_ids"]
            p_ids, a_ids = list(p_enc), list(a_enc)
            go_on = bool(ids) and p_ids[: len(ids)] == ids  # the sequence so far is what serving shows
            if max_len is not None and len(p_ids) >= max_len:
                out.too_long = True
                if not go_on or not a_ids:  # a new sequence whose first supervised token is past the cut
                    break
            if not a_ids:
                continue
            if go_on:
                mask += [0] * (len(p_ids) - len(ids))
                ids = p_ids
            else:
                if ids:
                    out.sequences.append(Sequence(ids, mask))
                ids, mask = p_ids, [0] * len(p_ids)
            ids = ids + a_ids
            mask = mask + [1] * len(a_ids)
            if out.too_long:  # this turn completes the sequence the cut keeps (the bytes of a whole render)
                break
        if ids:
            out.sequences.append(Sequence(ids, mask))
        return out


def record_sequences(
    rec: t.Mapping[str, t.Any],
    renderer: Renderer | None,
    *,
    max_len: int | None = None,
    vocab_size: int | None = None,
) -> Rendered:
    """Any accepted record -> its sequences (BadRecord when unusable). ``max_len``: rendering stops where
    the cut to it would (``Renderer.render``); ``vocab_size``: pre-tokenized ids must be below it."""
    if "input_ids" in rec:
        return Rendered([pretokenized(rec, vocab_size=vocab_size)])
    msgs = messages_of(rec)
    if renderer is None:
        raise BadRecord("no-tokenizer", "a chat record needs the target's tokenizer (--config or --tokenizer)")
    rendered = renderer.render(msgs, max_len=max_len)
    if not rendered.sequences and rendered.too_long:
        raise BadRecord("prompt-too-long", f"the first assistant turn's prompt fills max_len ({max_len} tokens)")
    if not rendered.sequences:
        raise BadRecord("template-mismatch", "no assistant turn renders as serving shows it")
    return rendered


def tokenizer_hash(tokenizer: t.Any) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, normalizer, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def template_hash(tokenizer: t.Any) -> str:
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: str) -> t.Any:
    """A local tokenizer (never downloads)."""
    from transformers import AutoTokenizer  # seconds to import: only what loads a tokenizer pays for it

    # transformers 5 builds an empty tokenizer from a model folder that has none: refuse it here, so
    # that pre-tokenized data never depends on it and chat data gets a clear error.
    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(f"data.tokenizer: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from e


__all__ = [
    "TOKENIZER_FILES",
    "BadRecord",
    "Rendered",
    "Renderer",
    "Sequence",
    "messages_of",
    "parse_record",
    "pretokenized",
    "record_sequences",
    "load_tokenizer",
    "template_hash",
    "tokenizer_hash",
]
