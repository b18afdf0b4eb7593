"""`dflash regen`: the target rewrites every assistant turn (temperature 0), hf in-process or an
OpenAI-compatible server (a real `transformers serve` on 127.0.0.1), resumable by shard.

The target is a tiny random Qwen3 saved with a real tokenizer (byte-level BPE trained in milliseconds) and a
Qwen3-shaped chat template (``enable_thinking``). A random model rarely says EOS, so the fixture makes EOS
win wherever one token the model likes would: its lm_head row is that token's, scaled up. Answers then
end at EOS after a few tokens on some prompts and run to the limit on others.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import typing as t
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from testkit import free_port, retry_until
from testkit.chat_templates import QWEN3, SPLIT, WORDS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def make_target(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 + tokenizer + chat template + generation_config, as a local HF folder."""
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) + "\n\n" for i in range(len(WORDS))] + ["system user assistant\n"]
    tok.train_from_iterator(corpus * 4, trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])  # as Qwen3's
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = QWEN3
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    # EOS wins wherever the model's favourite token would: some answers stop early, others run to the limit
    prompt = fast.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    ids = torch.tensor([fast(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        fav = int(model.generate(ids, max_new_tokens=4, do_sample=False)[0, -1])
        w = model.lm_head.weight
        w[eos] = w[fav] * 1.2
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


CORPUS: list[t.Any] = [  # line k of the JSONL is record k of the JSON array
    {"id": 1, "messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "old"}]},
    {
        "id": 2,
        "conversations": [
            {"from": "system", "value": "let me think"},
            {"from": "human", "value": "what is the plan today"},
            {"from": "gpt", "value": "old"},
            {"from": "human", "value": "fine thanks"},
            {"from": "gpt", "value": "old 2"},
        ],
    },
    "not json",
    {"id": 4, "messages": [{"role": "user", "content": "no answer here"}]},
    {
        "id": 5,
        "messages": [
            {"role": "user", "content": "ok bye"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": "sure"},
        ],
    },
    {"input_ids": [1, 2, 3]},
    {
        "id": 7,
        "messages": [{"role": "user", "content": "let me think about it"}, {"role": "assistant", "content": "z"}],
    },
    {
        "id": 8,
        "messages": [
            {"role": "system", "content": "ok"},
            {"role": "user", "content": "what is it"},
            {"role": "assistant", "content": "w"},
        ],
    },
]
GOOD = [1, 2, 5, 7, 8]
KWARGS = {"enable_thinking": False}
MAX_NEW = 12


def write_corpus(path: Path, *, array: bool = False) -> Path:
    if array:
        path.write_text(json.dumps([r if isinstance(r, dict) else {"bad": r} for r in CORPUS]))
    else:
        path.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in CORPUS))
    return path


def write_config(path: Path, target: Path, max_length: int = 160) -> Path:
    path.write_text(
        f'[target]\npath = "{target}"\ndtype = "float32"\n\n[data]\npath = "unused.jsonl"\n'
        f"chat_template_kwargs = {{enable_thinking = false}}\nmax_length = {max_length}\n"
    )
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_target(tmp_path_factory.mktemp("regen") / "target")


def dflash_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from dflash.__main__ import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def reference(target: Path, records: list[dict[str, t.Any]]) -> tuple[dict[int, list[dict[str, str]]], list[bool]]:
    """Every good record regenerated one turn at a time with the project's own greedy loop (batch 1, no padding,
    TargetModel.generate_greedy): an implementation independent of regen's batched ``generate``."""
    import torch

    from dflash.chat import load_tokenizer, messages_of
    from dflash.target import TargetModel

    tok = load_tokenizer(str(target))
    tm = TargetModel.from_pretrained(str(target), dtype=torch.float32, layer_ids=[0])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out: dict[int, list[dict[str, str]]] = {}
    stopped: list[bool] = []
    for rec in records:
        msgs = messages_of(rec)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                text = tok.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=False, **KWARGS)
                ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
                new = tm.generate_greedy(ids, MAX_NEW, stop_token_ids=[eos])[0, ids.shape[1] :].tolist()
                stopped.append(new[-1] == eos)
                msgs[i] = {
                    "role": "assistant",
                    "content": tok.decode([x for x in new if x != eos], skip_special_tokens=True),
                }
        out[rec["id"]] = msgs
    return out, stopped


@pytest.fixture(scope="module")
def hf_run(target: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """One hf regen of CORPUS (in this process, batches of 3: left padding): (output, stdout, stderr)."""
    import contextlib
    import io

    from dflash.__main__ import main

    d = tmp_path_factory.mktemp("hf")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(
            [
                "regen",
                "--config",
                str(write_config(d / "run.toml", target)),
                "--in",
                str(write_corpus(d / "raw.jsonl")),
                "--out",
                str(d / "new.jsonl"),
                "--batch-size",
                "3",
                "--max-new-tokens",
                str(MAX_NEW),
                "--log-every",
                "2",
            ]
        )
    assert rc == 0, err.getvalue()
    return (d / "new.jsonl").read_text(), out.getvalue(), err.getvalue()


def test_hf_regen_rewrites_every_assistant_turn_as_greedy_decoding_does(
    target: Path, hf_run: tuple[str, str, str], tmp_path: Path
) -> None:
    text, out, err = hf_run
    recs = [json.loads(line) for line in text.splitlines()]
    assert [r["id"] for r in recs] == GOOD, "every usable record once, in input order"
    assert all(set(r) == {"id", "messages"} for r in recs), "OpenAI messages form, other keys kept"
    want, stopped = reference(target, [r for r in CORPUS if isinstance(r, dict) and r.get("id") in GOOD])
    assert any(stopped) and not all(stopped), "answers ending at EOS and at the token limit both occur"
    for r in recs:
        assert r["messages"] == want[r["id"]], f"record {r['id']}: turn k from the regenerated turns before it"
        orig = next(c for c in CORPUS if isinstance(c, dict) and c.get("id") == r["id"])
        assert len(r["messages"]) == len(orig.get("messages") or orig.get("conversations")), "no turn lost"
    assert recs[2]["messages"][-1] == {"role": "user", "content": "sure"}, "a trailing user turn stays"
    # the bad lines: counted and named by line number, never a traceback
    assert "regen: 8 records -> 5 written, 7 assistant turns regenerated" in out
    assert "dropped 1 bad-json" in out and "(line 3)" in out
    assert "dropped 1 no-assistant: no assistant turn (line 4)" in out
    assert "dropped 1 pre-tokenized" in out and "(line 6)" in out
    assert "Traceback" not in err
    # a pipe gets one progress line every --log-every conversations and one at the end
    lines = [ln for ln in err.splitlines() if "conversations," in ln]
    assert [ln.split()[1] for ln in lines] == ["3/8", "4/8", "6/8", "8/8"], err  # 3 bad lines at once
    assert "\r" not in err

    # prepare-data takes the output as it is
    from dflash.store import PrepareSpec, prepare

    (tmp_path / "new.jsonl").write_text(text)
    meta = prepare(
        PrepareSpec(
            src=str(tmp_path / "new.jsonl"),
            out=str(tmp_path / "store"),
            tokenizer_path=str(target),
            kwargs=KWARGS,
            max_len=256,
        ),
        log=lambda m: None,
    )
    assert meta["counts"]["records"] == 5 and meta["counts"]["sequences"] >= 5


def test_killed_regen_resumes_without_losing_or_redoing_a_conversation(
    target: Path, hf_run: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash.regen import DIE_AFTER_ENV

    raw = write_corpus(tmp_path / "raw.json", array=True)  # a JSON array: record k is line k
    cfg = write_config(tmp_path / "run.toml", target)
    new = tmp_path / "new.jsonl"
    args = [
        "regen",
        "--config",
        str(cfg),
        "--in",
        str(raw),
        "--out",
        str(new),
        "--shard-lines",
        "2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--log-every",
        "1",
    ]
    killed = subprocess.run(
        [sys.executable, "-m", "dflash", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, DIE_AFTER_ENV: "2"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    parts = sorted(p.name for p in (tmp_path / "new.jsonl.partial" / "parts").iterdir())
    assert parts == ["part-000000", "part-000001"], "killed right after its second shard was renamed"
    assert not new.exists()

    rc, out, err = dflash_main(capsys, *args)
    assert rc == 0, err
    assert "regen: resuming: 2 of 4 shards already done" in err
    progress = [ln.split()[1] for ln in err.splitlines() if "conversations," in ln]
    assert progress[0] == "5/8" and progress[-1] == "8/8", "the 4 lines of the finished shards are not redone"
    assert new.read_text() == hf_run[0], "the same output as one uninterrupted run: nothing lost, nothing twice"
    assert not (tmp_path / "new.jsonl.partial").exists()
    assert "regen: 8 records -> 5 written, 7 assistant turns" in out


@pytest.fixture(scope="module")
def serve(target: Path, tmp_path_factory: pytest.TempPathFactory) -> t.Iterator[str]:
    """A real `transformers serve` of the tiny target on 127.0.0.1, stopped by its pid."""
    import importlib.util

    exe = Path(sys.executable).with_name("transformers")
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        reason = "transformers serve needs the serving extra (pip install -e '.[serving]')"
        if os.environ.get("CI", "").lower() == "true":  # as the harness: CI fails, never skips
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [str(exe), "serve", str(target), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        retry_until(healthy, 180, interval=0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.floor
def test_openai_backend_against_transformers_serve_writes_what_hf_writes(
    target: Path, serve: str, hf_run: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path / "run.toml", target)
    raw = write_corpus(tmp_path / "raw.jsonl")
    # A server pinned to one model lists it at /v1/models since transformers 5.24; 5.17-5.23 list the HF
    # cache's models there (500 without a cache), so regen is told the pinned name, as their users must.
    named = [] if Version(version("transformers")) >= Version("5.24") else ["--model", str(target)]
    rc, out, err = dflash_main(
        capsys,
        "regen",
        "--config",
        str(cfg),
        "--in",
        str(raw),
        "--out",
        str(tmp_path / "a.jsonl"),
        "--backend",
        "openai",
        "--server",
        serve,
        "--concurrency",
        "3",
        "--max-new-tokens",
        str(MAX_NEW),
        *named,
    )
    assert rc == 0, err
    assert (tmp_path / "a.jsonl").read_text() == hf_run[0], "the server's greedy answers are the hf backend's"
    assert "openai); wrote" in out

    # a 4xx (a model the server does not serve) stops the run with one line: status and the server's words
    rc, out, err = dflash_main(
        capsys,
        "regen",
        "--config",
        str(cfg),
        "--in",
        str(raw),
        "--out",
        str(tmp_path / "b.jsonl"),
        "--backend",
        "openai",
        "--server",
        serve + "/v1",
        "--model",
        "other",
    )
    assert rc == 1
    assert err.startswith(f"regen: {serve}/v1/chat/completions answered 400 Bad Request: Server is pinned to")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "b.jsonl").exists()


class Scripted(http.server.ThreadingHTTPServer):
    """An OpenAI-shaped server on 127.0.0.1 that answers POSTs from a script (status, body); the last entry
    repeats. It records every request body."""

    def __init__(self, replies: list[tuple[int, t.Any]]) -> None:
        self.replies = list(replies)
        self.bodies: list[dict[str, t.Any]] = []
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    server: Scripted

    def _send(self, code: int, payload: t.Any) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    def do_POST(self) -> None:
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        code, payload = self.server.replies.pop(0) if len(self.server.replies) > 1 else self.server.replies[0]
        self._send(code, payload)

    def log_message(self, *args: t.Any) -> None:
        pass


def completion(content: str, reasoning: str | None = None, finish: str = "stop") -> dict[str, t.Any]:
    msg: dict[str, t.Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return {"choices": [{"index": 0, "message": msg, "finish_reason": finish}]}


HISTORY = [{"role": "user", "content": "hello there"}]


def test_openai_retries_5xx_with_backoff_and_sends_the_serving_parameters() -> None:
    from dflash.regen import OpenAIGenerator, Turn

    srv = Scripted([(500, {"error": {"message": "busy"}}), (503, "overloaded"), (200, completion("hi", "R\n"))])
    try:
        gen = OpenAIGenerator(srv.url, model=None, kwargs=KWARGS, concurrency=2, retries=3, backoff=0.01)
        try:
            [ans] = gen.generate([Turn(HISTORY, None, 7)])
        finally:
            gen.close()
    finally:
        srv.shutdown()
    assert ans.text == "<think>\nR\n</think>\n\nhi", "a split-off reasoning_content is put back as Qwen3 renders it"
    assert not ans.cut
    assert len(srv.bodies) == 3, "two 5xx answers, retried; the third try succeeds"
    assert srv.bodies[-1] == {
        "model": "served-model",
        "messages": HISTORY,
        "temperature": 0,
        "max_tokens": 7,
        "stream": False,
        "chat_template_kwargs": KWARGS,
    }


def test_openai_errors_are_one_line() -> None:
    from dflash.regen import OpenAIGenerator, ServerError, Turn

    bad = Scripted([(400, {"error": {"message": "max_tokens is too large"}}), (200, completion("never"))])
    down = Scripted([(502, "bad gateway")])
    try:
        gen = OpenAIGenerator(bad.url, model="m", kwargs={}, concurrency=1, retries=3, backoff=0.01)
        with pytest.raises(ServerError) as e:
            gen.generate([Turn(HISTORY, None, 7)])
        gen.close()
        assert str(e.value) == f"regen: {bad.url}/v1/chat/completions answered 400 Bad Request: max_tokens is too large"
        assert len(bad.bodies) == 1, "a 4xx is not retried"
        assert "chat_template_kwargs" not in bad.bodies[0], "no kwargs: the field is left out"

        gen = OpenAIGenerator(down.url, model="m", kwargs={}, concurrency=1, retries=2, backoff=0.01)
        with pytest.raises(ServerError) as e:
            gen.generate([Turn(HISTORY, None, 7)])
        gen.close()
        assert (
            str(e.value)
            == f"regen: {down.url}/v1/chat/completions: 502 Bad Gateway: bad gateway (gave up after 3 tries)"
        )
        assert len(down.bodies) == 3
    finally:
        bad.shutdown()
        down.shutdown()
    # two requests in flight: one is retrying a 500 when the other gets a 400; the 400 is what is said
    mixed = Scripted([(500, "busy"), (400, {"detail": "no such model"})])
    try:
        gen = OpenAIGenerator(
            mixed.url, model="m", kwargs={}, concurrency=2, retries=5, backoff=5.0
        )  # the abort wakes it
        with pytest.raises(ServerError) as e:
            gen.generate([Turn(HISTORY, None, 7), Turn(HISTORY, None, 7)])
        gen.close()
        assert str(e.value).endswith("answered 400 Bad Request: no such model")
        assert len(mixed.bodies) == 2, "no request after the 400"
    finally:
        mixed.shutdown()
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as e:
        OpenAIGenerator(closed, model=None, kwargs={}, concurrency=1, retries=1, backoff=0.01)
    assert str(e.value).startswith(f"regen: {closed}/v1/models: ") and "gave up after 2 tries" in str(e.value)
    assert "refused" in str(e.value)


def test_progress_bar_on_a_tty_log_lines_on_a_pipe() -> None:
    import io

    from dflash.regen import Progress

    pipe = io.StringIO()
    p = Progress(10, 3, stream=pipe, every=3, tty=False)
    for _ in range(7):
        p.advance(1)
    p.finish()
    assert [ln.split()[1] for ln in pipe.getvalue().splitlines()] == ["6/10", "9/10", "10/10"]
    assert "conv/s, ETA" in pipe.getvalue() and "\r" not in pipe.getvalue()

    tty = io.StringIO()
    p = Progress(10, 0, stream=tty, every=3, tty=True)
    for _ in range(10):
        p.advance(1)
    p.finish()
    text = tty.getvalue()
    assert text.startswith("\rregen: 1/10 conversations") and text.endswith("\n") and text.count("\n") == 1
    assert text.rsplit("\r", 1)[1].startswith("regen: 10/10 conversations"), "the line is rewritten in place"


def test_bad_arguments_are_one_line(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(write_config(tmp_path / "run.toml", target))
    raw = str(write_corpus(tmp_path / "raw.jsonl"))
    (tmp_path / "there.jsonl").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n")
    cases = [
        (["--in", raw, "--out", "x", "--backend", "openai"], "regen: --backend openai needs --server URL"),
        (["--in", raw, "--out", "x", "--server", "http://127.0.0.1:1"], "regen: --server goes with --backend openai"),
        (["--in", str(tmp_path / "nope.jsonl"), "--out", "x"], f"regen: --in {tmp_path / 'nope.jsonl'}: no such file"),
        (["--in", str(tmp_path / "empty.jsonl"), "--out", "x"], f"regen: --in {tmp_path / 'empty.jsonl'} is empty"),
        (
            ["--in", raw, "--out", str(tmp_path / "there.jsonl")],
            f"regen: --out {tmp_path / 'there.jsonl'} is already there",
        ),
    ]
    for args, msg in cases:
        rc, out, err = dflash_main(capsys, "regen", "--config", cfg, *args)
        assert rc == 2 and err.startswith(msg) and len(err.strip().splitlines()) == 1, (args, err)


def test_parquet_input_regenerates_as_jsonl_does(
    target: Path, hf_run: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")  # the datasets extra, as prepare-data's parquet input
    import pyarrow as pa

    recs = [r for r in CORPUS if isinstance(r, dict) and "messages" in r]  # one schema: ids 1, 4, 5, 7, 8
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "raw.parquet")
    rc, out, err = dflash_main(
        capsys, "regen", "--config", str(write_config(tmp_path / "run.toml", target)), "--in",
        str(tmp_path / "raw.parquet"), "--out", str(tmp_path / "new.jsonl"), "--max-new-tokens", str(MAX_NEW),
    )  # fmt: skip
    assert rc == 0, err
    want = [line for line in hf_run[0].splitlines() if json.loads(line)["id"] in (1, 5, 7, 8)]
    assert (tmp_path / "new.jsonl").read_text().splitlines() == want
    assert "regen: dropped 1 no-assistant: no assistant turn (row 1)" in out, "rows are 0-based, as in pyarrow"
