"""`dflash prepare-data`: chat corpus -> memory-mapped token store, rendered as serving renders it.

Real tokenizers built for the tests (a byte-level BPE trained in milliseconds, with the special tokens of
each family) carry two real-shaped chat templates: a Qwen3-like one (think blocks, earlier turns' think
blocks stripped from the history, ``enable_thinking``) and a Llama-3-like one (header ids, BOS).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import numpy as np
import pytest

from dflash.chat import BadRecord, Renderer, messages_of
from dflash.config import load_config
from dflash.data import DataError, JsonlDataset
from dflash.store import DIE_AFTER_ENV, PrepareSpec, StoreError, TokenStore, prepare
from testkit.chat_templates import QWEN3, SPLIT, WORDS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)

LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def make_tokenizer(template: str, eos: str, bos: str | None = None, vocab_size: int = 400) -> t.Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [  # as Qwen2/3's and Llama-3's tokenizer.json define it
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) + "\n\n" for i in range(len(WORDS))] + ["system user assistant\n"]
    tok.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos)
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def qwen3() -> t.Any:
    return make_tokenizer(QWEN3, "<|im_end|>")


@pytest.fixture(scope="module")
def llama3() -> t.Any:
    return make_tokenizer(LLAMA3, "<|eot_id|>", "<|begin_of_text|>")


CHAT = [
    {"role": "system", "content": "let me think"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "<think>what is the plan</think>how are you"},
    {"role": "user", "content": "fine thanks"},
    {"role": "assistant", "content": "ok bye"},
]


def serving_view(tok: t.Any, messages: list[dict[str, str]], kwargs: dict[str, t.Any]) -> list[tuple[list[int], str]]:
    """What serving shows before each assistant turn (token ids) and the text it should then generate."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kwargs)
            full = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kwargs)
            if full.startswith(prompt):
                answer = full[len(prompt) :]
                answer = answer[: answer.rindex(tok.eos_token) + len(tok.eos_token)]
                out.append((tok(prompt, add_special_tokens=False)["input_ids"], answer))
    return out


