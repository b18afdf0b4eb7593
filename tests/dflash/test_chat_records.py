"""What a chat record may hold (tool calls, tool results, reasoning, content parts; the shapes public datasets
store them in) and how each reaches the chat template: as vLLM and SGLang pass a request's, so that every
supervised token follows exactly the context serving shows. Real tokenizers (test_prepare_data's byte-level
BPE) with plain ChatML (no tools), the tiny target's template and Qwen3- and Llama-3.1-shaped tool templates
(testkit.chat_templates).
"""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest
from test_prepare_data import check_matches_serving, make_tokenizer, run_main

from dflash.data.chat import BadRecord, Renderer, messages_of, record_sequences, tools_of
from dflash.data.store import TokenStore
from dflash.data.tiny import CHAT_TEMPLATE
from testkit.chat_templates import CHATML, LLAMA31_TOOLS, QWEN3_TOOLS

pytestmark = pytest.mark.timeout(240)

PLAN_TOOL = {
    "type": "function",
    "function": {
        "name": "get_plan",
        "description": "the plan for a day",
        "parameters": {"type": "object", "properties": {"day": {"type": "string"}}, "required": ["day"]},
    },
}
CALL_JSON = '{"name": "get_plan", "arguments": {"day": "today"}}'
RESULT = '{"plan": "hello there"}'

# Rows in the shapes of the public datasets (our own words)
SHAREGPT = {
    "id": "sg-1",
    "conversations": [
        {"from": "system", "value": "let me think"},
        {"from": "human", "value": "hello there"},
        {"from": "gpt", "value": "how are you"},
        {"from": "human", "value": "fine thanks"},
        {"from": "gpt", "value": "ok bye"},
    ],
}
ULTRACHAT = {
    "prompt": "what is the plan",
    "prompt_id": "0f3a",
    "messages": [
        {"role": "user", "content": "what is the plan"},
        {"role": "assistant", "content": "let me think about it"},
        {"role": "user", "content": "sure"},
        {"role": "assistant", "content": "the plan is today"},
    ],
}
HERMES = {  # hermes-function-calling-v1: tools a JSON string, calls and results as tagged text
    "id": "hm-1",
    "category": "Planning",
    "tools": json.dumps([PLAN_TOOL]),
    "conversations": [
        {"from": "system", "value": "you may call tools"},
        {"from": "human", "value": "what is the plan today"},
        {"from": "gpt", "value": f"<tool_call>\n{CALL_JSON}\n</tool_call>"},
        {"from": "tool", "value": f"<tool_response>\n{RESULT}\n</tool_response>"},
        {"from": "gpt", "value": "the plan is hello there"},
    ],
}
DOLPHIN = {  # dolphin-r1: the prompt as messages, the reasoning and the answer beside them
    "messages": [{"role": "system", "content": "think first"}, {"role": "user", "content": "how are you"}],
    "model": "r1",
    "reasoning": "let me think about it",
    "answer": "fine thanks",
}
GSM8K = {"question": "what is the plan", "answer": "the plan is today\n#### 42"}
OPENAI_TOOLS = {  # OpenAI chat: arguments as JSON text, two calls in one turn, tool turns with ids
    "tools": [PLAN_TOOL["function"]],  # a bare function: wrapped as serving passes it
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is the plan"}, {"type": "text", "text": "today"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "let me think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_plan", "arguments": '{"day": "today"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_plan", "arguments": {"day": "bye"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_plan", "content": RESULT},
        {"role": "tool", "tool_call_id": "c2", "name": "get_plan", "content": '{"plan": "bye"}'},
        {"role": "assistant", "content": "hello there and bye"},
    ],
}
FACTORY = {  # LLaMA-Factory's sharegpt with tools: function_call / observation turns
    "conversations": [
        {"from": "human", "value": "what is the plan today"},
        {"from": "function_call", "value": CALL_JSON},
        {"from": "observation", "value": RESULT},
        {"from": "gpt", "value": "the plan is hello there"},
    ],
    "tools": json.dumps([PLAN_TOOL["function"]]),
}


@pytest.fixture(scope="module")
def qwen3_tools() -> t.Any:
    return make_tokenizer(QWEN3_TOOLS, "<|im_end|>")


@pytest.fixture(scope="module")
def llama31() -> t.Any:
    return make_tokenizer(LLAMA31_TOOLS, "<|eot_id|>", "<|begin_of_text|>")


@pytest.fixture(scope="module")
def tiny_template() -> t.Any:
    return make_tokenizer(CHAT_TEMPLATE, "<|im_end|>")


