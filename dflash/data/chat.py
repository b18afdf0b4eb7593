"""Chat records -> token sequences with loss masks, rendered as the serving engine renders them.

Accepted records (one JSON object per line, or a JSON array of them):

- OpenAI ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}], "tools": [...]}``:
  ``content`` a string, null or content parts (text parts joined with newlines; an image, audio or file
  part drops the record, ``media-content``); an assistant turn's ``tool_calls`` (arguments JSON text or
  objects) and ``reasoning_content`` (or ``reasoning``); a tool turn's ``tool_call_id`` and ``name``;
  ``tools`` a list of functions or a JSON string of one (``bad-tools`` when it is neither)
- ShareGPT ``{"conversations": [{"from": ..., "value": "..."}], "tools": ...}`` with the roles datasets use:
  ``system``, ``human``, ``gpt``, ``function_call`` (the call as JSON: an assistant turn with tool calls),
  ``tool``/``observation``/``function_response`` (a tool result); a ``gpt`` turn's ``<tool_call>`` blocks
  of JSON (Hermes) become its tool calls (``user``/``assistant`` are accepted in ``from`` as well)
- ``{"question": "...", "answer": "..."}`` (GSM8K): one user turn and its answer; ``answer`` (and
  ``reasoning``) beside turns that end before the answer (Dolphin-R1): the last assistant turn
- pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask`` optional: all ones)

Turns reach the chat template as vLLM and SGLang pass a request's (``messages_of``): the tool calls'
arguments parsed to objects, the reasoning as ``reasoning_content``, the record's ``tools`` as
``tools=``. What the template then writes is the rule: tool results are context (masked); an assistant
turn's tool calls are its answer (supervised), and so is the text after them; reasoning is supervised
where the template shows it before the answer, earlier turns' reasoning is what the template keeps of it
in the history. A template that ignores the record's tools or leaves its tool calls out of the text drops
the record (``template-no-tools``): serving would show the model none of them.

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
import re
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.errors import DataError, InputError

# a role as datasets spell it -> the OpenAI role (ShareGPT's ``from``; LLaMA-Factory's and Glaive's tool roles)
ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
    "function_call": "assistant",  # its value is the call(s): {"name", "arguments"} or a list of them
    "observation": "tool",
    "function_response": "tool",
}
MEDIA_PARTS = ("image_url", "image", "input_image", "audio", "input_audio", "video", "video_url", "file")
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_RESPONSE_BLOCK = re.compile(r"\A\s*<tool_response>\s*(.*?)\s*</tool_response>\s*\Z", re.S)


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


def _content(value: t.Any, where: str) -> str:
    """A turn's text: a string, null (an assistant turn that only calls tools) or OpenAI content parts,
    whose text parts are joined with newlines as vLLM joins them for a text-only template; an image, audio
    or file part refuses the record (``media-content``): the drafter learns from the target's text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in MEDIA_PARTS:
                raise BadRecord("media-content", f"{where}: a part of type {kind} (only text is trained on)")
            else:
                raise BadRecord("bad-turns", f"{where}[{k}]: expected a text part {{type: text, text}}")
        return "\n".join(texts)
    raise BadRecord("bad-turns", f"{where}: expected a string or a list of content parts")


def _json_object(value: t.Any, where: str, reason: str) -> t.Any:
    """A JSON text parsed (bounded, as every record), else the value itself."""
    if not isinstance(value, str):
        return value
    try:
        return inputs.loads(value)
    except inputs.JsonProblem as e:
        raise BadRecord(reason, f"{where}: {e}") from None


