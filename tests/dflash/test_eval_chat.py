"""`dflash eval --chat --prompts FILE --max-new N`: prompts rendered as serving renders them, decoding that
stops at EOS, and a report that records how it was measured.

A tiny real target (random init, saved as a HF folder) carries a real tokenizer with the Qwen3-like chat
template of test_prepare_data (think blocks, ``enable_thinking``); the drafter is the untrained one of a
run config, which is enough: speculative decoding must reproduce the target's greedy output whatever it
drafts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import typing as t
from pathlib import Path

import pytest
import torch
from test_prepare_data import QWEN3, make_tokenizer

from dflash.__main__ import main
from dflash.eval.evaluate import evaluate, load_setup
from dflash.eval.plot import protocol_diff, protocol_warning
from dflash.model.target import TargetModel, tiny_target_config

pytestmark = pytest.mark.timeout(300)

KWARGS = {"enable_thinking": False}
MULTI = {
    "messages": [
        {"role": "system", "content": "let me think"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "<think>what is the plan</think>how are you"},
        {"role": "user", "content": "fine thanks"},
        {"role": "assistant", "content": "ok bye"},
    ]
}
SHAREGPT = {"conversations": [{"from": "human", "value": "what is the plan today"}, {"from": "gpt", "value": "sure"}]}
USER_ONLY = {"messages": [{"role": "user", "content": "how are you"}]}


class Tiny(t.NamedTuple):
    root: Path
    target: Path  # HF folder: config.json, weights, tokenizer with a chat template
    config: Path  # run config: that target, an untrained 1-layer drafter, enable_thinking = false
    tokenizer: t.Any


def write_config(path: Path, target: Path, kwargs: str = "{enable_thinking = false}") -> Path:
    path.write_text(
        f'[target]\npath = "{target}"\ndtype = "float32"\n[drafter]\nlayers = 1\nblock_size = 4\ndtype = "float32"\n'
        f'[data]\npath = "{target}/unused.jsonl"\nchat_template_kwargs = {kwargs}\n'
    )
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    root = tmp_path_factory.mktemp("evalchat")
    tok = make_tokenizer(QWEN3, "<|im_end|>")
    cfg = tiny_target_config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=0.5,
    )  # a wide init: varied greedy text, not one repeated token
    tm = TargetModel.from_config(cfg, dtype=torch.float32, seed=3, num_draft_layers=1)
    tm.model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return Tiny(root, root / "target", write_config(root / "run.toml", root / "target"), tok)


def write_jsonl(path: Path, records: t.Sequence[t.Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def served(tok: t.Any, messages: list[dict[str, str]], **kwargs: t.Any) -> list[int]:
    """What a serving engine feeds the model: apply_chat_template with the generation prompt, tokenized."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    direct = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    direct = direct["input_ids"] if isinstance(direct, t.Mapping) else direct
    assert list(direct) == list(ids)  # transformers tokenizes the rendered text the same way
    return list(ids)


