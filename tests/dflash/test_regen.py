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
import shutil
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

    from dflash.data.chat import load_tokenizer, messages_of
    from dflash.model.target import TargetModel

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
    from dflash.data.store import PrepareSpec, prepare

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
    from dflash.data.regen import DIE_AFTER_ENV

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
    """An OpenAI-shaped server on 127.0.0.1 (a double: an engine cannot run here) that answers POSTs from a
    script (status, body), the last entry repeating, or from a function of the request body; GET /models
    answers ``models``. It records every request body."""

    daemon_threads = True

    def __init__(
        self,
        replies: list[tuple[int, t.Any]] | t.Callable[[dict[str, t.Any]], tuple[int, t.Any]],
        models: t.Any = None,
    ) -> None:
        self.replies = replies if callable(replies) else list(replies)
        self.models = models if models is not None else {"object": "list", "data": [{"id": "served-model"}]}
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
        self._send(200, self.server.models)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        replies = self.server.replies
        if callable(replies):
            code, payload = replies(body)
        else:
            code, payload = replies.pop(0) if len(replies) > 1 else replies[0]
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
    from dflash.data.regen import OpenAIGenerator, Turn

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
    from dflash.data.regen import OpenAIGenerator, ServerError, Turn

    bad = Scripted([(400, {"error": {"message": "max_tokens is too large"}}), (200, completion("never"))])
    down = Scripted([(502, "bad gateway")])
    try:
        gen = OpenAIGenerator(bad.url, model="m", kwargs={}, concurrency=1, retries=3, backoff=0.01)
        with pytest.raises(ServerError) as e:  # every request refused (here: the only one): the run stops
            gen.generate([Turn(HISTORY, None, 7)])
        gen.close()
        assert str(e.value) == (
            f"regen: {bad.url}/v1/chat/completions answered 400 Bad Request: max_tokens is too large "
            "(all 1 requests failed, none was answered)"
        )
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
    # two requests in flight: one is retrying a 500 when the other gets a 404 (not about its content: it
    # stops every request); the 404 is what is said
    mixed = Scripted([(500, "busy"), (404, {"detail": "no such model"})])
    try:
        gen = OpenAIGenerator(
            mixed.url, model="m", kwargs={}, concurrency=2, retries=5, backoff=5.0
        )  # the abort wakes it
        with pytest.raises(ServerError) as e:
            gen.generate([Turn(HISTORY, None, 7), Turn(HISTORY, None, 7)])
        gen.close()
        assert str(e.value).endswith("answered 404 Not Found: no such model")
        assert len(mixed.bodies) == 2, "no request after the 404"
    finally:
        mixed.shutdown()
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as e:
        OpenAIGenerator(closed, model=None, kwargs={}, concurrency=1, retries=1, backoff=0.01)
    assert str(e.value).startswith(f"regen: {closed}/v1/models: ") and "gave up after 2 tries" in str(e.value)
    assert "refused" in str(e.value)


def test_progress_bar_on_a_tty_log_lines_on_a_pipe() -> None:
    import io

    from dflash.data.regen import Progress

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


# --------------------------------------------------------------------------------------------
# Tried as a hostile user would

