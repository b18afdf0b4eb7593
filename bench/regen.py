"""Bench (not a test): `dflash regen` conversations/s, hf backend in-process and openai backend against a real
`transformers serve` on 127.0.0.1.

    .venv/bin/python -m bench.regen [--target DIR] [--in chat.jsonl] [--convs 64] [--max-new-tokens 32]
                                    [--batch-sizes 1,8] [--concurrency 1,4] [--no-serve]

``--target``: a local HF folder with a tokenizer and chat template (e.g. the one ``dflash make-tiny`` writes,
``.dflash/tiny/target``); default: the tests' tiny Qwen3 (tests/dflash/test_regen.py ``make_target``: 2 layers,
width 64, a 300-token BPE, Qwen3-shaped template with ``enable_thinking = false``). ``--in``: the corpus
(default: ``--convs`` synthetic conversations of 1-3 turns). Each configuration regenerates the same corpus
from scratch; the figures are wall time of ``regen()`` after the target is loaded (the server's start-up and
model load are left out, as the hf load is).
"""

from __future__ import annotations

if not __package__:  # `python bench/regen.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.regen")

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from testkit.chat_templates import random_conversations


def run(spec_kw: dict[str, object], gen: object, renderer: object, out: Path) -> tuple[float, dict[str, object]]:
    from dflash.data.regen import RegenSpec, regen

    spec = RegenSpec(out=str(out), **spec_kw)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    summary = regen(spec, [gen], renderer, log=lambda m: None, progress_stream=io.StringIO(), tty=False)  # type: ignore[list-item, arg-type]
    return time.perf_counter() - t0, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--in", dest="src", type=Path, default=None)
    ap.add_argument("--convs", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--kwargs", default='{"enable_thinking": false}', help="chat_template_kwargs (JSON)")
    ap.add_argument("--no-serve", action="store_true", help="hf only")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dflash.data.chat import Renderer, load_tokenizer
    from dflash.data.regen import OpenAIGenerator
    from dflash.data.regen_hf import HFGenerator

    hf_logging.disable_progress_bar()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-regen-"))
    work.mkdir(parents=True, exist_ok=True)
    target = args.target
    if target is None:
        from test_regen import make_target

        target = make_target(work / "target")
    kwargs = json.loads(args.kwargs)
    src = args.src
    if src is None:
        src = work / "raw.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in random_conversations(args.convs)))
    n = sum(1 for line in src.read_text().splitlines() if line.strip())
    tok = load_tokenizer(str(target))
    renderer = Renderer(tok, kwargs)
    spec_kw = {
        "src": str(src),
        "kwargs": kwargs,
        "max_new_tokens": args.max_new_tokens,
        "max_len": args.max_len,
        "shard_lines": 10_000,
        "log_every": 10**9,
    }
    print(
        f"target {target}, {n} conversations from {src}, max_new_tokens {args.max_new_tokens}, "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cpus"
    )
    rows = []
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32, local_files_only=True).eval()
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        gen = HFGenerator(model, tok, batch_size=bs, identity={"backend": "hf", "bs": bs})
        secs, s = run(spec_kw, gen, renderer, work / f"hf-{bs}.jsonl")
        rows.append((f"hf --batch-size {bs}", secs, s))  # the file: hf-<bs>.jsonl
    if not args.no_serve:
        from testkit import free_port

        port = free_port()
        exe = Path(sys.executable).with_name("transformers")
        log = open(work / "serve.log", "wb")
        proc = subprocess.Popen(
            [
                str(exe),
                "serve",
                str(target),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"transformers serve did not come up: see {work / 'serve.log'}") from None
                    time.sleep(0.5)
            for c in [int(x) for x in args.concurrency.split(",")]:
                ogen = OpenAIGenerator(url, model=None, kwargs=kwargs, concurrency=c)
                try:
                    secs, s = run(spec_kw, ogen, renderer, work / f"openai-{c}.jsonl")
                finally:
                    ogen.close()
                rows.append((f"openai --concurrency {c}", secs, s))
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    ref = (work / f"hf-{args.batch_sizes.split(',')[0]}.jsonl").read_text()
    print(f"{'backend':28s} {'conv/s':>8s} {'turns/s':>8s} {'seconds':>8s}  records unlike the first row's")
    for name, secs, s in rows:
        c = s["counts"]
        tag = name.split()[0]
        out = work / (f"hf-{name.split()[-1]}.jsonl" if tag == "hf" else f"openai-{name.split()[-1]}.jsonl")
        print(f"{name:28s} {n / secs:8.2f} {c['turns'] / secs:8.2f} {secs:8.1f}  {differences(ref, out.read_text())}")  # type: ignore[index]
    print(f"(files in {work})")


def differences(ref: str, got: str) -> str:
    """How many records differ, and how many of those first differ in a turn only by whitespace at its ends
    (`transformers serve` strips the content of Qwen-family models: its response parser)."""
    a = [json.loads(line) for line in ref.splitlines()]
    b = [json.loads(line) for line in got.splitlines()]
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} records"
    differ = ws = 0
    for x, y in zip(a, b):
        pairs = [(m, k) for m, k in zip(x["messages"], y["messages"]) if m != k]
        if pairs:
            differ += 1
            ws += pairs[0][0]["content"].strip() == pairs[0][1]["content"].strip()
    return f"{differ} ({ws} first by whitespace at the ends only)" if differ else "0"


if __name__ == "__main__":
    main()