def supervised_spans(ids: list[int], mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for p, m in enumerate(mask + [0]):
        if m and start is None:
            start = p
        if not m and start is not None:
            spans.append((start, p))
            start = None
    return spans


def check_matches_serving(tok: t.Any, kwargs: dict[str, t.Any], messages: list[dict[str, str]]) -> list[t.Any]:
    r = Renderer(tok, kwargs).render(messages)
    views = serving_view(tok, messages, kwargs)
    spans = [(s, a, b) for s in r.sequences for a, b in supervised_spans(s.input_ids, s.loss_mask)]
    assert len(spans) == len(views), "every assistant turn serving shows is supervised once"
    for (seq, a, b), (prompt_ids, answer) in zip(spans, views):
        assert seq.input_ids[:a] == prompt_ids, "the context before a supervised turn is exactly serving's prompt"
        assert tok.decode(seq.input_ids[a:b]) == answer, "the supervised tokens are the turn's answer up to EOS"
    return r.sequences


def test_qwen3_template_history_stripping_gives_one_sequence_per_turn(qwen3: t.Any) -> None:
    # enable_thinking on: turn 1 is shown with its think block, but turn 2's history strips it, so the
    # two turns cannot share a sequence without supervising text after a context serving never shows
    seqs = check_matches_serving(qwen3, {}, CHAT)
    assert len(seqs) == 2
    assert "<think>" in qwen3.decode(seqs[0].input_ids) and "what is the plan" in qwen3.decode(seqs[0].input_ids)
    assert "what is the plan" not in qwen3.decode(seqs[1].input_ids), "turn 2 sees the stripped history"


def test_qwen3_enable_thinking_false_leaves_out_a_turn_serving_never_shows(qwen3: t.Any) -> None:
    # with thinking off serving's prompt ends in an empty think block: the turn with reasoning cannot follow it
    r = Renderer(qwen3, {"enable_thinking": False}).render(CHAT)
    assert r.dropped_turns == 1 and len(r.sequences) == 1
    check_matches_serving(qwen3, {"enable_thinking": False}, CHAT)
    text = qwen3.decode(r.sequences[0].input_ids)
    assert text.endswith("<think>\n\n</think>\n\nok bye<|im_end|>") and "what is the plan" not in text


def test_llama3_template_one_sequence_per_conversation(llama3: t.Any) -> None:
    seqs = check_matches_serving(llama3, {}, CHAT)
    assert len(seqs) == 1, "the Llama-3 rendering of turn k is a prefix of turn k+1's: one sequence"
    ids = seqs[0].input_ids
    assert ids[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    sup = [i for i, m in zip(ids, seqs[0].loss_mask) if m]
    assert sup.count(llama3.convert_tokens_to_ids("<|eot_id|>")) == 2, "each turn's EOS is supervised"


def test_sharegpt_and_openai_records_render_alike(llama3: t.Any) -> None:
    share = {
        "conversations": [
            {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
            for m in CHAT
        ]
    }
    assert messages_of(share) == messages_of({"messages": CHAT})
    with pytest.raises(BadRecord) as e:
        messages_of({"conversations": [{"from": "robot", "value": "x"}]})
    assert e.value.reason == "unknown-role"


# --------------------------------------------------------------------------------------------
# The store, through the real command


def dflash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        try:  # our own session: whatever it left behind
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def write_lines(path: Path, lines: t.Iterable[t.Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def chats(n: int) -> list[dict[str, t.Any]]:
    out = []
    for k in range(n):
        w = WORDS[k % len(WORDS)]
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"hello {w}"},
                    {"role": "assistant", "content": f"ok {w} bye"},
                    {"role": "user", "content": "and you"},
                    {"role": "assistant", "content": "fine thanks"},
                ]
            }
        )
    return out


def test_bad_records_are_counted_by_line_and_strict_fails(tmp_path: Path, llama3: t.Any) -> None:
    llama3.save_pretrained(tmp_path / "tok")
    lines: list[t.Any] = chats(5)
    lines[1] = '{"messages": [broken'
    lines[2] = {"messages": [{"role": "user", "content": "hello"}]}
    lines[3] = {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "ok"}]}
    lines.append("x" * (10 << 20))  # a 10 MB line
    lines.append(chats(1)[0])
    src = write_lines(tmp_path / "raw.jsonl", lines)
    p = dflash("prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src), "--out", str(tmp_path / "s"))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert "dropped 1 bad-json" in p.stdout and "(line 2)" in p.stdout
    assert "dropped 1 no-assistant: no assistant turn (line 3)" in p.stdout
    assert "dropped 1 unknown-role" in p.stdout and "(line 4)" in p.stdout
    assert "dropped 1 line-too-long" in p.stdout and "(line 6)" in p.stdout
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["counts"]["records"] == 7 and meta["counts"]["sequences"] == 3 and meta["counts"]["dropped"] == 4
    assert meta["drops"]["bad-json"]["lines"] == [2]
    strict = dflash(
        "prepare-data",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--in",
        str(src),
        "--out",
        str(tmp_path / "s2"),
        "--strict",
    )
    assert strict.returncode == 2 and strict.stderr.count("\n") == 1, strict.stderr
    assert strict.stderr.startswith("prepare-data: line 2: not valid JSON") and "--strict" in strict.stderr
    assert not (tmp_path / "s2").exists()
    empty = dflash(
        "prepare-data",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--in",
        str(write_lines(tmp_path / "e.jsonl", [])),
        "--out",
        str(tmp_path / "s3"),
    )
    assert empty.returncode == 2 and "is empty" in empty.stderr and "Traceback" not in empty.stderr


def test_killed_prepare_resumes_and_equals_one_run(tmp_path: Path, qwen3: t.Any) -> None:
    qwen3.save_pretrained(tmp_path / "tok")
    src = write_lines(tmp_path / "raw.jsonl", chats(30))
    args = [
        "prepare-data",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--template-kwargs",
        '{"enable_thinking": false}',
        "--in",
        str(src),
        "--shard-lines",
        "5",
    ]
    killed = dflash(*args, "--out", str(tmp_path / "a"), "--workers", "2", env={DIE_AFTER_ENV: "1"})
    assert killed.returncode == -9, killed.stderr  # really killed (SIGKILL) after its first shard
    done = sorted(p.name for p in (tmp_path / "a.partial" / "parts").iterdir())
    # the other worker may finish the shard it was on: 1 or 2 of the 6 shards, never all (CI once saw 3 of 3)
    assert 1 <= sum(not n.endswith(".tmp") for n in done) <= 2 and not (tmp_path / "a").exists()
    again = dflash(*args, "--out", str(tmp_path / "a"), "--workers", "2")
    assert again.returncode == 0, again.stderr
    assert "resuming:" in again.stderr and "shards already done" in again.stderr
    whole = dflash(*args, "--out", str(tmp_path / "b"))
    assert whole.returncode == 0, whole.stderr
    for name in ("tokens.bin", "loss_mask.bin", "offsets.bin", "first_anchor.bin", "token_counts.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a, b = (json.loads((tmp_path / x / "meta.json").read_text()) for x in "ab")
    # Qwen3 shows an earlier turn without its (empty) think block: one sequence per assistant turn
    assert a["counts"] == b["counts"] and a["counts"]["records"] == 30 and a["counts"]["sequences"] == 60
    assert not (tmp_path / "a.partial").exists()
    store = TokenStore(tmp_path / "a")
    ids, mask = store.read(0)
    r = Renderer(qwen3, {"enable_thinking": False}).render(chats(1)[0]["messages"])
    assert ids.tolist() == r.sequences[0].input_ids and mask.tolist() == r.sequences[0].loss_mask


def test_a_store_for_another_tokenizer_or_kwargs_is_refused(tmp_path: Path, qwen3: t.Any, llama3: t.Any) -> None:
    qwen3.save_pretrained(tmp_path / "q")
    before = signal.getsignal(signal.SIGINT)
    prepare(
        PrepareSpec(
            src=str(write_lines(tmp_path / "raw.jsonl", chats(4))),
            out=str(tmp_path / "s"),
            tokenizer_path=str(tmp_path / "q"),
            kwargs={"enable_thinking": False},
            max_len=256,
        ),
        log=lambda m: None,
    )
    # an in-process prepare (one worker) leaves Ctrl-C alone: a SIG_IGN here would be inherited by every
    # later child process (it made `dflashctl status --watch` deaf to Ctrl-C later in the suite)
    assert signal.getsignal(signal.SIGINT) is before
    ds = JsonlDataset(tmp_path / "s", tokenizer=qwen3, chat_template_kwargs={"enable_thinking": False})
    assert len(ds) == 8 and ds.read(0).input_ids == TokenStore(tmp_path / "s").read(0)[0].tolist()
    with pytest.raises(DataError, match=r"^data.path: the token store s was made for another tokenizer"):
        JsonlDataset(tmp_path / "s", tokenizer=make_tokenizer(QWEN3, "<|im_end|>", vocab_size=300))
    with pytest.raises(DataError, match=r"^data.path: the token store s was rendered with another chat template"):
        JsonlDataset(tmp_path / "s", tokenizer=llama3)
    with pytest.raises(DataError, match=r"rendered with chat_template_kwargs \{\"enable_thinking\": false\}"):
        JsonlDataset(tmp_path / "s", tokenizer=qwen3, chat_template_kwargs={})
    with pytest.raises(DataError, match="outside the target vocabulary"):
        JsonlDataset(tmp_path / "s", vocab_size=10)
    with pytest.raises(StoreError, match="already a token store"):
        prepare(
            PrepareSpec(
                src=str(tmp_path / "raw.jsonl"), out=str(tmp_path / "s"), tokenizer_path=None, kwargs={}, max_len=8
            ),
            log=lambda m: None,
        )


def test_train_on_a_store_of_the_tiny_data(tmp_path: Path) -> None:
    from dflash.train import Run

    cfg_path = REPO / "configs" / "tiny-random.toml"
    p = dflash(
        "prepare-data",
        "--config",
        str(cfg_path),
        "--in",
        str(REPO / "configs" / "tiny-data.jsonl"),
        "--out",
        str(tmp_path / "store"),
    )
    assert p.returncode == 0, p.stderr
    cfg = load_config(
        cfg_path,
        [
            f"data.path={tmp_path / 'store'}",
            f"output_dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.interval=0",
            "max_steps=4",
            "log_every=2",
        ],
    )
    raw = JsonlDataset(REPO / "configs" / "tiny-data.jsonl", max_length=cfg.data.max_length)
    import io

    out = io.StringIO()
    run = Run(cfg, environ={}, stream=out)
    try:
        assert run.dataset._store is not None and len(run.dataset) == len(raw)
        assert [run.dataset.read(i) for i in range(len(raw))] == [raw.read(i) for i in range(len(raw))]
        assert np.array_equal(np.asarray(run.dataset.lengths), np.asarray(raw.lengths))
        fp = run.dataset.fingerprint()
        assert fp == JsonlDataset(tmp_path / "store", max_length=cfg.data.max_length).fingerprint()
        assert run.train() == 0
        assert any(line.startswith("step 4 |") for line in out.getvalue().splitlines()), out.getvalue()
        trained = run.drafters[0].trained + run.drafters[1].trained
        # which batches come first depends on which target thread is faster; none may train twice
        assert len(trained) == 4 and len(set(trained)) == 4, trained
    finally:
        run.dataset.close()


def test_config_chat_template_kwargs(tmp_path: Path) -> None:
    from dflash.config import ConfigError

    base = (REPO / "configs" / "tiny-random.toml").read_text()
    assert "[data]" in base
    good = tmp_path / "good.toml"
    good.write_text(base.replace("[data]", "[data]\nchat_template_kwargs = {enable_thinking = false}", 1))
    assert load_config(good, ()).data.chat_template_kwargs == {"enable_thinking": False}
    assert load_config(REPO / "configs" / "tiny-random.toml", ()).data.chat_template_kwargs == {}
    bad = tmp_path / "bad.toml"
    bad.write_text(base.replace("[data]", "[data]\nchat_template_kwargs = {enable_thinking = [1]}", 1))
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs.enable_thinking"):
        load_config(bad, ())


def test_the_vectorized_plan_of_a_store_follows_the_list_plans_rules() -> None:
    from dflash.batching import BatchPlan

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 300, size=3000)
    kw = dict(batch_size=8, max_batch_tokens=1200, bucket_window=4, seed=3)
    fast, slow = BatchPlan(lengths, shuffle=False, **kw), BatchPlan(lengths.tolist(), shuffle=False, **kw)
    assert list(fast.epoch(0)) == slow.epoch(0), "same rules: without shuffling, the very same batches"
    plan = BatchPlan(lengths, shuffle=True, **kw)
    assert plan.fingerprint() != BatchPlan(lengths.tolist(), shuffle=True, **kw).fingerprint()
    for e in (0, 1):
        batches = list(plan.epoch(e))
        assert sorted(i for b in batches for i in b) == list(range(3000)), "every sample once per epoch"
        assert all(1 <= len(b) <= 8 and (len(b) == 1 or len(b) * max(lengths[b]) <= 1200) for b in batches)
    assert list(plan.epoch(0)) != list(plan.epoch(1))
    first = plan.batch(len(plan.epoch(0)))  # global index -> epoch 1's first batch
    assert first == plan.epoch(1)[0]
