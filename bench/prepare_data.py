"""Bench (not a test): `dflash prepare-data` throughput and `dflash train` start-up from a token store.

    .venv/bin/python -m bench.prepare_data [--convs 4000] [--small 8000] [--large 800000] [--workdir DIR]
    .venv/bin/python -m bench.prepare_data --workdir DIR --startup-only [--max-batch-tokens 8192]   # reuse DIR

1. ``--convs`` synthetic multi-turn conversations (2-4 assistant turns, Qwen3-like template with think-block
   history stripping and ``enable_thinking = false``, a byte-level BPE tokenizer with Qwen2's split regex)
   prepared with 1 and with 2 worker processes: conversations/s (the real command, in a subprocess).
2. Start-up, in a fresh interpreter: open the store as ``dflash train`` does (``JsonlDataset(store)``), build
   the batch plan, count its batches per epoch (``train.epochs``), collate the first batch; wall time and peak RSS (above the interpreter after its imports),
   for stores of ``--small`` and ``--large`` conversations. The small store is prepared for real; the large
   one is the small one's rendered sequences repeated (``--large // --small`` times, same files and format,
   written directly), because rendering 800K conversations takes hours on 2 shared cores.
"""

from __future__ import annotations

if not __package__:  # `python bench/prepare_data.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.prepare_data")

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.chat_templates import random_conversations

REPO = Path(__file__).resolve().parents[1]

STARTUP = r"""
import json, resource, sys, time
from dflash.data.batching import BatchPlan
from dflash.data.samples import JsonlDataset, Shard
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
ds = JsonlDataset(sys.argv[1], max_length=4096)
t1 = time.perf_counter()
plan = BatchPlan(ds.lengths, batch_size=8, max_batch_tokens=int(sys.argv[2]) or None, bucket_window=64, seed=0)
per_epoch, exact = plan.batches_per_epoch()  # what dflash train derives max_steps from (train.epochs)
batch = next(Shard(ds, plan, start=0, stride=1))
t2 = time.perf_counter()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"n": len(ds), "open_s": t1 - t0, "first_batch_s": t2 - t0, "rss_mb": (rss1 - rss0) / 1024,
                  "rss_total_mb": rss1 / 1024, "batch": list(batch.input_ids.shape), "per_epoch": per_epoch,
                  "exact": exact}))
"""


def dflash(*args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "dflash", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if p.returncode:
        raise SystemExit(f"dflash {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p


def _repeat(raw: Path, n: int, work: Path) -> Path:
    lines = raw.read_text().splitlines(keepends=True)
    out = work / f"chats-{n}.jsonl"
    out.write_text("".join(lines[i % len(lines)] for i in range(n)))
    return out


def _tile(src: Path, k: int, out: Path) -> Path:
    """A store of ``k`` copies of ``src``'s sequences, in the store format."""
    import shutil

    import numpy as np

    if (out / "meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokens.bin", "loss_mask.bin", "first_anchor.bin"):
        with open(out / name, "wb") as f:
            for _ in range(k):
                with open(src / name, "rb") as g:
                    shutil.copyfileobj(g, f, 1 << 24)
    off = np.fromfile(src / "offsets.bin", dtype=np.int64)
    total = int(off[-1])
    parts = [off[:-1] + i * total for i in range(k)] + [np.asarray([k * total], dtype=np.int64)]
    np.concatenate(parts).tofile(out / "offsets.bin")
    (np.fromfile(src / "token_counts.bin", dtype=np.int64) * k).tofile(out / "token_counts.bin")
    meta = json.loads((src / "meta.json").read_text())
    for key in ("records", "sequences", "tokens", "supervised"):
        meta["counts"][key] *= k
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convs", type=int, default=4000)
    ap.add_argument("--small", type=int, default=8000)
    ap.add_argument("--large", type=int, default=800_000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--startup-only",
        action="store_true",
        help="reuse the stores already in --workdir (prepared by an earlier run): start-up figures only",
    )
    ap.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="data.max_batch_tokens of the start-up plan (0: the default, batch_size x longest)",
    )
    a = ap.parse_args()
    from test_prepare_data import QWEN3, make_tokenizer

    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.startup_only:
        startup(work, a)
        return
    make_tokenizer(QWEN3, "<|im_end|>").save_pretrained(work / "tok")
    raw = work / "chats.jsonl"
    raw.write_text("".join(json.dumps(c) + "\n" for c in random_conversations(a.convs, turns=(2, 4), reply=(20, 120))))
    common = [
        "--tokenizer",
        str(work / "tok"),
        "--template-kwargs",
        '{"enable_thinking": false}',
        "--in",
        str(raw),
        "--max-len",
        "4096",
        "--shard-lines",
        "500",
    ]
    rates = {}
    for workers in (1, 2):
        out = work / f"store-w{workers}"
        t0 = time.perf_counter()
        dflash("prepare-data", *common, "--out", str(out), "--workers", str(workers))
        secs = time.perf_counter() - t0
        rates[workers] = a.convs / secs
        print(
            f"prepare {a.convs} conversations, {workers} worker(s): {secs:.1f}s wall (process start included), "
            f"{rates[workers]:.0f} conversations/s",
            flush=True,
        )
    meta = json.loads((work / "store-w1" / "meta.json").read_text())
    c = meta["counts"]
    print(
        f"  -> {c['sequences']} sequences, {c['tokens']} tokens, {c['dropped_turns']} turns left out; "
        f"{c['tokens'] / max(c['records'], 1):.0f} tokens per conversation",
        flush=True,
    )

    # the start-up stores: the small one prepared for real; the large one is the small one's rendered
    # sequences repeated (same files, same format, written directly: rendering 800K here takes too long)
    small = work / f"store-{a.small}"
    t0 = time.perf_counter()
    dflash(
        "prepare-data",
        *common[:-6],
        "--in",
        str(_repeat(raw, a.small, work)),
        "--max-len",
        "4096",
        "--shard-lines",
        "2000",
        "--workers",
        "2",
        "--out",
        str(small),
    )
    print(f"store of {a.small} conversations prepared (2 workers) in {time.perf_counter() - t0:.0f}s", flush=True)
    startup(work, a)


def startup(work: Path, a: argparse.Namespace) -> None:
    from dflash.data.store import TokenStore

    small = work / f"store-{a.small}"
    for n in (a.small, a.large):
        path = small if n == a.small else _tile(small, n // a.small, work / f"store-{n}")
        seqs = len(TokenStore(path))
        size = sum(p.stat().st_size for p in path.iterdir()) / 2**20
        print(f"store of {n} conversations: {seqs} sequences, {size:.0f} MiB", flush=True)
        res = []
        for _ in range(3):
            p = subprocess.run(
                [sys.executable, "-c", STARTUP, str(work / f"store-{n}"), str(a.max_batch_tokens)],
                capture_output=True,
                text=True,
                cwd=REPO,
                check=True,
            )
            res.append(json.loads(p.stdout.strip().splitlines()[-1]))
        best = min(res, key=lambda r: r["first_batch_s"])
        print(
            f"start-up at {n} conversations: open {best['open_s'] * 1e3:.1f} ms, open + plan + first batch "
            f"{best['first_batch_s'] * 1e3:.0f} ms (best of 3), peak RSS +{best['rss_mb']:.0f} MiB over the "
            f"imports ({best['rss_total_mb']:.0f} MiB in all); {best['per_epoch']} batches per epoch "
            f"({'exact' if best['exact'] else 'estimated'})",
            flush=True,
        )


if __name__ == "__main__":
    main()