def tool_calls_of(value: t.Any, where: str) -> list[dict[str, t.Any]]:
    """Tool calls as chat templates read them (vLLM's and SGLang's shape): ``{"type": "function",
    "function": {"name", "arguments": {...}}}`` (and ``id`` when given), the arguments an object even when
    the record holds them as JSON text (OpenAI's wire form), as serving parses them before rendering.
    Accepts OpenAI's nesting under ``function`` or a bare ``{"name", "arguments"|"parameters"}``."""
    value = _json_object(value, where, "bad-tool-call")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRecord("bad-tool-call", f"{where}: expected a non-empty list of tool calls")
    out = []
    for k, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str) or not name:
            raise BadRecord("bad-tool-call", f"{where}[{k}]: expected {{function: {{name, arguments}}}}")
        args = fn.get("arguments", fn.get("parameters"))
        args = {} if args is None or args == "" else _json_object(args, f"{where}[{k}].arguments", "bad-tool-call")
        if not isinstance(args, dict):
            raise BadRecord("bad-tool-call", f"{where}[{k}].arguments: expected a JSON object")
        norm: dict[str, t.Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            norm["id"] = call["id"]
        out.append(norm)
    return out


def tools_of(rec: t.Mapping[str, t.Any]) -> list[dict[str, t.Any]] | None:
    """The record's ``tools`` (a list, or a JSON string of one, as datasets store it) as serving passes
    them to the chat template: ``{"type": "function", "function": {...}}`` each; None when there are none."""
    raw = _json_object(rec.get("tools"), "tools", "bad-tools")
    if raw is None or raw == "" or raw == []:
        return None
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise BadRecord("bad-tools", "tools: expected a list of function objects (or a JSON string of one)")
    out = []
    for k, tool in enumerate(raw):
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecord("bad-tools", f"tools[{k}]: expected {{type: function, function: {{name, ...}}}}")
        out.append({"type": "function", "function": fn})
    return out


def split_tool_calls(text: str) -> tuple[str, list[dict[str, t.Any]]] | None:
    """A text's ``<tool_call>`` blocks of JSON (Hermes, Qwen: what a ``hermes`` tool parser takes) as tool
    calls, and the text before the first as content; None when it has none, or one is not a JSON call."""
    if "<tool_call>" not in text:
        return None
    blocks = _CALL_BLOCK.findall(text)
    try:
        calls = [tool_calls_of(b, "<tool_call>")[0] for b in blocks]
    except BadRecord:
        return None
    return (text[: text.index("<tool_call>")].strip(), calls) if calls else None


def _sharegpt_turn(role: str, text: str, where: str) -> dict[str, t.Any]:
    """A ShareGPT turn as an OpenAI message: ``function_call`` holds the call(s) as JSON; a ``gpt`` turn
    whose calls are ``<tool_call>`` blocks of JSON (Hermes) gets them as tool calls, the text before them
    as content (blocks that are not JSON stay text); a tool result's ``<tool_response>`` wrapper, which the
    template writes itself, is taken off."""
    if role == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": tool_calls_of(text, where)}
    out: dict[str, t.Any] = {"role": ROLES[role], "content": text}
    if out["role"] == "assistant" and (split := split_tool_calls(text)) is not None:
        out = {"role": "assistant", "content": split[0], "tool_calls": split[1]}
    elif out["role"] == "tool" and (m := _RESPONSE_BLOCK.match(text)):
        out["content"] = m.group(1)
    return out


def _openai_turn(m: dict[str, t.Any], role: str, where: str) -> dict[str, t.Any]:
    """An OpenAI message with what chat templates read: an assistant's ``tool_calls`` and reasoning
    (``reasoning_content`` or ``reasoning``: passed as both, as vLLM does), a tool turn's ``tool_call_id``
    and ``name``."""
    out: dict[str, t.Any] = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
    if role == "assistant":
        if m.get("tool_calls"):
            out["tool_calls"] = tool_calls_of(m["tool_calls"], f"{where}.tool_calls")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
    return out


def messages_of(rec: t.Mapping[str, t.Any], *, need_assistant: bool = True) -> list[dict[str, t.Any]]:
    """OpenAI or ShareGPT turns (or a GSM8K-style ``question``/``answer``) as OpenAI messages, with the
    tool calls, tool results and reasoning they hold (``_openai_turn``, ``_sharegpt_turn``); a record whose
    turns end before the answer and that holds ``answer`` (and ``reasoning``) beside them (Dolphin-R1) gets
    it as its last assistant turn. BadRecord when malformed or (``need_assistant``, as training needs)
    without an assistant turn. Eval prompts may be user turns only."""
    if "messages" in rec:
        turns, rk, ck = rec["messages"], "role", "content"
    elif "conversations" in rec:
        turns, rk, ck = rec["conversations"], "from", "value"
    elif isinstance(rec.get("question"), str) and isinstance(rec.get("answer"), str):
        turns, rk, ck = [{"role": "user", "content": rec["question"]}], "role", "content"
    else:
        raise BadRecord("unknown-format", 'expected "messages", "conversations", "question" or "input_ids"')
    if not isinstance(turns, list) or not turns:
        raise BadRecord("bad-turns", f"{'messages' if rk == 'role' else 'conversations'}: expected a non-empty list")
    out = []
    for j, m in enumerate(turns):
        if not isinstance(m, dict) or not isinstance(m.get(rk), str):
            raise BadRecord("bad-turns", f"turn {j}: expected an object with a string {rk!r}")
        role = ROLES.get(m[rk])
        if role is None:
            raise BadRecord("unknown-role", f"turn {j}: unknown role {m[rk]!r}")
        if rk == "role":
            out.append(_openai_turn(m, role, f"turn {j}"))
        elif isinstance(m.get(ck), str):
            out.append(_sharegpt_turn(m[rk], m[ck], f"turn {j}"))
        else:
            raise BadRecord("bad-turns", f"turn {j}: expected an object with string {rk!r} and {ck!r}")
    answer = rec.get("answer")
    if isinstance(answer, str) and answer and out[-1]["role"] != "assistant":
        last: dict[str, t.Any] = {"role": "assistant", "content": answer}
        if isinstance(rec.get("reasoning"), str) and rec["reasoning"]:
            last["reasoning_content"] = last["reasoning"] = rec["reasoning"]
        out.append(last)
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

    def _text(self, messages: list[dict[str, t.Any]], gen: bool, tools: list[dict[str, t.Any]] | None = None) -> str:
        """The template's text, ``tools`` passed as vLLM and SGLang pass a request's (``tools=``)."""
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen, **self.kwargs
            )
        except Exception as e:  # a template may raise anything (jinja's raise_exception included)
            raise BadRecord("template-error", f"the chat template failed: {e}") from None
        return str(out)

    def prompt_ids(self, messages: list[dict[str, t.Any]], tools: list[dict[str, t.Any]] | None = None) -> list[int]:
        """What serving feeds the model before it answers ``messages``: the template with the generation
        prompt, tokenized as a whole (the template writes BOS itself, so no special tokens are added)."""
        return list(self.tokenizer(self._text(messages, True, tools), add_special_tokens=False)["input_ids"])

    def check_tools(self, messages: list[dict[str, t.Any]], tools: list[dict[str, t.Any]] | None) -> None:
        """``template-no-tools`` when the record has tools the template ignores: the prompt before the first
        assistant turn reads the same with and without them (a template without tool support drops them
        silently; serving would show the model none, so training on the calls teaches what it never sees)."""
        if not tools:
            return
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        if self._text(messages[:first], True, tools) == self._text(messages[:first], True):
            raise BadRecord("template-no-tools", "the chat template does not render the record's tools")

    def render(
        self,
        messages: list[dict[str, t.Any]],
        *,
        tools: list[dict[str, t.Any]] | None = None,
        max_len: int | None = None,
    ) -> Rendered:
        """Every assistant turn serving shows, in the context it shows it (module doc), with the record's
        ``tools`` (``check_tools``); a turn's tool calls are part of its answer, and a template that leaves
        them out of it is ``template-no-tools``. With ``max_len``
        rendering stops at the first turn whose prompt alone has ``max_len`` tokens: none of its tokens, nor
        of any later turn's (whose prompt holds this one), survives the cut to ``max_len``, and rendering
        them would cost the square of the turns."""
        self.check_tools(messages, tools)
        out = Rendered([])
        ids: list[int] = []
        mask: list[int] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._text(messages[:i], True, tools)
            full = self._text(messages[: i + 1], False, tools)
            if not full.startswith(prompt):
                out.dropped_turns += 1  # serving never shows this turn after that prompt
                continue
            answer = full[len(prompt) :]
            for call in m.get("tool_calls") or ():
                if call["function"]["name"] not in answer:
                    raise BadRecord("template-no-tools", "the chat template does not render tool calls")
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
    tools = tools_of(rec)
    if renderer is None:
        raise BadRecord("no-tokenizer", "a chat record needs the target's tokenizer (--config or --tokenizer)")
    rendered = renderer.render(msgs, tools=tools, max_len=max_len)
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
    "split_tool_calls",
    "tool_calls_of",
    "tools_of",
    "parse_record",
    "pretokenized",
    "record_sequences",
    "load_tokenizer",
    "template_hash",
    "tokenizer_hash",
]
