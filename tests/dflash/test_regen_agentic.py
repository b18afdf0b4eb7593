"""`dflash regen` keeps the agentic turns: the record's tools in every prompt (hf: rendered by the template;
openai: ``tools`` + ``tool_choice``), the target's own tool calls, the record's tool results, and the rule for a
regenerated call that no longer matches the recorded result (the conversation ends after it, counted)."""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest
from test_chat_records import CALL_JSON, HERMES, PLAN_TOOL, RESULT
from test_regen import KWARGS, MAX_NEW, Scripted, completion, dflash_main, make_target, openai, write_config

from testkit.chat_templates import QWEN3_TOOLS

pytestmark = pytest.mark.timeout(300)

PLAIN = {"id": 2, "messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "old"}]}
CHANGED = {**HERMES, "id": 3, "conversations": [*HERMES["conversations"][:1], {"from": "human", "value": "and bye"},
                                               *HERMES["conversations"][2:]]}  # fmt: skip


@pytest.fixture(scope="module")
def tools_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_regen's tiny target with a Qwen3-shaped tool template."""
    from transformers import AutoTokenizer

    path = make_target(tmp_path_factory.mktemp("agentic") / "target")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN3_TOOLS
    tok.save_pretrained(path)
    return path


def regen_args(target: Path, tmp_path: Path, src: Path) -> list[str]:
    """A max_length that holds Qwen3's tools header in this small vocabulary."""
    cfg = write_config(tmp_path / "run.toml", target, max_length=1024)
    return ["regen", "--config", str(cfg), "--in", str(src), "--out", str(tmp_path / "new.jsonl")]


def write(path: Path, recs: list[dict[str, t.Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def call(args: dict[str, t.Any], cid: str = "srv") -> dict[str, t.Any]:
    return {"id": cid, "type": "function", "function": {"name": "get_plan", "arguments": json.dumps(args)}}


def test_openai_backend_sends_tools_and_keeps_matching_calls_and_results(
    tools_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hermes = {**HERMES, "id": 1}

    def server(body: dict[str, t.Any]) -> tuple[int, t.Any]:
        last = body["messages"][-1]
        if last["role"] == "tool" or "tools" not in body:
            return 200, completion("the plan is ok")
        day = "today" if "today" in last["content"] else "tomorrow"  # CHANGED's user asks otherwise: another call
        msg = {"role": "assistant", "content": None, "tool_calls": [call({"day": day})]}
        return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}]}

    srv = Scripted(server)
    src = write(tmp_path / "raw.jsonl", [hermes, PLAIN, CHANGED])
    try:
        rc, out, err = dflash_main(capsys, *regen_args(tools_target, tmp_path, src), *openai(srv))
    finally:
        srv.shutdown()
    assert rc == 0, err
    tooled = [b for b in srv.bodies if "tools" in b]
    assert len(tooled) == 3 and all(b["tools"] == [PLAN_TOOL] and b["tool_choice"] == "auto" for b in tooled)
    assert len(srv.bodies) == 4, "PLAIN has no tools: none sent"
    second = next(b for b in tooled if b["messages"][-1]["role"] == "tool")
    assert second["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"day": "today"}', (
        "JSON text on the wire"
    )
    assert second["messages"][3] == {"role": "tool", "content": RESULT}, "the record's tool result, sent as it was"
    recs = {r["id"]: r for r in map(json.loads, (tmp_path / "new.jsonl").read_text().splitlines())}
    got = recs[1]["messages"]
    assert got[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_plan", "arguments": {"day": "today"}}, "id": "srv"}]}  # fmt: skip
    assert got[3] == {"role": "tool", "content": RESULT} and got[4]["content"] == "the plan is ok"
    assert recs[1]["tools"] == HERMES["tools"], "the tools column stays for prepare-data"
    # CHANGED: the target calls with other arguments than the record's: the recorded result answers another call
    assert [m["role"] for m in recs[3]["messages"]] == ["system", "user", "assistant"]
    assert recs[3]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"day": "tomorrow"}
    assert "regen: 3 records -> 3 written, 4 assistant turns regenerated" in out
    assert "regen: 2 regenerated turns call tools" in out
    assert "regen: 1 conversations end after a regenerated turn whose tool calls are not the record's" in out
    # prepare-data renders the regenerated corpus: the calls supervised, the results masked
    rc, out, err = dflash_main(
        capsys, "prepare-data", "--tokenizer", str(tools_target), "--template-kwargs", json.dumps(KWARGS),
        "--in", str(tmp_path / "new.jsonl"), "--out", str(tmp_path / "store"),
    )  # fmt: skip
    assert rc == 0 and "dropped" not in out, out + err


def test_hf_backend_renders_the_tools_into_the_prompt_and_cuts_at_a_changed_call(
    tools_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from dflash.data.chat import load_tokenizer, messages_of, tools_of
    from dflash.model.target import TargetModel

    hermes = {**HERMES, "id": 1}
    src = write(tmp_path / "raw.jsonl", [hermes, PLAIN])
    rc, out, err = dflash_main(
        capsys, *regen_args(tools_target, tmp_path, src), "--max-new-tokens", str(MAX_NEW), "--batch-size", "2"
    )
    assert rc == 0, err
    recs = [json.loads(line) for line in (tmp_path / "new.jsonl").read_text().splitlines()]
    # the random target writes no call where the record has one: its answer is kept, the tool turn that
    # answered the record's call is not
    assert [m["role"] for m in recs[0]["messages"]] == ["system", "user", "assistant"]
    assert "regen: 1 conversations end after a regenerated turn whose tool calls are not the record's" in out
    tok = load_tokenizer(str(tools_target))
    tm = TargetModel.from_pretrained(str(tools_target), dtype=torch.float32, layer_ids=[0])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    msgs = messages_of(hermes)
    text = tok.apply_chat_template(
        msgs[:2], tools=tools_of(hermes), add_generation_prompt=True, tokenize=False, **KWARGS
    )
    assert "<tools>" in text
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    new = tm.generate_greedy(ids, MAX_NEW, stop_token_ids=[eos])[0, ids.shape[1] :].tolist()
    want = tok.decode([x for x in new if x != eos], skip_special_tokens=True)
    assert recs[0]["messages"][2] == {"role": "assistant", "content": want}, "greedy from the prompt with the tools"
    assert len(recs[1]["messages"]) == 2 and "changed" not in out


def test_a_regenerated_text_with_tool_call_blocks_is_split_as_a_tool_parser_does() -> None:
    from dflash.data.regen import Answer, _regenerated

    old = messages_of_hermes_call()
    text = f"<think>\nok\n</think>\n\n<tool_call>\n{CALL_JSON}\n</tool_call>"
    new = _regenerated(old, Answer(text, cut=False), [PLAN_TOOL])
    assert new["content"] == "<think>\nok\n</think>" and new["tool_calls"][0]["function"]["arguments"] == {
        "day": "today"
    }
    assert _regenerated(old, Answer(text, cut=False), None) == {"role": "assistant", "content": text}, "no tools: text"


def messages_of_hermes_call() -> dict[str, t.Any]:
    from dflash.data.chat import messages_of

    return messages_of(HERMES)[2]