def test_chat_prompts_are_what_the_chat_template_renders_up_to_the_first_assistant_turn(tiny: Tiny) -> None:
    jsonl = write_jsonl(tiny.root / "prompts.jsonl", [MULTI, SHAREGPT, USER_ONLY])
    s = load_setup(drafter=None, untrained=True, config=str(tiny.config), prompts=str(jsonl), chat=True)
    tok = tiny.tokenizer
    expected = [
        served(tok, MULTI["messages"][:2], **KWARGS),  # system + first user turn
        served(tok, [{"role": "user", "content": "what is the plan today"}], **KWARGS),
        served(tok, USER_ONLY["messages"], **KWARGS),
    ]
    assert s.prompts == expected
    assert tok.decode(s.prompts[2]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    # the same records as a JSON array give the same prompts
    array = tiny.root / "prompts.json"
    array.write_text(json.dumps([MULTI, SHAREGPT, USER_ONLY]))
    assert (
        load_setup(drafter=None, untrained=True, config=str(tiny.config), prompts=str(array), chat=True).prompts
        == expected
    )
    # --template-kwargs overrides the run's: thinking on renders no empty think block
    on = load_setup(
        drafter=None,
        untrained=True,
        config=str(tiny.config),
        prompts=str(jsonl),
        chat=True,
        template_kwargs='{"enable_thinking": true}',
    )
    assert on.prompts[2] == served(tok, USER_ONLY["messages"], enable_thinking=True) != expected[2]

    p = s.protocol(2048)
    assert p["prompt_format"] == "chat" and p["chat_template_kwargs"] == KWARGS
    assert p["chat_template_sha256"] == hashlib.sha256(QWEN3.encode()).hexdigest()
    assert p["prompts_sha256"] == hashlib.sha256(jsonl.read_bytes()).hexdigest()
    assert p["prompts_source"] == str(jsonl.resolve()) and p["num_prompts"] == 3
    assert p["stop_at_eos"] is True and tok.convert_tokens_to_ids("<|im_end|>") in p["stop_token_ids"]
    assert (p["max_new_tokens"], p["decoding"], p["temperature"], p["block_size"]) == (2048, "greedy", 0.0, 4)
    assert (p["target_dtype"], p["drafter_dtype"]) == ("float32", "float32")
    assert on.protocol(2048)["chat_template_kwargs"] == {"enable_thinking": True}


def first_new_token(seq: list[int]) -> int:
    """The first position (> 1) whose token was not produced before it."""
    return next(i for i in range(2, len(seq)) if seq[i] not in seq[:i])


def test_both_decodes_stop_at_eos_and_the_figures_count_what_was_committed(tiny: Tiny) -> None:
    jsonl = write_jsonl(tiny.root / "stop.jsonl", [MULTI, USER_ONLY])
    s = load_setup(drafter=None, untrained=True, config=str(tiny.config), prompts=str(jsonl), chat=True)
    free = evaluate(
        s.target,
        s.drafter,
        s.prompts,
        max_new_tokens=24,
        ddtree_budget=None,  # no stop tokens
        protocol=s.prompt_protocol,
    )
    assert free.all_equal and [len(o) for o in free.outputs] == [24, 24]
    assert free.protocol["stop_at_eos"] is False and free.lines()[2].endswith("24 new tokens each, block size 4")
    first = free.outputs[0]
    cut = first_new_token(first)
    stop = first[cut]
    rep = evaluate(
        s.target,
        s.drafter,
        s.prompts,
        max_new_tokens=2048,
        ddtree_budget=4,
        stop_token_ids=[stop],
        protocol=s.prompt_protocol,
    )
    assert rep.all_equal, rep.mismatched_prompts  # the greedy reference stopped at the same token
    assert rep.outputs[0] == first[: cut + 1]  # up to and including the stop token
    assert all(len(o) < 2048 for o in rep.outputs)
    assert all(o[-1] == stop and stop not in o[:-1] for o in rep.outputs if len(o) < 2048)
    # every verify step yields accepted + 1 tokens: nothing past the stop token is counted
    assert sum((k + 1) * n for k, n in enumerate(rep.accept_histogram)) == rep.new_tokens - len(s.prompts)
    assert rep.new_tokens == sum(len(o) for o in rep.outputs)
    assert rep.protocol["stop_at_eos"] is True and rep.protocol["stop_token_ids"] == [stop]
    assert rep.protocol["prompt_format"] == "chat" and rep.protocol["max_new_tokens"] == 2048
    assert "up to 2048 new tokens each (stop at EOS)" in rep.lines()[2]
    assert rep.lines()[3].startswith("chat template: sha256 ") and '{"enable_thinking": false}' in rep.lines()[3]
    assert protocol_diff(free.protocol, rep.protocol) == [
        "max_new_tokens 24 -> 2048",
        "stop_at_eos false -> true",
        f"stop_token_ids [] -> [{stop}]",
    ]


@torch.no_grad()
def test_a_stop_token_inside_an_accepted_block_ends_the_count_there(tiny: Tiny) -> None:
    """The drafter drafts token 0 everywhere (its final norm zeroed: zero hidden, zero logits, argmax 0) and
    the target says 0 where it would have said a later token t: that 0 is an accepted draft with more
    accepted drafts after it. With 0 as EOS the step yields one token, not 1 + accepted."""
    jsonl = write_jsonl(tiny.root / "block.jsonl", [USER_ONLY])
    s = load_setup(drafter=None, untrained=True, config=str(tiny.config), prompts=str(jsonl), chat=True)
    free = evaluate(s.target, s.drafter, s.prompts, max_new_tokens=16, ddtree_budget=None)
    cut = first_new_token(free.outputs[0])
    later = free.outputs[0][cut]
    assert 0 not in free.outputs[0][:cut]
    s.drafter.norm.weight.zero_()
    lm_head = s.target.model.lm_head.weight
    lm_head[0] = lm_head[later] * 1.01  # beats `later` wherever it wins (a positive logit)
    lm_head[later] = 0.0
    zeros = evaluate(s.target, s.drafter, s.prompts, max_new_tokens=16, ddtree_budget=None)
    assert zeros.outputs[0][:cut] == free.outputs[0][:cut] and zeros.outputs[0][cut] == 0
    assert zeros.accept_histogram[1:] != [0] * 3, "some step accepted drafts (of token 0)"
    rep = evaluate(s.target, s.drafter, s.prompts, max_new_tokens=16, ddtree_budget=4, stop_token_ids=[0])
    assert rep.all_equal and rep.outputs[0] == free.outputs[0][:cut] + [0]
    assert rep.accept_histogram[1:] == [0, 0, 0]  # the stop step yields 1 token though it accepted more drafts
    assert rep.steps == cut and rep.tau == 1.0 and rep.per_prompt_tau == [1.0]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["eval", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_stops_at_the_targets_eos_and_writes_the_protocol(
    tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = write_jsonl(tmp_path / "p.jsonl", [USER_ONLY])
    cfg = str(tiny.config)
    rc, out, err = run_cli(
        capsys,
        "--untrained",
        "--config",
        cfg,
        "--prompts",
        str(jsonl),
        "--chat",
        "--max-new",
        "16",
        "--ignore-eos",
        "--ddtree-budget",
        "0",
        "--json",
        str(tmp_path / "free.json"),
    )
    assert rc == 0, err
    free = json.loads((tmp_path / "free.json").read_text())
    assert free["protocol"]["stop_at_eos"] is False and len(free["outputs"][0]) == 16
    cut = first_new_token(free["outputs"][0])
    stop = free["outputs"][0][cut]
    # a target whose generation config names that token as EOS (as Qwen3's names <|im_end|>)
    target = tmp_path / "target"
    shutil.copytree(tiny.target, target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    run = write_config(tmp_path / "run.toml", target)
    rc, out, err = run_cli(
        capsys,
        "--untrained",
        "--config",
        str(run),
        "--prompts",
        str(jsonl),
        "--chat",
        "--max-new",
        "2048",
        "--json",
        str(tmp_path / "eos.json"),
        "--strict",
        "--ddtree-budget",
        "0",
        "--plot",
        str(tmp_path / "eval.png"),
        "--compare",
        str(tmp_path / "free.json"),
    )
    assert rc == 0, err
    rep = json.loads((tmp_path / "eos.json").read_text())
    assert rep["outputs"][0] == free["outputs"][0][: cut + 1] and rep["all_equal"] is True
    assert "output identical to plain greedy decoding: yes (1/1 prompts)" in out
    assert stop in rep["protocol"]["stop_token_ids"] and rep["max_new_tokens"] == 2048  # existing keys stay
    for key in ("tau", "accept_histogram", "position_acceptance", "target_equal", "outputs", "num_prompts", "prompts"):
        assert key in rep
    # --compare says in one line that the two were not measured the same way
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith(
        f"dflash: warning: --compare {tmp_path / 'free.json'} was measured differently (max_new_tokens 16 -> 2048; "
    )
    assert "stop_at_eos false -> true" in warning[0] and (tmp_path / "eval.png").stat().st_size > 0
    # the same protocol: no warning
    assert protocol_warning(rep, rep["protocol"], "x.json") is None
    assert "records no protocol" in str(protocol_warning({"tau": 1.0}, rep["protocol"], "old.json"))


def test_bad_input_is_one_line_and_exit_2(tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(tiny.config)
    chat = write_jsonl(tmp_path / "chat.jsonl", [USER_ONLY])
    tokens = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [1, 2, 3]}])
    (tmp_path / "empty.jsonl").write_text("\n")
    no_user = write_jsonl(
        tmp_path / "no_user.jsonl",
        [
            USER_ONLY,
            {
                "messages": [
                    {"role": "system", "content": "hi"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "x"},
                ]
            },
        ],
    )
    bad_role = write_jsonl(tmp_path / "bad_role.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    cases = [
        (
            ["--prompts", str(tmp_path / "missing.jsonl"), "--chat"],
            f"dflash: --prompts: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory",
        ),
        (
            ["--prompts", str(tmp_path / "empty.jsonl"), "--chat"],
            f"dflash: --prompts: no prompts in {tmp_path / 'empty.jsonl'}",
        ),
        (
            ["--prompts", str(no_user), "--chat"],
            f"dflash: {no_user} line 2: no user turn before the first assistant turn",
        ),
        (["--prompts", str(bad_role), "--chat"], f"dflash: {bad_role} line 1: turn 0: unknown role 'robot'"),
        (
            ["--prompts", str(chat)],
            f"dflash: {chat} line 1: a chat record: give --chat to render it with the target's chat template",
        ),
        (
            ["--prompts", str(tokens), "--chat"],
            f"dflash: {tokens} line 1: pre-tokenized input_ids cannot be rendered "
            "with --chat (give chat records, or leave --chat out)",
        ),
        (
            ["--prompts", str(chat), "--chat", "--max-new", "4096"],
            "dflash: --max-new: expected 1 to 2048 new tokens, got 4096",
        ),
        (["--prompts", str(chat), "--max-new", "0"], "dflash: --max-new: expected 1 to 2048 new tokens, got 0"),
        (
            ["--prompts", str(chat), "--chat", "--template-kwargs", "{nope"],
            "dflash: --template-kwargs: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (["--prompts", str(chat), "--template-kwargs", "{}"], "dflash: --template-kwargs goes with --chat or --suite"),
    ]
    for args, line in cases:
        rc, out, err = run_cli(capsys, "--untrained", "--config", cfg, *args)
        assert (rc, err.splitlines()) == (2, [line]), args
        assert out == ""
    # a target folder without a chat template
    bare = tmp_path / "bare"
    shutil.copytree(tiny.target, bare)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    for extra in bare.glob("chat_template*"):
        extra.unlink()
    rc, _, err = run_cli(
        capsys,
        "--untrained",
        "--config",
        str(write_config(tmp_path / "bare.toml", bare)),
        "--prompts",
        str(chat),
        "--chat",
    )
    assert (rc, err.splitlines()) == (2, [f"dflash: --chat: the tokenizer in {bare} has no chat template"])
    # a target that cannot hold the longest prompt + --max-new positions: said before decoding
    short = tmp_path / "short"
    shutil.copytree(tiny.target, short)
    conf = json.loads((short / "config.json").read_text())
    conf["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(conf))
    rc, _, err = run_cli(
        capsys,
        "--untrained",
        "--config",
        str(write_config(tmp_path / "short.toml", short)),
        "--prompts",
        str(chat),
        "--chat",
        "--max-new",
        "60",
    )
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("dflash: --max-new: the longest prompt has ") and err.rstrip().endswith(
        "passes the target's max_position_embeddings (64)"
    )


# ---- tried as a hostile user would ---------------------------------------


HOSTILE = ["surrogate", "deep-prompts", "config-abc", "config-negative", "config-deep", "json-ro", "plot-ro"]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_prompts_drafters_and_outputs_are_one_line_before_any_decoding(
    tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """A lone surrogate in a chat prompt was the tokenizer's TypeError; prompts or a drafter config.json
    nested 100000 deep a RecursionError; a published drafter's config.json with `hidden_size: "abc"` a
    traceback; an unwritable --json or --plot failed only after the whole eval."""
    from test_prepare_data import unwritable

    from dflash.model.drafter import DFlashDraftModel, draft_config_for

    cfg = str(tiny.config)
    chat = str(write_jsonl(tmp_path / "chat.jsonl", [USER_ONLY]))
    if case == "surrogate":
        cut = tmp_path / "cut.jsonl"
        cut.write_text('{"messages": [{"role": "user", "content": "hi \\ud83d"}]}\n')
        args = ["--untrained", "--config", cfg, "--prompts", str(cut), "--chat"]
        line = f"dflash: {cut} line 1: not text (a lone surrogate ('\\ud83d') at character 3 in messages[0].content)"
    elif case == "deep-prompts":
        deep = tmp_path / "deep.json"
        deep.write_text("[" + "[" * 100_000 + "]" * 100_000 + "]")
        args = ["--untrained", "--config", cfg, "--prompts", str(deep)]
        line = f"dflash: --prompts {deep}: not a JSON array of records (nested too deeply)"
    elif case.startswith("config-"):  # a published drafter folder (config.json + weights), its config.json broken
        target_cfg = TargetModel.from_pretrained(str(tiny.target), dtype=torch.float32, layer_ids=[1]).model.config
        drafter = DFlashDraftModel(draft_config_for(target_cfg, num_layers=1, block_size=4, mask_token_id=511))
        drafter.save_pretrained(tmp_path / "published")
        conf = json.loads((tmp_path / "published" / "config.json").read_text())
        text, line = {
            "config-abc": (json.dumps({**conf, "hidden_size": "abc"}),
                           "TypeError: Field 'hidden_size' expected int, got str (value: 'abc')"),
            "config-negative": (json.dumps({**conf, "hidden_size": -4}), "hidden_size: must be >= 1, got -4"),
            "config-deep": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", ""),
        }[case]  # fmt: skip
        path = tmp_path / "published" / "config.json"
        path.write_text(text)
        args = ["--drafter", str(tmp_path / "published"), "--target", str(tiny.target), "--prompts", chat, "--chat"]
        line = (
            f"dflash: --drafter: {path}: {line}"
            if line
            else f"dflash: --drafter: {path} is not JSON (nested too deeply)"
        )
    else:
        option, name = ("--json", "r.json") if case == "json-ro" else ("--plot", "p.png")
        ro = tmp_path / "ro"
        args = ["--untrained", "--config", cfg, "--prompts", chat, "--chat", option, str(ro / name)]
        line = f"eval: {option} {ro / name}: cannot write into {ro}: Operation not permitted"
    with unwritable(tmp_path / "ro"):
        rc, out, err = run_cli(capsys, *args)
    assert (rc, err.splitlines()) == (2, [line])
    assert out == "", "nothing decoded"


def test_tau_on_prompts_whose_answer_starts_with_a_tool_call(
    tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt whose reference answer (the record's first assistant turn) opens with a tool call gets its tau
    reported beside the overall one, in the report and in --json; a file without such prompts reports none."""
    from test_chat_records import FACTORY, HERMES, OPENAI_TOOLS

    from dflash.eval.evaluate import starts_with_tool_call
    from testkit.chat_templates import QWEN3_TOOLS

    make_tokenizer(QWEN3_TOOLS, "<|im_end|>").save_pretrained(tmp_path / "tok")
    run = write_config(tmp_path / "run.toml", tiny.target)
    run.write_text(run.read_text() + f'tokenizer = "{tmp_path / "tok"}"\n')
    text_first = {  # says something, then calls: its answer starts with text
        "tools": HERMES["tools"],
        "messages": [
            {"role": "user", "content": "what is the plan"},
            {"role": "assistant", "content": "let me think", "tool_calls": OPENAI_TOOLS["messages"][1]["tool_calls"]},
        ],
    }
    records = [HERMES, USER_ONLY, text_first, FACTORY]
    assert [starts_with_tool_call(r) for r in records] == [True, False, False, True]
    assert starts_with_tool_call(OPENAI_TOOLS), "reasoning before the calls is no text of the answer"
    mixed = write_jsonl(tmp_path / "mixed.jsonl", records)
    s = load_setup(drafter=None, untrained=True, config=str(run), prompts=str(mixed), chat=True)
    assert s.tool_call_prompts == [0, 3]
    rep = evaluate(s.target, s.drafter, s.prompts, max_new_tokens=8, ddtree_budget=0, tool_call_prompts=[0, 3])
    assert rep.tool_call_prompts == [0, 3]
    assert rep.tool_call_tau == pytest.approx((rep.per_prompt_tau[0] + rep.per_prompt_tau[3]) / 2, abs=1e-3)
    line = f"tau on tool-call prompts {rep.tool_call_tau:.2f}  (2 of 4 prompts whose reference answer starts with a tool call)"
    assert line in rep.lines()
    with pytest.raises(ValueError, match="expected indices of the 4 prompts"):
        evaluate(s.target, s.drafter, s.prompts, max_new_tokens=8, ddtree_budget=0, tool_call_prompts=[4])

    rc, out, err = run_cli(
        capsys, "--untrained", "--config", str(run), "--prompts", str(mixed), "--chat", "--max-new", "8",
        "--ddtree-budget", "0", "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert rc == 0, err
    got = json.loads((tmp_path / "r.json").read_text())
    assert (got["num_tool_call_prompts"], got["tool_call_prompts"]) == (2, [0, 3])
    assert got["tool_call_tau"] == pytest.approx(rep.tool_call_tau) and "tau on tool-call prompts" in out
    plain = write_jsonl(tmp_path / "plain.jsonl", [USER_ONLY])
    rc, out, err = run_cli(
        capsys, "--untrained", "--config", str(run), "--prompts", str(plain), "--chat", "--max-new", "8",
        "--ddtree-budget", "0", "--json", str(tmp_path / "p.json"),
    )  # fmt: skip
    assert rc == 0, err
    got = json.loads((tmp_path / "p.json").read_text())
    assert (got["num_tool_call_prompts"], got["tool_call_tau"]) == (0, None) and "tool-call" not in out
