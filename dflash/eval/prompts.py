"""The prompts file of ``dflash eval`` and ``dflash bench serve``: JSON lines or a JSON array of token, training
or chat records, each read by ``dflash.inputs`` (bounded, finite, text), a bad one an ``EvalError`` naming its
line. No torch here: ``dflash bench serve`` reads its prompts with these and never loads a model (importing
``dflash.eval.evaluate`` for them cost every bench serve ~5 s of CPU in torch and transformers imports).
"""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.data.chat import BadRecord, Renderer, messages_of, tools_of
from dflash.errors import InputError


class EvalError(InputError, ValueError):
    """The evaluation cannot run as asked (a missing file, a bad prompt); the message names it."""


def prompt_messages(rec: t.Mapping[str, t.Any]) -> list[dict[str, str]]:
    """A chat record's prompt: its turns before the first assistant turn (all of them when it has none);
    it must hold a user turn. ``BadRecord`` when it is not usable."""
    msgs = messages_of(rec, need_assistant=False)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    msgs = msgs[:first]
    if not any(m["role"] == "user" for m in msgs):
        raise BadRecord("no-user", "no user turn before the first assistant turn")
    return msgs


def starts_with_tool_call(rec: t.Mapping[str, t.Any]) -> bool:
    """Whether a chat record's reference answer (its first assistant turn, the one its prompt asks for) opens
    with a tool call: tool calls and no text before them (reasoning aside: a reasoning parser takes it off
    what the client sees). Such a prompt's tau is reported on its own (``EvalReport.tool_call_tau``)."""
    try:
        msgs = messages_of(rec, need_assistant=False)
    except BadRecord:
        return False
    answer = next((m for m in msgs if m["role"] == "assistant"), None)
    return answer is not None and bool(answer.get("tool_calls")) and not str(answer.get("content") or "").strip()


def read_records(text: str, path: Path) -> t.Iterator[tuple[str, t.Any]]:
    """(where, record) of JSON lines, or of a JSON array (as prepare-data reads both); every record read by
    ``inputs.loads`` (bounded, finite, text), a bad one an EvalError naming its line."""
    if text.lstrip().startswith("["):
        try:
            items = inputs.loads(text)
        except inputs.JsonProblem as e:
            raise EvalError(f"--prompts {path}: not a JSON array of records ({e.detail})") from None
        for k, rec in enumerate(items):
            yield f"{path} record {k}", rec
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = inputs.loads(line)
        except inputs.JsonProblem as e:
            what = "not text" if e.reason == "bad-text" else "not JSON"
            raise EvalError(f"{path} line {lineno}: {what} ({e.detail})") from None
        yield f"{path} line {lineno}", rec


def load_prompts(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    vocab_size: int | None = None,
    renderer: Renderer | None = None,
    tool_call_at: list[int] | None = None,
) -> list[list[int]]:
    """Prompts from JSONL (or a JSON array), in prepare-data's formats: ``{"input_ids": [...]}`` is a
    whole prompt, a training record (with a ``loss_mask``) contributes the tokens before its first
    supervised one; a chat record (OpenAI ``messages`` or ShareGPT ``conversations``) contributes its turns
    before the first assistant turn, rendered by ``renderer`` (``--chat``: the target's chat template).
    ``tool_call_at`` (when given) receives the indices of the chat prompts whose reference answer starts
    with a tool call (``starts_with_tool_call``)."""
    path = Path(path)
    try:  # a regular file: a FIFO would block here
        text = inputs.read_text(path, "--prompts")
    except inputs.InputFileError as e:
        raise EvalError(str(e)) from None
    prompts: list[list[int]] = []
    for where, rec in read_records(text, path):
        if isinstance(rec, dict) and ("messages" in rec or "conversations" in rec) and "input_ids" not in rec:
            if renderer is None:
                raise EvalError(f"{where}: a chat record: give --chat to render it with the target's chat template")
            try:
                ids = renderer.prompt_ids(prompt_messages(rec), tools_of(rec))  # the record's tools, as served
            except BadRecord as e:
                raise EvalError(f"{where}: {e}") from None
            if not ids:
                raise EvalError(f"{where}: the chat template renders an empty prompt")
            if tool_call_at is not None and starts_with_tool_call(rec):
                tool_call_at.append(len(prompts))
        else:
            if renderer is not None and isinstance(rec, dict) and "input_ids" in rec:
                raise EvalError(
                    f"{where}: pre-tokenized input_ids cannot be rendered with --chat "
                    "(give chat records, or leave --chat out)"
                )
            ids = token_prompt(rec, where)
        if vocab_size is not None and max(ids) >= vocab_size:
            raise EvalError(f"{where}: input_ids: token {max(ids)} is outside the target vocabulary ({vocab_size})")
        prompts.append(ids)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise EvalError(f"--prompts: no prompts in {path}")
    return prompts


def token_prompt(rec: t.Any, where: str) -> list[int]:
    ids = rec.get("input_ids") if isinstance(rec, dict) else None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)
    ):
        raise EvalError(f"{where}: input_ids: expected a non-empty list of token ids")
    mask = rec.get("loss_mask")
    if isinstance(mask, list) and 1 in mask:
        ids = ids[: mask.index(1)]
        if not ids:
            raise EvalError(f"{where}: loss_mask: the first token is supervised, so there is no prompt")
    return list(ids)
