"""`dflash prepare-data`: chat corpus -> memory-mapped token store, rendered as serving renders it.

Real tokenizers built for the tests (a byte-level BPE trained in milliseconds, with the special tokens of
each family) carry two real-shaped chat templates: a Qwen3-like one (think blocks, earlier turns' think
blocks stripped from the history, ``enable_thinking``) and a Llama-3-like one (header ids, BOS).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import numpy as np
import pytest

from dflash.config import load_config
from dflash.data.chat import BadRecord, Renderer, messages_of, record_sequences
from dflash.data.samples import DataError, JsonlDataset
from dflash.data.store import DIE_AFTER_ENV, PrepareSpec, StoreError, TokenStore, prepare
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


def serving_view(
    tok: t.Any, messages: list[dict[str, t.Any]], kwargs: dict[str, t.Any], tools: t.Any = None
) -> list[tuple[list[int], str]]:
    """What serving shows before each assistant turn (token ids) and the text it should then generate."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(
                messages[:i], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
            )
            full = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False, **kwargs)
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


def check_matches_serving(
    tok: t.Any, kwargs: dict[str, t.Any], messages: list[dict[str, t.Any]], *, tools: t.Any = None
) -> list[t.Any]:
    r = Renderer(tok, kwargs).render(messages, tools=tools)
    views = serving_view(tok, messages, kwargs, tools)
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