@pytest.fixture(scope="module")
def chatml() -> t.Any:
    return make_tokenizer(CHATML, "<|im_end|>")


def spans(tok: t.Any, ids: t.Sequence[int], mask: t.Sequence[int]) -> tuple[list[str], list[str]]:
    """(supervised texts, masked texts) of one sequence, each a maximal run."""
    sup: list[str] = []
    ctx: list[str] = []
    run: list[int] = []
    for p, (i, m) in enumerate(zip(ids, mask)):
        run.append(i)
        if p + 1 == len(ids) or mask[p + 1] != m:
            (sup if m else ctx).append(tok.decode(run))
            run = []
    return sup, ctx


def supervised(tok: t.Any, rec: dict[str, t.Any], kwargs: dict[str, t.Any] | None = None) -> list[list[str]]:
    r = record_sequences(rec, Renderer(tok, kwargs))
    check_matches_serving(tok, kwargs or {}, messages_of(rec), tools=tools_of(rec))
    return [spans(tok, s.input_ids, s.loss_mask)[0] for s in r.sequences]


def context(tok: t.Any, rec: dict[str, t.Any]) -> str:
    return "".join(c for s in record_sequences(rec, Renderer(tok)).sequences for c in spans(tok, *vars_of(s))[1])


def vars_of(s: t.Any) -> tuple[list[int], list[int]]:
    return s.input_ids, s.loss_mask


EMPTY_THINK = "<think>\n\n</think>\n\n"
QWEN_CALL = f"<tool_call>\n{CALL_JSON}\n</tool_call>"


# --------------------------------------------------------------------------------------------
# Records -> messages


def test_tool_calls_reach_the_template_as_serving_passes_them() -> None:
    msgs = messages_of(OPENAI_TOOLS)
    assert msgs[0] == {"role": "user", "content": "what is the plan\ntoday"}, "text parts joined with newlines"
    calls = msgs[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"day": "today"}, {"day": "bye"}], "JSON text parsed"
    assert calls[0] == {"type": "function", "function": {"name": "get_plan", "arguments": {"day": "today"}}, "id": "c1"}
    assert msgs[1]["content"] == "" and msgs[1]["reasoning_content"] == msgs[1]["reasoning"] == "let me think"
    assert msgs[2] == {"role": "tool", "content": RESULT, "tool_call_id": "c1", "name": "get_plan"}
    assert tools_of(OPENAI_TOOLS) == [PLAN_TOOL] == tools_of(HERMES), "a bare function and a JSON string alike"
    hermes = messages_of(HERMES)
    call = {"type": "function", "function": {"name": "get_plan", "arguments": {"day": "today"}}}
    assert hermes[2] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert hermes[3] == {"role": "tool", "content": RESULT}, "the <tool_response> wrapper is the template's to write"
    assert messages_of(FACTORY)[1:3] == hermes[2:4], "function_call / observation read as Hermes' tagged turns"
    assert messages_of(GSM8K) == [
        {"role": "user", "content": GSM8K["question"]},
        {"role": "assistant", "content": GSM8K["answer"]},
    ]
    assert messages_of(DOLPHIN)[-1] == {
        "role": "assistant",
        "content": "fine thanks",
        "reasoning_content": "let me think about it",
        "reasoning": "let me think about it",
    }
    # a gpt turn whose <tool_call> block is not JSON (Python-dict quotes) stays text
    text = "<tool_call>\n{'name': 'get_plan'}\n</tool_call>"
    assert messages_of({"conversations": [{"from": "gpt", "value": text}]})[0] == {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("rec", "reason", "words"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "[{"},
            "bad-tools",
            "tools: not valid JSON",
        ),
        ({"messages": [{"role": "assistant", "content": "y"}], "tools": '{"name": "f"}'}, "bad-tools", "a list"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
                    }
                ]
            },
            "bad-tool-call",
            "arguments: not valid JSON",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "bad-tool-call",
            "expected a JSON object",
        ),
        ({"conversations": [{"from": "function_call", "value": "get_plan(day)"}]}, "bad-tool-call", "not valid JSON"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "see"},
                            {"type": "image_url", "image_url": {"url": "data:"}},
                        ],
                    },
                    {"role": "assistant", "content": "ok"},
                ]
            },
            "media-content",
            "a part of type image_url",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "media-content", "a part of type video"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "bad-turns", "string"),
    ],
)
def test_a_bad_tool_field_or_an_image_drops_the_record_with_a_named_reason(
    rec: dict[str, t.Any], reason: str, words: str
) -> None:
    with pytest.raises(BadRecord) as e:
        messages_of(rec)
        tools_of(rec)
    assert e.value.reason == reason and words in str(e.value), str(e.value)


