"""`dflash make-tiny`: a tiny chat target that learned something, its tokenizer and chat template, a raw
chat corpus for regen, and training data written by that target.

A small spec (few target steps, few samples) keeps each build to a few seconds; the demo's default
spec is exercised by scripts/demo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from dflash.config import load_config
from dflash.data.chat import Renderer, load_tokenizer, messages_of
from dflash.data.samples import JsonlDataset
from dflash.data.tiny import CHAT_TEMPLATE, Language, TinyError, TinySpec, load_manifest, make_tiny
from dflash.model.target import TargetModel
from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[2]

SMALL = TinySpec(target_steps=40, train_samples=24, conversations=12, eval_prompts=6, response_len=20, threads=1)
CHAT = SMALL.chat
# for what any spec shows (a damaged output is built again, another seed is other data): a fraction of SMALL's cost
SMALLER = TinySpec(
    target_steps=2, target_batch=4, train_samples=4, conversations=4, eval_prompts=2, response_len=4, threads=1
)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, built = make_tiny(tmp_path_factory.mktemp("tiny") / "tiny", SMALL)
    assert built
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes_and_a_rerun_is_a_no_op(tmp_path: Path, tiny: Path) -> None:
    again, built = make_tiny(tmp_path / "again", SMALL)
    assert built
    mine, theirs = files(again), files(tiny)
    assert set(mine) == {
        "language.json",
        "tiny.json",
        "train.jsonl",
        "chat.jsonl",
        "eval.jsonl",
        "eval-chat.jsonl",
        "target/config.json",
        "target/generation_config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "target/chat_template.jinja",
    }
    assert mine == theirs, [name for name in mine if mine[name] != theirs.get(name)]
    before = {p: p.stat().st_mtime_ns for p in again.rglob("*")}
    _, built = make_tiny(again, SMALL)
    assert not built, "a complete output of the same spec is left alone"
    assert {p: p.stat().st_mtime_ns for p in again.rglob("*")} == before
    # the rest on SMALLER: the same code paths, a fraction of the cost
    small, built = make_tiny(tmp_path / "small", SMALLER)
    assert built
    want = files(small)
    (small / "train.jsonl").write_text("truncated")  # a damaged output is ours: built again
    assert load_manifest(small) is None
    _, built = make_tiny(small, SMALLER)
    assert built and files(small) == want
    other, _ = make_tiny(tmp_path / "other", dataclasses.replace(SMALLER, seed=1))
    assert files(other)["train.jsonl"] != want["train.jsonl"]
    assert files(other)["chat.jsonl"] != want["chat.jsonl"]


def test_the_data_is_the_targets_own_greedy_answer_up_to_its_end_of_turn(tiny: Path) -> None:
    manifest = load_manifest(tiny)
    assert manifest is not None and manifest["spec"] == SMALL.to_dict() and manifest["eos_token_id"] == CHAT.eos
    target = TargetModel.from_pretrained(str(tiny / "target"), dtype=torch.float32, num_draft_layers=2)
    assert target.vocab_size == SMALL.vocab_size and target.num_layers == SMALL.num_layers
    assert target.model.config.eos_token_id == CHAT.eos
    rows = records(tiny / "train.jsonl")
    assert len(rows) == SMALL.train_samples
    for row in rows[:3] + rows[-2:]:
        ids, mask = row["input_ids"], row["loss_mask"]
        p = mask.index(1)
        assert SMALL.prompt_min + 6 <= p <= SMALL.prompt_max + 6 and mask == [0] * p + [1] * (len(ids) - p)
        assert ids[:2] == [CHAT.im_start, CHAT.role["user"]]
        assert ids[p - 3 : p] == [CHAT.eos, CHAT.im_start, CHAT.role["assistant"]]
        # the answer is what the target says after the prompt, one greedy token at a time, up to its EOS
        assert ids[-1] == CHAT.eos or len(ids) - p == SMALL.response_len
        alone = target.generate_greedy(torch.tensor([ids[:p]]), SMALL.response_len, stop_token_ids=[CHAT.eos])
        assert alone[0].tolist() == ids
    used = {tok for row in rows for tok in row["input_ids"]}
    assert max(used) < SMALL.words + 7, "unused rows (and the MASK, the last row) never appear, nor tool tags"
    answers = [tok for row in rows for tok, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert set(answers) <= set(range(SMALL.words)) | {CHAT.eos}, "an answer is words, then its end of turn"


def test_the_tokenizer_and_template_render_the_data_as_the_target_read_it(tiny: Path) -> None:
    tok = load_tokenizer(str(tiny / "target"))  # AutoTokenizer.from_pretrained, local
    assert len(tok) == SMALL.words + 13 < SMALL.vocab_size - 1, "the MASK row is no token"
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", CHAT.eos, CHAT.pad)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok("w0 w17 w199", add_special_tokens=False)["input_ids"] == [0, 17, 199]
    assert tok.decode([5, 6, 7]) == "w5 w6 w7" and tok.decode([5, CHAT.eos], skip_special_tokens=True) == "w5"
    for row in records(tiny / "train.jsonl")[:4]:
        ids, p = row["input_ids"], row["loss_mask"].index(1)
        user, answer = ids[2 : p - 3], [x for x in ids[p:] if x != CHAT.eos]
        messages = [{"role": "user", "content": tok.decode(user)}, {"role": "assistant", "content": tok.decode(answer)}]
        prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        assert tok(prompt, add_special_tokens=False)["input_ids"] == ids[:p]
        if ids[-1] == CHAT.eos:  # what prepare-data makes of the same conversation: the same tokens and mask
            (seq,) = Renderer(tok).render(messages).sequences
            assert seq.input_ids == ids and seq.loss_mask == row["loss_mask"]
    for rendered, chat in zip(records(tiny / "eval.jsonl"), records(tiny / "eval-chat.jsonl")):
        text = tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
        assert tok(text, add_special_tokens=False)["input_ids"] == rendered["input_ids"]


def test_chat_jsonl_is_a_raw_multi_turn_corpus_that_prepare_data_renders(tiny: Path) -> None:
    tok = load_tokenizer(str(tiny / "target"))
    convs = [messages_of(r) for r in records(tiny / "chat.jsonl")]
    assert len(convs) == SMALL.conversations
    turns = [len(c) // 2 for c in convs]
    assert set(turns) == {1, 2} and all(len(c) % 2 == 0 for c in convs)
    assert all(m["role"] == ("user", "assistant")[i % 2] for c in convs for i, m in enumerate(c))
    assert sum(turns) == load_manifest(tiny)["assistant_turns"]  # type: ignore[index]
    renderer = Renderer(tok)
    for c in convs:
        (seq,) = renderer.render(c).sequences  # one sequence per conversation: the template keeps history
        assert sum(1 for i, x in enumerate(seq.input_ids) if x == CHAT.eos and seq.loss_mask[i]) == len(c) // 2


def test_the_prompts_come_from_the_language_and_eval_prompts_are_held_out(tiny: Path) -> None:
    lang = Language.generate(SMALL)
    saved = json.loads((tiny / "language.json").read_text())
    assert saved["phrases"] == [list(p) for p in lang.phrases]
    # the likeliest successors chain every phrase into one cycle (greedy text does not loop early)
    seen, i, cycle = set(), 0, []
    for _ in range(SMALL.phrases):
        seen.add(i)
        cycle.append(i)
        i = lang.successors[i][0]
    assert i == 0 and len(seen) == SMALL.phrases
    # a terminal phrase every terminal_every phrases of that cycle: a greedy answer ends within that many
    assert sorted(lang.terminals) == saved["terminals"] and len(lang.terminals) == -(
        -SMALL.phrases // SMALL.terminal_every
    )
    at = sorted(cycle.index(k) for k in lang.terminals)
    assert max(b - a for a, b in zip(at, at[1:] + [at[0] + SMALL.phrases])) <= SMALL.terminal_every
    train_prompts = {tuple(r["input_ids"][: r["loss_mask"].index(1)]) for r in records(tiny / "train.jsonl")}
    tok = load_tokenizer(str(tiny / "target"))
    user_turns = {
        tuple(tok(m["content"], add_special_tokens=False)["input_ids"])
        for r in records(tiny / "chat.jsonl")
        for m in r["messages"]
        if m["role"] == "user"
    }
    held = [tuple(r["input_ids"]) for r in records(tiny / "eval.jsonl")]
    assert len(held) == SMALL.eval_prompts and not set(held) & train_prompts
    assert not {h[2:-4] for h in held} & user_turns, "no eval prompt is a user turn of chat.jsonl"


def test_dflash_train_loads_the_target_by_path_and_the_data_from_jsonl(tmp_path: Path, tiny: Path) -> None:
    import io

    cfg = load_config(
        REPO / "configs" / "tiny-cpu.toml",
        [
            f"target.path={tiny / 'target'}",
            f"data.path={tiny / 'train.jsonl'}",
            f"output_dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "max_steps=4",
            "log_every=2",
            "checkpoint.interval=0",
        ],
    )
    out = io.StringIO()
    run = Run(cfg, environ={}, stream=out)
    assert run.mask_token_id == SMALL.mask_token_id and run.targets[0].model.layer_ids == [1, 3]
    assert run.train() == 0
    assert out.getvalue().count("| drafters 2/2") == 2
    data = JsonlDataset(
        tiny / "train.jsonl", format="tokens", vocab_size=SMALL.vocab_size, mask_token_id=SMALL.mask_token_id
    )
    # a sample needs two supervised tokens: an answer that is only EOS (this briefly trained target says
    # some) is skipped
    usable = [r for r in records(tiny / "train.jsonl") if sum(r["loss_mask"]) >= 2]
    assert len(data) == len(usable) > 0


def test_tiny_cpu_toml_finds_the_workdir_tiny_folder_from_a_release(tmp_path: Path, tiny: Path) -> None:
    """A run starts in <workdir>/releases/<id> (current -> it): ../../tiny is <workdir>/tiny."""
    workdir = tmp_path / "wd"
    release = workdir / "releases" / "0123456789abcdef"
    shutil.copytree(REPO / "configs", release / "configs")
    (workdir / "current").symlink_to("releases/0123456789abcdef")
    shutil.copytree(tiny, workdir / "tiny")
    from dflash.data.store import (  # the store scripts/demo writes there (here from train.jsonl)
        PrepareSpec,
        prepare,
    )

    prepare(
        PrepareSpec(
            src=str(tiny / "train.jsonl"),
            out=str(workdir / "tiny" / "store"),
            tokenizer_path=str(tiny / "target"),
            kwargs={},
            max_len=256,
            workers=1,
            shard_lines=100,
        )
    )
    cwd = os.getcwd()
    os.chdir(workdir / "current")
    try:
        cfg = load_config("configs/tiny-cpu.toml")
    finally:
        os.chdir(cwd)
    assert Path(cfg.target.path or "") == (workdir / "tiny" / "target").resolve()
    assert Path(cfg.data.path) == (workdir / "tiny" / "store").resolve()  # regen + prepare-data write it
    store = JsonlDataset(
        cfg.data.path,
        format=cfg.data.format,
        tokenizer=load_tokenizer(cfg.target.path or ""),
        vocab_size=SMALL.vocab_size,
        mask_token_id=SMALL.mask_token_id,
    )  # made for this tokenizer
    assert 0 < len(store) <= SMALL.train_samples
    assert cfg.devices.targets == ("cpu", "cpu") and cfg.devices.drafters == ("cpu", "cpu")
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.interval > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"vocab_size": 213},
            "vocab_size: must exceed words + 13 chat tokens (213) so that unused rows (and MASK) exist, got 213",
        ),
        ({"tool_share": 1.5}, "tool_share: must be between 0 and 1, got 1.5"),
        ({"num_layers": 3}, "num_layers: must be >= 4, got 3"),
        ({"prompt_max": 4}, "prompt_max: must be >= prompt_min (8), got 4"),
        ({"num_kv_heads": 3}, "num_kv_heads: must divide num_heads (4), got 3"),
    ],
)
def test_bad_spec_values_are_named(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(TinyError) as err:
        make_tiny(tmp_path / "x", dataclasses.replace(SMALL, **change))
    assert str(err.value) == message
    assert not (tmp_path / "x").exists()


def test_refuses_to_overwrite_a_folder_that_is_not_its_own(tmp_path: Path) -> None:
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    with pytest.raises(TinyError, match="is not a make-tiny output"):
        make_tiny(mine, SMALL)
    assert (mine / "notes.txt").read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"], "no temp dir left behind"


def test_a_tool_share_lists_a_tool_and_answers_with_its_call_as_the_template_renders_it(
    tmp_path: Path, tiny: Path
) -> None:
    """--tool-share: that share of the conversations lists a tool; each user turn is answered with a call (its
    arguments finish the user's phrase), then the tool's result (context), then the answer; the template
    renders the record into the ids the target trains on; eval-chat.jsonl holds the call as the reference
    answer, so `dflash eval --chat` counts those prompts as tool-call prompts. (The fixture's target,
    which learned no tools, writes the answers: only the data's shape is checked here.)"""
    from transformers import AutoModelForCausalLM

    from dflash.data.chat import tools_of
    from dflash.data.tiny import Tool, write_data
    from dflash.eval.evaluate import starts_with_tool_call

    spec = dataclasses.replace(SMALL, tool_share=0.5, conversations=16, eval_prompts=12)
    lang = Language.generate(spec)
    model = AutoModelForCausalLM.from_pretrained(tiny / "target").eval()
    counts = write_data(spec, lang, model, tmp_path)
    assert 0 < counts["tool_conversations"] < spec.conversations and 0 < counts["tool_train_prompts"]
    assert 0 < counts["tool_eval_prompts"] < spec.eval_prompts
    tok = load_tokenizer(str(tiny / "target"))
    renderer = Renderer(tok)
    suffixes = {p[k:] for p in lang.phrases for k in range(len(p))}
    convs = [r for r in records(tmp_path / "chat.jsonl") if "tools" in r]
    assert len(convs) == counts["tool_conversations"]
    for rec in convs:
        msgs, tools = messages_of(rec), tools_of(rec)
        (seq,) = renderer.render(msgs, tools=tools).sequences  # one sequence: the template keeps the history
        (fn,) = [t_["function"] for t_ in rec["tools"]]
        tool = Tool(int(fn["name"][1:]), tuple(tok(fn["description"], add_special_tokens=False)["input_ids"]))
        want = CHAT.tools(tool)
        for k in range(0, len(msgs), 4):  # user, call, result, answer
            user, call, result, answer = (
                tok(m["content"], add_special_tokens=False)["input_ids"] for m in msgs[k : k + 4]
            )
            (c,) = msgs[k + 1]["tool_calls"]
            args = tok(c["function"]["arguments"]["text"], add_special_tokens=False)["input_ids"]
            assert not call and tuple(args) in suffixes, "a call's arguments finish a phrase"
            want += [*CHAT.prompt(user), *CHAT.call(tool, args), *CHAT.response(result), *answer, CHAT.eos]
        assert seq.input_ids == want, "the template writes what the target trained on"
        sup = [i for i, m in zip(seq.input_ids, seq.loss_mask) if m]
        assert sup.count(CHAT.tag("<tool_call>")) == len(msgs) // 4 and CHAT.tag("<tool_response>") not in sup
        assert sup.count(CHAT.eos) == len(msgs) // 2, "the calls and the answers are supervised, the results not"
    # the target's text: the same share lists a tool and calls it, in the ids above
    texts = [lang.conversation(random.Random(k), spec, spec.target_seq) for k in range(40)]
    with_tools = [x for x in texts if x[:3] == [CHAT.im_start, CHAT.role["system"], CHAT.tag("<tools>")]]
    assert 0 < len(with_tools) < 40 and all(CHAT.tag("<tool_call>") in x for x in with_tools)
    # train.jsonl: a share of its prompts lists a tool; eval: a tool-call prompt's record holds its call
    rows = records(tmp_path / "train.jsonl")
    assert sum(r["input_ids"][:2] == [CHAT.im_start, CHAT.role["system"]] for r in rows) == counts["tool_train_prompts"]
    held = list(zip(records(tmp_path / "eval.jsonl"), records(tmp_path / "eval-chat.jsonl")))
    assert sum(starts_with_tool_call(c) for _, c in held) == counts["tool_eval_prompts"]
    for rendered, chat in held:
        msgs = messages_of(chat, need_assistant=False)
        assert renderer.prompt_ids(msgs[:1], tools_of(chat)) == rendered["input_ids"]
        assert starts_with_tool_call(chat) == ("tools" in chat) == (len(msgs) == 2)


def test_tool_share_out_of_range_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.__main__ import main

    assert main(["make-tiny", "--out", str(tmp_path / "x"), "--tool-share", "1.5"]) == 2
    assert "--tool-share" in capsys.readouterr().err and not (tmp_path / "x").exists()