def test_bad_records_are_counted_by_line_and_strict_fails(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command in this process (the killed, full-disk and tiny-data tests run it as a process of its own)."""
    llama3.save_pretrained(tmp_path / "tok")
    lines: list[t.Any] = chats(5)
    lines[1] = '{"messages": [broken'
    lines[2] = {"messages": [{"role": "user", "content": "hello"}]}
    lines[3] = {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "ok"}]}
    lines.append("x" * (10 << 20))  # a 10 MB line
    lines.append(chats(1)[0])
    src = write_lines(tmp_path / "raw.jsonl", lines)
    tok = ["prepare-data", "--tokenizer", str(tmp_path / "tok")]
    rc, out, err = run_main(capsys, *tok, "--in", str(src), "--out", str(tmp_path / "s"))
    assert rc == 0, err
    assert "Traceback" not in err + out
    assert "dropped 1 bad-json" in out and "(line 2)" in out
    assert "dropped 1 no-assistant: no assistant turn (line 3)" in out
    assert "dropped 1 unknown-role" in out and "(line 4)" in out
    assert "dropped 1 line-too-long" in out and "(line 6)" in out
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["counts"]["records"] == 7 and meta["counts"]["sequences"] == 3 and meta["counts"]["dropped"] == 4
    assert meta["drops"]["bad-json"]["lines"] == [2]
    rc, _, err = run_main(capsys, *tok, "--in", str(src), "--out", str(tmp_path / "s2"), "--strict")
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("prepare-data: line 2: not valid JSON") and "--strict" in err
    assert not (tmp_path / "s2").exists()
    empty = write_lines(tmp_path / "e.jsonl", [])
    rc, _, err = run_main(capsys, *tok, "--in", str(empty), "--out", str(tmp_path / "s3"))
    assert rc == 2 and "is empty" in err and "Traceback" not in err


def test_killed_prepare_resumes_and_equals_one_run(
    tmp_path: Path, qwen3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the killed run (a pool of 2 workers) is a process of its own (a SIGKILL); the resume and the
    uninterrupted run are the real command in this process (no interpreter start, imports or pool for each):
    the store of pool shards and in-process shards is byte for byte the one-run store."""
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
    # the rest in this process, one worker: the shards the pool wrote before the kill are kept as they are
    rc, _, err = run_main(capsys, *args, "--out", str(tmp_path / "a"))
    assert rc == 0, err
    assert "resuming:" in err and "shards already done" in err
    rc, _, err = run_main(capsys, *args, "--out", str(tmp_path / "b"))  # one worker: in this process
    assert rc == 0, err
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
    from dflash.train.run import Run

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
    from dflash.data.batching import BatchPlan

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


# --------------------------------------------------------------------------------------------
# Tried as a hostile user would: every command run in this process by
# dflash.__main__.main (the real command, without an interpreter start per case)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from dflash.__main__ import main

    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


SURROGATE = '{"messages": [{"role": "user", "content": "cut \\ud83d"}, {"role": "assistant", "content": "ok"}]}'


def test_a_changed_json_array_is_converted_again_after_a_failed_run(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first run fails (a --strict drop) after converting the array; the input is fixed; the next run
    must read the new records, not the old conversion."""
    llama3.save_pretrained(tmp_path / "tok")
    src = tmp_path / "raw.json"
    src.write_text(json.dumps([chats(1)[0], {"messages": [{"role": "user", "content": "no answer"}]}]))
    args = ["prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src), "--out", str(tmp_path / "s")]
    rc, _, err = run_main(capsys, *args, "--strict")
    assert rc == 2 and "no-assistant; --strict" in err
    assert (tmp_path / "s.partial" / "input.jsonl").is_file(), "the conversion stays for the next run"
    fixed = chats(7)[4:]  # three other conversations
    src.write_text(json.dumps(fixed))
    rc, out, err = run_main(capsys, *args)
    assert rc == 0, err
    assert "resuming" not in err and "converting it again" in err
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["counts"]["records"] == 3 and meta["counts"]["dropped"] == 0
    want = Renderer(llama3).render(fixed[0]["messages"]).sequences[0].input_ids
    assert TokenStore(tmp_path / "s").read(0)[0].tolist() == want, "the new records, not the old conversion"


def test_a_lone_surrogate_is_dropped_as_bad_text_with_its_line(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A "\\ud83d" (an emoji cut in half) is valid JSON but no text: the tokenizer's TypeError killed the run."""
    llama3.save_pretrained(tmp_path / "tok")
    src = write_lines(tmp_path / "raw.jsonl", [chats(1)[0], SURROGATE, chats(2)[1]])
    base = ["prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src)]
    for extra in ([], ["--workers", "2", "--shard-lines", "1"]):
        out_dir = str(tmp_path / f"s{len(extra)}")
        rc, out, err = run_main(capsys, *base, "--out", out_dir, *extra)
        assert rc == 0, err
        assert (
            "prepare-data: dropped 1 bad-text: not text: a lone surrogate ('\\ud83d') at character 4 in "
            "messages[0].content (line 2)"
        ) in out, out
        assert json.loads((Path(out_dir) / "meta.json").read_text())["counts"]["sequences"] == 2
    rc, out, err = run_main(capsys, *base, "--out", str(tmp_path / "strict"), "--strict")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("prepare-data: line 2: not text: a lone surrogate") and "(bad-text; --strict;" in err
    # dflash train on the same JSONL: one line naming the line, not the tokenizer's TypeError
    with pytest.raises(DataError, match=r"^data.path: raw.jsonl line 2: not text: a lone surrogate"):
        JsonlDataset(src, tokenizer=llama3)


def test_a_second_prepare_into_the_same_out_is_refused_while_the_first_runs(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lock a running prepare-data holds, taken by a real second process exactly as prepare does."""
    llama3.save_pretrained(tmp_path / "tok")
    src = write_lines(tmp_path / "raw.jsonl", chats(4))
    out_dir = tmp_path / "s"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out_dir), "prepare-data"], stdout=subprocess.PIPE, stdin=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        args = ["prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src), "--out", str(out_dir)]
        rc, _, err = run_main(capsys, *args)
        assert rc == 2 and err.startswith(f"prepare-data: another prepare-data (pid {holder.pid}) is writing {out_dir}")
        assert err.count("\n") == 1 and not (tmp_path / "s.partial").exists(), "nothing of it was touched"
        holder.kill()  # a killed holder leaves its lock file: the kernel dropped the lock itself
        holder.wait()
        rc, _, err = run_main(capsys, *args, "--shard-lines", "1")
        assert rc == 0, err
        assert not Path(str(out_dir) + ".lock").exists(), "a finished run removes its lock"
        assert json.loads((out_dir / "meta.json").read_text())["counts"]["records"] == 4
    finally:
        holder.kill()
        holder.wait()


HOLD = """
import sys
from dflash.outputs import OutputLock
with OutputLock(sys.argv[1], command=sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_token_ids_outside_the_tokenizer_are_dropped_and_counts_stay_small(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """One id of 2**32 - 1 made prepare-data allocate 32 GiB; 10**6 made an 8 MB token_counts.bin for a
    351-token vocabulary (10**8: 800 MB)."""
    llama3.save_pretrained(tmp_path / "tok")
    vocab = len(llama3)
    lines = [{"input_ids": [1, 2, 3, 2**32 - 1]}, {"input_ids": [4, 5, 6]}, {"input_ids": [7, 10**6, 8]}]
    src = write_lines(tmp_path / "raw.jsonl", lines)
    rc, out, err = run_main(
        capsys, "prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src), "--out", str(tmp_path / "s")
    )
    assert rc == 0, err
    assert (
        f"dropped 2 out-of-vocab: input_ids[3] = 4294967295 is outside the tokenizer's vocabulary ({vocab} ids) "
        "(line 1, 3)"
    ) in out
    assert (tmp_path / "s" / "token_counts.bin").stat().st_size <= 8 * vocab
    assert TokenStore(tmp_path / "s").token_count(5) == 1
    # without a tokenizer, the target's vocabulary bounds them (the tiny target of the config: 512)
    cfg = REPO / "configs" / "tiny-random.toml"
    src = write_lines(tmp_path / "raw2.jsonl", [{"input_ids": [1, 2, 600]}, {"input_ids": [4, 5, 6]}])
    rc, out, err = run_main(
        capsys, "prepare-data", "--config", str(cfg), "--in", str(src), "--out", str(tmp_path / "t")
    )
    assert rc == 0, err
    assert "dropped 1 out-of-vocab: input_ids[2] = 600 is outside the tokenizer's vocabulary (512 ids) (line 1)" in out


def test_rendering_stops_once_a_sequence_passes_max_len(tmp_path: Path, llama3: t.Any) -> None:
    """Every assistant turn rendered the whole history before it (1600 pairs: 56 s and 1.9 GB for one
    line, then cut to 3072 tokens). The renders are counted, the tokens compared with the whole render cut."""
    messages = []
    for k in range(150):  # 300 renders of a growing history without the cut: as telling as 1600 pairs
        messages += [
            {"role": "user", "content": f"hello {WORDS[k % len(WORDS)]}"},
            {"role": "assistant", "content": "ok bye"},
        ]
    r = Renderer(llama3)
    whole = r.render(messages)
    calls = []
    text = r._text
    r._text = lambda m, gen, tools=None: calls.append(len(m)) or text(m, gen, tools)  # type: ignore[method-assign]
    cut = r.render(messages, max_len=64)
    assert len(calls) < 40, f"{len(calls)} renders for a 64-token cut (300 without it)"
    assert max(calls) < 30, "never the whole history"
    assert [(s.input_ids[:64], s.loss_mask[:64]) for s in cut.sequences] == [
        (s.input_ids[:64], s.loss_mask[:64]) for s in whole.sequences
    ], "what the cut keeps is the same"
    assert cut.too_long and not whole.too_long
    # through prepare-data: the same store as rendering all of it and cutting (here: one sequence)
    src = write_lines(tmp_path / "raw.jsonl", [{"messages": messages}])
    llama3.save_pretrained(tmp_path / "tok")
    meta = prepare(
        PrepareSpec(src=str(src), out=str(tmp_path / "s"), tokenizer_path=str(tmp_path / "tok"), kwargs={}, max_len=64),
        log=lambda m: None,
    )
    assert meta["counts"]["sequences"] == 1 and meta["counts"]["cut"] == 1
    ids, mask = TokenStore(tmp_path / "s").read(0)
    assert ids.tolist() == whole.sequences[0].input_ids[:64] and mask.tolist() == whole.sequences[0].loss_mask[:64]
    # a record whose first turn's prompt alone fills max_len says so
    long = [{"role": "user", "content": " ".join(WORDS * 20)}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(BadRecord, match=r"^the first assistant turn's prompt fills max_len \(64 tokens\)$") as e:
        record_sequences({"messages": long}, r, max_len=64)
    assert e.value.reason == "prompt-too-long"


@contextlib.contextmanager
def unwritable(path: Path) -> t.Iterator[Path]:
    """A real folder no one can write into, root included (tests run as root: permission bits do not stop
    it): the immutable attribute (chattr +i), taken off again afterwards."""
    path.mkdir()
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and chattr +i failed: {made.stderr.strip()}", pytrace=False)
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_out_is_checked_before_any_work(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing folder that is not a store (and --out .) cost all the work, then a traceback at the
    final rename and the complete store stranded in DIR.partial; also: --out holding --in, an unwritable
    place, a FIFO as --in (a FIFO must never be waited on)."""
    llama3.save_pretrained(tmp_path / "tok")
    (tmp_path / "data").mkdir()
    src = write_lines(tmp_path / "data" / "raw.jsonl", chats(3))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("x")
    work = tmp_path / "cwd" / "deeper"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    os.mkfifo(tmp_path / "fifo")
    base = ["prepare-data", "--tokenizer", str(tmp_path / "tok")]
    with unwritable(tmp_path / "ro") as ro:
        cases = [
            (["--in", str(src), "--out", str(other)], f"prepare-data: --out {other} is a folder that is not a token store"),
            (["--in", str(src), "--out", "."], "prepare-data: --out . is the working directory"),
            (["--in", str(src), "--out", str(tmp_path / "cwd")], f"prepare-data: --out {tmp_path / 'cwd'} is a folder above the working directory"),
            (["--in", str(src), "--out", str(tmp_path / "data")], f"prepare-data: --out {tmp_path / 'data'} holds the input {src}"),
            (["--in", str(src), "--out", str(ro / "s")], f"prepare-data: --out {ro / 's'}: cannot write into {ro}: Operation not permitted"),
            (["--in", str(tmp_path / "fifo"), "--out", str(tmp_path / "s")], f"prepare-data: --in {tmp_path / 'fifo'}: not a regular file"),
        ]  # fmt: skip
        for args, line in cases:
            rc, out, err = run_main(capsys, *base, *args)
            assert (rc, err.count("\n")) == (2, 1) and err.startswith(line), (args, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "cwd", "data", "fifo", "other", "ro", "tok"]
        assert sorted(p.name for p in other.iterdir()) == ["notes.txt"] and list(work.iterdir()) == []
    # an empty folder is fine: the store takes its place
    (tmp_path / "empty").mkdir()
    rc, out, err = run_main(capsys, *base, "--in", str(src), "--out", str(tmp_path / "empty"))
    assert rc == 0 and (tmp_path / "empty" / "meta.json").is_file(), err


def test_a_json_array_with_a_record_nested_100000_deep(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Smaller: JSON lines already said "nested too deeply"; a JSON array died with a RecursionError."""
    llama3.save_pretrained(tmp_path / "tok")
    a, b, c = (json.dumps(r) for r in chats(3))
    text = f"[{a},\n {'[' * 100_000}{']' * 100_000}, {b}, {c}]"
    (tmp_path / "raw.json").write_text(text)
    rc, out, err = run_main(
        capsys, "prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(tmp_path / "raw.json"),
        "--out", str(tmp_path / "s"),
    )  # fmt: skip
    assert rc == 0, err
    assert "prepare-data: dropped 1 bad-json: not valid JSON: nested too deeply" in out and "(line 2)" in out
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["counts"]["records"] == 4 and meta["counts"]["sequences"] == 3


FULL_DISK = """
import os, subprocess, sys
from dflash.__main__ import main
size, disk, args = sys.argv[1], sys.argv[2], sys.argv[3:]
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "dflash-test", disk], check=True)
print(f"rc={main(args)}", file=sys.stderr, flush=True)
subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
print(f"rc={main(args)}", file=sys.stderr, flush=True)
for root, _, files in os.walk(disk):
    print(root, sorted(files))
"""


def on_a_full_disk(disk: Path, size: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`dflash ARGS` twice in one process of a mount namespace of its own (unshare -m): first on a tmpfs of
    SIZE at DISK, then again once it has grown to 64 MiB; stderr says each run's code (``rc=N``), stdout
    ends with the files under DISK. One interpreter for both runs: the real command, imports paid once."""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", FULL_DISK, size, str(disk), *args],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip


def test_a_full_disk_is_one_line_and_keeps_the_finished_shards(tmp_path: Path, llama3: t.Any) -> None:
    """A real full disk: a 256 KiB tmpfs in a mount namespace of its own (unshare -m), grown afterwards;
    the second run goes on from the shards the first one finished."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true: this test needs root and unshare", pytrace=False)
        pytest.skip("needs root and unshare (a tmpfs in a mount namespace of its own)")
    llama3.save_pretrained(tmp_path / "tok")
    src = write_lines(tmp_path / "raw.jsonl", chats(600))
    (tmp_path / "disk").mkdir()
    disk = tmp_path / "disk"
    proc = on_a_full_disk(
        disk, "256k", "prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src),
        "--out", str(disk / "store"), "--shard-lines", "50",
    )  # fmt: skip
    first, second = proc.stderr.split("rc=")[:2]
    assert "rc=1" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in first.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("prepare-data: ") and "No space left on device (the disk is full)" in lines[0]
    assert lines[0].endswith(f"; the finished shards are kept in {tmp_path / 'disk' / 'store.partial'}")
    assert second.startswith("1\n") and "prepare-data: resuming: " in second, proc.stderr
    assert proc.stderr.rstrip().endswith("rc=0"), proc.stderr
    assert "meta.json" in proc.stdout and "tokens.bin" in proc.stdout


def test_a_bom_before_a_json_array_or_json_lines_is_read_the_same_as_without(
    tmp_path: Path, llama3: t.Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A UTF-8 byte order mark first (what Windows editors write): a JSON array after one was read as a JSON
    line (`no usable sequences (1 not-an-object)`) while JSON lines after one were read. Every form, with and
    without it, gives the same store."""
    llama3.save_pretrained(tmp_path / "tok")
    records = chats(3)
    forms = {
        "array": json.dumps(records).encode(),
        "lines": "".join(json.dumps(r) + "\n" for r in records).encode(),
    }
    stores = {}
    for name, body in forms.items():
        for bom in (b"", b"\xef\xbb\xbf"):
            src = tmp_path / f"{name}{len(bom)}.json"
            src.write_bytes(bom + body)
            out = tmp_path / f"s-{name}{len(bom)}"
            rc, said, err = run_main(
                capsys, "prepare-data", "--tokenizer", str(tmp_path / "tok"), "--in", str(src), "--out", str(out)
            )
            assert rc == 0, err
            assert "dropped" not in said, said
            store = TokenStore(out)
            stores[(name, len(bom))] = [store.read(i)[0].tolist() for i in range(len(store))]
    assert len({json.dumps(v) for v in stores.values()}) == 1, stores
    assert len(stores[("array", 3)]) == 3