# --------------------------------------------------------------------------------------------
# Rendering: what is supervised, what is context


def test_hermes_tool_calls_supervised_tool_results_masked_qwen3(qwen3_tools: t.Any) -> None:
    # Qwen3: the call turn is the last one in its own render (an empty think block before the call) but
    # not in the next turn's history: two sequences, each in the context serving shows
    assert supervised(qwen3_tools, HERMES) == [
        [f"{EMPTY_THINK}{QWEN_CALL}<|im_end|>"],
        [f"{EMPTY_THINK}the plan is hello there<|im_end|>"],
    ]
    ctx = context(qwen3_tools, HERMES)
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in ctx, "the tool result is context"
    assert '<tools>\n{"type": "function", "function": {"name": "get_plan"' in ctx, "the tools in the system turn"
    assert supervised(qwen3_tools, FACTORY) == supervised(
        qwen3_tools, {**HERMES, "conversations": HERMES["conversations"][1:]}
    )


def test_two_calls_and_reasoning_in_one_turn_qwen3(qwen3_tools: t.Any) -> None:
    sup = supervised(qwen3_tools, OPENAI_TOOLS)
    two = '<tool_call>\n{"name": "get_plan", "arguments": {"day": "today"}}\n</tool_call>\n<tool_call>\n{"name": "get_plan", "arguments": {"day": "bye"}}\n</tool_call>'
    # the reasoning of a turn after the last user query stays in the history: one sequence, both turns
    assert sup == [
        [f"<think>\nlet me think\n</think>\n\n{two}<|im_end|>", f"{EMPTY_THINK}hello there and bye<|im_end|>"]
    ]
    ctx = context(qwen3_tools, OPENAI_TOOLS)
    assert "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response>\n<tool_response>\n" in ctx


def test_reasoning_per_the_template_and_enable_thinking(qwen3_tools: t.Any, chatml: t.Any) -> None:
    assert supervised(qwen3_tools, DOLPHIN) == [["<think>\nlet me think about it\n</think>\n\nfine thanks<|im_end|>"]]
    # thinking off: serving's prompt closes the think block, so a turn with reasoning never follows it
    r = Renderer(qwen3_tools, {"enable_thinking": False}).render(messages_of(DOLPHIN))
    assert r.dropped_turns == 1 and not r.sequences
    assert supervised(qwen3_tools, GSM8K, {"enable_thinking": False}) == [[GSM8K["answer"] + "<|im_end|>"]]
    # a template that shows no reasoning: the answer alone
    assert supervised(chatml, DOLPHIN) == [["fine thanks<|im_end|>"]]


def test_llama31_one_call_per_turn_and_ipython_results(llama31: t.Any) -> None:
    assert supervised(llama31, HERMES) == [
        ['{"name": "get_plan", "parameters": {"day": "today"}}<|eot_id|>', "the plan is hello there<|eot_id|>"]
    ], "one sequence: each rendering is a prefix of the next"
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"plan\\": ' in context(llama31, HERMES)
    with pytest.raises(BadRecord) as e:  # the template's own raise_exception: a named drop, not a traceback
        record_sequences(OPENAI_TOOLS, Renderer(llama31))
    assert e.value.reason == "template-error" and "single tool-calls" in str(e.value)


def test_a_template_without_tool_support_is_a_named_drop(chatml: t.Any, tiny_template: t.Any) -> None:
    for rec in (HERMES, FACTORY, OPENAI_TOOLS):
        with pytest.raises(BadRecord) as e:
            record_sequences(rec, Renderer(chatml))
        assert e.value.reason == "template-no-tools"
    calls_only = {"messages": [m for m in OPENAI_TOOLS["messages"]]}  # no tools: the calls are still lost
    with pytest.raises(BadRecord, match="does not render tool calls"):
        record_sequences(calls_only, Renderer(chatml))
    # make-tiny's template has tools in Qwen3's shape (the call's name and argument values as words)
    assert supervised(tiny_template, HERMES) == [
        ["<tool_call> get_plan today </tool_call><|im_end|>", "the plan is hello there<|im_end|>"]
    ]
    assert "<|im_start|>user\n<tool_response> " + RESULT + " </tool_response>\n" in context(tiny_template, HERMES)


# --------------------------------------------------------------------------------------------
# Through prepare-data


ROWS = [SHAREGPT, ULTRACHAT, HERMES, DOLPHIN, GSM8K, OPENAI_TOOLS, FACTORY]