SURROGATE = '{"id": 9, "messages": [{"role": "user", "content": "cut \\ud83d"}, {"role": "assistant", "content": "x"}]}'
# vLLM's own 400 for a prompt longer than the served context (vllm/entrypoints/openai/serving_engine.py)
VLLM_TOO_LONG = {
    "object": "error",
    "message": "This model's maximum context length is 64 tokens. However, you requested 75 tokens (63 in the "
    "messages, 12 in the completion). Please reduce the length of the messages or completion.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


def regen_args(target: Path, tmp_path: Path, src: Path, out: str = "new.jsonl", *extra: str) -> list[str]:
    cfg = write_config(tmp_path / "run.toml", target)
    return ["regen", "--config", str(cfg), "--in", str(src), "--out", str(tmp_path / out), *extra]


def openai(srv: Scripted, *extra: str) -> list[str]:
    return ["--backend", "openai", "--server", srv.url, "--retries", "0", "--max-new-tokens", str(MAX_NEW), *extra]


def ids_of(path: Path) -> list[int]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_a_changed_input_is_converted_again_after_a_failed_run(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server 500 ends the first run after the JSON array was converted; the input is replaced; the
    next run regenerated the OLD records (`resuming: 1 of 1 shards already done` at worst)."""
    src = tmp_path / "raw.json"
    src.write_text(json.dumps([CORPUS[0], CORPUS[6]]))
    down = Scripted([(500, "busy")])
    up = Scripted([(200, completion("hi"))])
    try:
        rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src), *openai(down))
        assert rc == 1 and "500 Internal Server Error: busy (gave up after 1 tries)" in err
        assert (tmp_path / "new.jsonl.partial" / "input.jsonl").is_file()
        src.write_text(json.dumps([CORPUS[7], CORPUS[4], CORPUS[0]]))
        rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src), *openai(up))
    finally:
        down.shutdown()
        up.shutdown()
    assert rc == 0, err
    assert "converting it again" in err and "resuming" not in err
    assert ids_of(tmp_path / "new.jsonl") == [8, 5, 1], "the new input's records"


def test_a_lone_surrogate_is_dropped_as_bad_text_by_both_backends(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tokenizer's TypeError (the prompt is rendered locally by both backends) ended the run at the same
    place on every rerun."""
    src = tmp_path / "raw.jsonl"
    src.write_text(json.dumps(CORPUS[0]) + "\n" + SURROGATE + "\n" + json.dumps(CORPUS[6]) + "\n")
    srv = Scripted([(200, completion("hi"))])
    try:
        for name, extra in (("hf.jsonl", ["--max-new-tokens", str(MAX_NEW)]), ("api.jsonl", openai(srv))):
            rc, out, err = dflash_main(capsys, *regen_args(target, tmp_path, src, name), *extra)
            assert rc == 0, err
            assert "Traceback" not in err and ids_of(tmp_path / name) == [1, 7]
            assert (
                "regen: dropped 1 bad-text: not text: a lone surrogate ('\\ud83d') at character 4 in "
                "messages[0].content (line 2)"
            ) in out
        # an answer that is no text (a server's lone surrogate) is a bad answer, not a line of the output
        srv.replies = [(200, '{"choices": [{"message": {"content": "bad \\udc00"}, "finish_reason": "stop"}]}')]
        rc, out, err = dflash_main(capsys, *regen_args(target, tmp_path, src, "api2.jsonl"), *openai(srv))
    finally:
        srv.shutdown()
    assert rc == 1 and "the answer is not text" in err and "none was answered" in err, err


def test_a_second_regen_into_the_same_out_is_refused(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs into one --out mixed their shards (1515 records from 1500)."""
    from test_prepare_data import HOLD

    src = write_corpus(tmp_path / "raw.jsonl")
    out = tmp_path / "new.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), "regen"], stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=REPO
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src))
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and err.startswith(f"regen: another regen (pid {holder.pid}) is writing {out}")
    assert err.count("\n") == 1 and not (tmp_path / "new.jsonl.partial").exists()


def test_a_record_the_server_refuses_is_dropped_and_the_run_goes_on(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's 400 for one prompt longer than its context stopped the run, and every rerun at the same shard."""
    too_long = {"id": 3, "messages": [{"role": "user", "content": "a long one"}, {"role": "assistant", "content": "x"}]}
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (CORPUS[0], too_long, CORPUS[6], CORPUS[7])))

    def vllm(body: dict[str, t.Any]) -> tuple[int, t.Any]:
        return (400, VLLM_TOO_LONG) if "long" in body["messages"][0]["content"] else (200, completion("hi"))

    srv = Scripted(vllm)
    try:
        rc, out, err = dflash_main(capsys, *regen_args(target, tmp_path, src), *openai(srv, "--shard-lines", "2"))
    finally:
        srv.shutdown()
    assert rc == 0, err
    assert ids_of(tmp_path / "new.jsonl") == [1, 7, 8]
    assert (
        "regen: dropped 1 server-refused: the server refused it: 400 Bad Request: This model's maximum context "
        "length is 64 tokens."
    ) in out and out.rstrip().endswith("(line 2)")
    # a server that refuses every request still stops the run, in one line (exit 1)
    srv = Scripted([(400, VLLM_TOO_LONG)])
    try:
        rc, out, err = dflash_main(capsys, *regen_args(target, tmp_path, src, "b.jsonl"), *openai(srv))
    finally:
        srv.shutdown()
    assert rc == 1 and err.count("\n") == 1 and not (tmp_path / "b.jsonl").exists()
    assert err.startswith(f"regen: {srv.url}/v1/chat/completions answered 400 Bad Request: This model's maximum")
    assert "(all 4 requests failed, none was answered)" in err


def test_answers_that_are_not_text_are_retried_then_dropped() -> None:
    """Content null (a tool call) was written as an empty answer and list/dict content as its Python repr."""
    from dflash.data.regen import Answer, Dropped, OpenAIGenerator, Turn

    def message(**msg: t.Any) -> dict[str, t.Any]:
        return {"choices": [{"index": 0, "message": {"role": "assistant", **msg}, "finish_reason": "stop"}]}

    tool = message(content=None, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f"}}])
    cases = [
        (message(content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]), Answer("ab", cut=False), 1),
        (message(content=None, reasoning_content="R"), Answer("<think>\nR\n</think>\n\n", cut=False), 1),
        (tool, Dropped("bad-answer", "the server's answer is not text: no text content (a tool call)"), 2),
        (message(content={"text": "x"}), Dropped("bad-answer", "the server's answer is not text: content is a dict, not text"), 2),
        (message(content=[{"type": "image_url", "image_url": {}}]), Dropped("bad-answer", "the server's answer is not text: content parts that are not text (image_url)"), 2),
    ]  # fmt: skip
    for payload, want, sent in cases:
        srv = Scripted([(200, completion("first")), (200, payload)])  # one good answer first: no stop rule
        try:
            gen = OpenAIGenerator(srv.url, model="m", kwargs={}, concurrency=1, retries=0)
            gen.generate([Turn(HISTORY, None, 7)])
            assert gen.generate([Turn(HISTORY, None, 7)]) == [want], payload
            gen.close()
        finally:
            srv.shutdown()
        assert len(srv.bodies) == 1 + sent, "a bad answer is asked for once more"


class Stalling(threading.Thread):
    """A server (a double) that accepts a request and then answers ``how``: "drip" (headers, then one byte of
    the body every 0.05 s, never the end: each read alone is quick; "drip-close" the same with
    ``Connection: close``), "endless" (a body without end, fast),
    or "hold" (nothing, ever). It counts the requests it got."""

    def __init__(self, how: str) -> None:
        super().__init__(daemon=True)
        import socket

        self.how = how
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: t.Any) -> None:
        import time

        with conn:
            head = conn.recv(65536)
            if head.startswith(b"GET"):
                body = json.dumps({"data": [{"id": "m"}]}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                return
            self.requests += 1
            try:
                if self.how == "hold":
                    self.done.wait()
                    return
                close = b"Connection: close\r\n" if self.how == "drip-close" else b""
                conn.sendall(b"HTTP/1.1 200 OK\r\n%sContent-Length: 100000000000\r\n\r\n{" % close)
                while not self.done.is_set():
                    conn.sendall(b" " * (1 << 16) if self.how == "endless" else b" ")
                    if self.how != "endless":
                        time.sleep(0.05)
            except OSError:  # the client hung up: what is tested
                return

    def stop(self) -> None:
        self.done.set()
        self.sock.close()


def test_a_request_is_bounded_as_a_whole_by_its_deadline_and_its_size() -> None:
    """--timeout bounded each socket read: a slow-drip server or an endless body ran forever (+2.4 MB/s)."""
    from dflash.data.regen import OpenAIGenerator, ServerError, Turn

    for how, words in (
        ("drip", "no complete answer within 1 s (--timeout)"),
        # an answer that closes the connection: http.client hands the socket to the response, off the
        # connection the watchdog used to shut
        ("drip-close", "no complete answer within 1 s (--timeout)"),
        ("endless", "an answer larger than 1 MiB"),
    ):
        srv = Stalling(how)
        result: list[BaseException] = []

        def ask(srv: Stalling = srv, result: list[BaseException] = result) -> None:
            gen = OpenAIGenerator(
                srv.url, model="m", kwargs={}, concurrency=1, timeout=1.0, retries=1, backoff=0.01,
                max_response_bytes=1 << 20,
            )  # fmt: skip
            try:
                gen.generate([Turn(HISTORY, None, 7)])
            except BaseException as e:  # what the test reads
                result.append(e)
            finally:
                gen.close()

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(120)  # a guard against the old behaviour (forever), not a timing
        srv.stop()
        assert not asker.is_alive(), f"{how}: still reading"
        assert len(result) == 1 and isinstance(result[0], ServerError), result
        assert str(result[0]) == f"regen: {srv.url}/v1/chat/completions: {words} (gave up after 2 tries)"
        assert srv.requests == 2


def test_ctrl_c_ends_regen_without_waiting_for_the_requests_in_flight(target: Path, tmp_path: Path) -> None:
    """Ctrl-C printed "aborted", then waited for the requests in flight (600 s by default, forever with a
    server that never answers). A real SIGINT to a real `dflash regen`, against a server that holds them."""
    srv = Stalling("hold")
    src = write_corpus(tmp_path / "raw.jsonl")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash", *regen_args(target, tmp_path, src), "--backend", "openai", "--server",
         srv.url, "--concurrency", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        retry_until(lambda: srv.requests >= 3 or proc.poll() is not None, 180)
        assert proc.poll() is None and srv.requests == 3, "three requests held by the server"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # a guard (the old code waited 600 s), not a timing
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        held = not srv.done.is_set()
        srv.stop()
    assert held, "the server never answered: the command did not wait for it"
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "dflash: aborted", err
    assert "Traceback" not in err and not (tmp_path / "new.jsonl").exists()


TWO_TARGETS = """
import sys
from dflash.data.chat import Renderer, load_tokenizer
from dflash.data.regen import RegenSpec, regen
from dflash.data.regen_hf import HFGenerator, load_hf
from dflash.config import load_config

cfg = load_config(sys.argv[1])
tok = load_tokenizer(str(cfg.target.path))
renderer = Renderer(tok, dict(cfg.data.chat_template_kwargs))
(one,) = load_hf(cfg, tok, batch_size=1)
# two targets as two GPUs would give (here: one CPU model twice; `devices.targets` keeps one replica a device)
gens = [one, HFGenerator(one.model, tok, batch_size=1, identity=one.identity)]
spec = RegenSpec(src=sys.argv[2], out=sys.argv[3], kwargs=renderer.kwargs, max_new_tokens=int(sys.argv[4]),
                 max_len=cfg.data.max_length, shard_lines=1)
try:
    regen(spec, gens, renderer, log=lambda m: None)
except KeyboardInterrupt:
    print("aborted", file=sys.stderr)
    sys.exit(130)
"""


def test_ctrl_c_stops_every_hf_target_not_after_the_whole_corpus(target: Path, tmp_path: Path) -> None:
    """With the hf backend and several targets: Ctrl-C left the pool's `with` waiting for its threads,
    which went on through every shard left before the process ended. A real SIGINT to a real process."""
    good = [r for r in CORPUS if isinstance(r, dict) and ("messages" in r or "conversations" in r)]
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(good[k % len(good)]) + "\n" for k in range(40)))
    cfg = write_config(tmp_path / "run.toml", target)
    out = tmp_path / "new.jsonl"
    parts = tmp_path / "new.jsonl.partial" / "parts"
    proc = subprocess.Popen(
        [sys.executable, "-c", TWO_TARGETS, str(cfg), str(src), str(out), "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip

    def done() -> int:
        return sum(1 for p in parts.iterdir() if not p.name.endswith(".tmp")) if parts.is_dir() else 0

    try:
        retry_until(lambda: done() >= 1 or proc.poll() is not None, 180)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a guard, not a timing
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "aborted", err
    assert done() < 40, "both targets stopped: the shards left were not all generated first"
    assert not out.exists()


def test_regen_output_checked_before_the_work_and_a_full_disk_keeps_the_shards(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unwritable --out was a traceback (after loading the target); a full disk too."""
    from test_prepare_data import on_a_full_disk, unwritable

    src = write_corpus(tmp_path / "raw.jsonl")
    with unwritable(tmp_path / "ro") as ro:
        rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src, str(ro / "new.jsonl")))
    assert rc == 2 and err == f"regen: --out {ro / 'new.jsonl'}: cannot write into {ro}: Operation not permitted\n"
    rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src, str(src)))
    assert rc == 2 and err == f"regen: --out {src} is the input {src}: nothing is written\n" and err.count("\n") == 1, (
        err
    )
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true: the full-disk half needs root and unshare", pytrace=False)
        pytest.skip("the full-disk half needs root and unshare")
    # a real full disk: a tmpfs of 96 KiB in a mount namespace of its own, answers of 20 KB
    srv = Scripted([(200, completion("z" * 20000))])
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*regen_args(target, tmp_path, src, str(disk / "new.jsonl")), *openai(srv, "--shard-lines", "2")]
    try:
        proc = on_a_full_disk(disk, "96k", *args)
    finally:
        srv.shutdown()
    first, second = proc.stderr.split("rc=")[:2]
    lines = [ln for ln in first.splitlines() if "conversations," not in ln and ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("regen: ") and "No space left on device (the disk is full)" in lines[0]
    assert lines[0].endswith(f"the finished shards are kept in {disk / 'new.jsonl.partial'}"), lines[0]
    assert second.startswith("1\n") and "regen: resuming: " in second and proc.stderr.rstrip().endswith("rc=0")
    assert "8 records -> 5 written" in proc.stdout


def test_a_models_list_that_is_not_a_list_is_one_line(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Smaller: /v1/models answering {"data": null} was a TypeError traceback."""
    srv = Scripted([(200, completion("hi"))], models={"data": None})
    try:
        src = write_corpus(tmp_path / "raw.jsonl")
        rc, _, err = dflash_main(capsys, *regen_args(target, tmp_path, src), "--backend", "openai", "--server", srv.url)
    finally:
        srv.shutdown()
    assert rc == 2 and err == (
        f'regen: {srv.url}/v1/models: unexpected answer {{"data": null}} (no list of models): name the model with '
        "--model\n"
    )