def test_public_dataset_rows_through_prepare_data(
    tmp_path: Path, qwen3_tools: t.Any, chatml: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """One mixed file: ShareGPT, UltraChat, Hermes, Dolphin-R1, GSM8K, OpenAI tool calls, LLaMA-Factory, a
    pre-tokenized row, CRLF line ends, a tools column that is not JSON and an image: every record is
    rendered or counted under a named reason; the store's supervised tokens are exactly the assistant's."""
    bad_tools = {**ULTRACHAT, "tools": "[{'name': 'get_plan'}]"}
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    lines = [json.dumps(r) for r in ROWS] + [
        json.dumps({"input_ids": [5, 6, 7]}),
        json.dumps(bad_tools),
        json.dumps(image),
    ]
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    for name, tok in (("qwen3", qwen3_tools), ("chatml", chatml)):
        tok.save_pretrained(tmp_path / name)
        rc, out, err = run_main(
            capsys,
            "prepare-data",
            "--tokenizer",
            str(tmp_path / name),
            "--in",
            str(src),
            "--out",
            str(tmp_path / f"s-{name}"),
        )
        assert rc == 0, err
        assert "dropped 1 bad-tools: tools: not valid JSON" in out and "(line 9)" in out
        assert "dropped 1 media-content: turn 0.content: a part of type image_url" in out and "(line 10)" in out
        store = TokenStore(tmp_path / f"s-{name}")
        got = []
        for i in range(len(store)):
            ids, mask = store.read(i)
            got.append(spans(tok, ids.tolist(), mask.tolist())[0])
        want: list[list[str]] = []
        for rec in ROWS:
            try:
                r = record_sequences(rec, Renderer(tok))
            except BadRecord as e:
                assert name == "chatml" and e.reason == "template-no-tools"
                continue
            want += [spans(tok, s.input_ids, s.loss_mask)[0] for s in r.sequences]
        want.append([tok.decode([5, 6, 7])])
        assert got == want
        meta = json.loads((tmp_path / f"s-{name}" / "meta.json").read_text())
        assert meta["counts"]["records"] == 10
        if name == "chatml":  # three tool-calling records: the template has no tools
            assert (
                "dropped 3 template-no-tools: the chat template does not render the record's tools (line 3, 6, 7)"
                in out
            )
            assert meta["counts"]["dropped"] == 5
        else:
            assert meta["counts"]["dropped"] == 2
            flat = [s for seq in got for s in seq]
            for text in (
                f"{EMPTY_THINK}{QWEN_CALL}<|im_end|>",
                "<think>\nlet me think about it\n</think>\n\nfine thanks<|im_end|>",
                f"{EMPTY_THINK}{GSM8K['answer']}<|im_end|>",
                f"{EMPTY_THINK}how are you<|im_end|>",
                f"{EMPTY_THINK}the plan is today<|im_end|>",
            ):
                assert text in flat, text
            assert not any(RESULT in s for s in flat), "no tool result is supervised"


def test_eval_chat_prompts_carry_the_record_s_tools(tmp_path: Path, qwen3_tools: t.Any) -> None:
    from dflash.eval.evaluate import load_prompts

    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps(HERMES) + "\n")
    (ids,) = load_prompts(src, renderer=Renderer(qwen3_tools))
    assert ids == Renderer(qwen3_tools).prompt_ids(messages_of(HERMES)[:2], tools_of(HERMES))
    assert "<tools>" in qwen3_tools.decode(ids), "served with its tools: the eval prompt holds them too"


def test_the_same_rows_as_a_json_array_make_the_same_store(
    tmp_path: Path, qwen3_tools: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    qwen3_tools.save_pretrained(tmp_path / "tok")
    bad_tools = {**ULTRACHAT, "tools": "not json"}
    stores = []
    for name, text in (
        ("lines", "".join(json.dumps(r) + "\n" for r in [*ROWS, bad_tools])),
        ("array", json.dumps([*ROWS, bad_tools], indent=1)),
    ):
        src = tmp_path / f"{name}.json"
        src.write_text(text)
        rc, out, err = run_main(
            capsys,
            "prepare-data",
            "--tokenizer",
            str(tmp_path / "tok"),
            "--in",
            str(src),
            "--out",
            str(tmp_path / name),
        )
        assert rc == 0 and "dropped 1 bad-tools" in out and "(line 8)" in out, out + err
        store = TokenStore(tmp_path / name)
        stores.append([(a.tolist(), b.tolist()) for a, b in (store.read(i) for i in range(len(store)))])
    assert stores[0] == stores[1] and len(stores[0]) == 11
