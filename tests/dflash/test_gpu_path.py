"""The GPU path, each CUDA-only mechanism reproduced on the CPU.

- the recompile limit counts every distinct drafter device: replicas that differ in a guarded property
  (their dtype) stand in for devices, as dynamo's tensor guards check both (a third device hit the limit);
- warm-up covers every guard class of CUDA's flex lowering (``compile.shape_class``) that the batch
  planner can produce from a real token store (short answers made batches of 2-7 blocks over many keys);
- gradients of accumulated bf16 micro-batches are summed in fp32 (they were summed in the bf16 ``.grad``);
- a drafter's host waits for the micro-batch two back before launching the next (doubles of CUDA events);
- the metrics read device figures outside their lock (a figure whose read blocks stands in for a busy GPU);
- features a drafter holds count against ``queue.max_bytes``, and drafters holding more still progress;
- slice k's cross-node all_reduce overlaps slice k+1's reduction (a double of the asynchronous hook);
- a hybrid target's kernels: ``dflash train``'s warning and doctor's ``kernels`` check;
- ``bench/gpu_smoke.py``'s parts: a failing part keeps the others' figures (``bench/device_check.sh``, end
  to end: tests/dflash/test_gpu_smoke.py).

The tests that need CUDA itself (the events, pinned memory, the fused kernels) are in bench/gpu_smoke.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import math
import sys
import threading
import typing as t
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.data.batching import BatchPlan
from dflash.data.samples import JsonlDataset, collate
from dflash.data.store import PrepareSpec, prepare
from dflash.train.compile import (
    batch_shape,
    guard_keys,
    shape_class,
    shapes_for,
    warm_up_replicas,
    warm_up_shapes,
)
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def tiny_run(tmp_path: Path, *overrides: str) -> Run:
    cfg = tiny_config(tmp_path, "checkpoint.resume=never", *overrides)
    return Run(cfg, environ={}, stream=io.StringIO())


# --------------------------------------------------------------------------------------------
# Item 1: gpu_smoke's data and the MASK rule at Qwen3's vocabulary


def test_the_smokes_gpu_data_never_holds_the_mask_id_the_run_picks(tmp_path: Path) -> None:
    """At Qwen3's 151936 rows the run's rule picks the published MASK id 151669, not the last row; the smoke
    drew ids from range(vocab - 1), so its seeded GPU data held 151669 (line 206, position 1256) and
    ``JsonlDataset`` refused it. The GPU defaults' data (480 rows x 2048) now loads."""
    from bench.gpu_smoke import expected_mask_id, parse_args, target_shape, write_data
    from dflash.model.target import tiny_target_config

    args = parse_args([])  # the GPU configuration
    shape = target_shape(args)
    tiny_target_config(max_position_embeddings=32768, **shape).save_pretrained(tmp_path / "target")
    mask = expected_mask_id(tmp_path / "target")
    assert (shape["vocab_size"], mask) == (151936, 151669)
    write_data(tmp_path / "d.jsonl", rows=480, seq_len=2048, vocab=shape["vocab_size"], mask_id=mask)
    ds = JsonlDataset(tmp_path / "d.jsonl", format="tokens", max_length=2048, vocab_size=151936, mask_token_id=mask)
    assert len(ds.lengths) == 480
    assert max(max(ds.read(i).input_ids) for i in range(480)) > 151669  # the ids past MASK are drawn too


# --------------------------------------------------------------------------------------------
# Item 2: the recompile limit and several drafter devices


@pytest.fixture
def dynamo_limits() -> t.Iterator[None]:
    import torch._dynamo.config as dc

    old = (dc.recompile_limit, dc.accumulated_recompile_limit)
    torch._dynamo.reset()
    yield
    dc.recompile_limit, dc.accumulated_recompile_limit = old
    torch._dynamo.reset()


def test_three_drafter_devices_warm_up_inside_the_recompile_limit(tmp_path: Path, dynamo_limits: None) -> None:
    """dynamo's entries for the compiled layer are shared by every replica and guarded on device and dtype:
    three replicas in three dtypes need three sets, as three GPUs do. Warming them one by one with a limit
    of 4 per shape (the old rule) failed on the third: "Hard failure due to fail_on_recompile_limit_hit".
    One shape of the run's own (several rows) is warmed: the entries per key scale with the shapes, the
    limit with them (two shapes, 12 entries against dynamo's default 8, proved the same at twice the compiles)."""
    import torch._dynamo.config as dc

    run = tiny_run(
        tmp_path,
        'devices.drafters=["cpu", "cpu", "cpu"]',
        "compile=true",
        "compile_backend=eager",
        "activation_checkpointing=true",
    )
    for r, dtype in zip(run.drafters, (torch.float32, torch.bfloat16, torch.float16)):
        r.model.to(dtype)
    assert guard_keys(run.drafters) == 3
    shape = shapes_for(run.drafters[0])[-1]
    assert shape[0] > 1  # several rows
    dc.recompile_limit = dc.accumulated_recompile_limit = 4  # the old rule's limit for one shape
    warmed = warm_up_replicas(
        run.drafters,
        feature_size=run.targets[0].model.feature_size,
        vocab_size=run.vocab_size,
        mask_token_id=run.mask_token_id,
        shapes=[shape],
    )
    assert warmed.shapes == [shape]
    assert len(warmed.entries) == 3 and all(n == 2 for n in warmed.entries.values()), warmed.entries
    # 2 layer input kinds x 1 shape x 3 keys = 6 entries, more than the 4 the old rule allowed
    assert dc.recompile_limit >= 6 and dc.accumulated_recompile_limit >= 6


# --------------------------------------------------------------------------------------------
# Item 3: the warmed shape classes cover every batch the planner makes


def store_records(n: int, *, max_len: int, seed: int) -> list[dict[str, t.Any]]:
    """Chat-like token records: short and long prompts, answers of 2 to hundreds of tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = int(rng.integers(4, max_len // 2))
        answer = int(rng.choice([2, 3, 5, 8, 40, 200, max_len])) if i % 3 else int(rng.integers(2, 9))
        k = min(max_len, prompt + answer)
        ids = rng.integers(1, 1000, size=k).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * (k - min(answer, k - 1)) + [1] * min(answer, k - 1)})
    return out


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    src = root / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in store_records(400, max_len=2048, seed=3)))
    prepare(
        PrepareSpec(src=str(src), out=str(root / "s"), tokenizer_path=None, kwargs={}, max_len=2048),
        log=lambda m: None,
    )
    return root / "s"


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize(("block_size", "num_anchors"), [(16, 512), (16, 256), (8, 16), (10, 64)])
def test_every_planned_batch_falls_in_a_warmed_class(
    chat_store: Path, batch_size: int, block_size: int, num_anchors: int
) -> None:
    ds = JsonlDataset(chat_store, max_length=2048)
    plan = BatchPlan(ds.lengths, batch_size=batch_size, bucket_window=8, seed=0)
    warmed = {
        shape_class(*s, block_size=block_size, flex=True)
        for s in warm_up_shapes(
            rows=batch_size, max_length=2048, num_anchors=num_anchors, block_size=block_size, flex=True
        )
    }
    met: dict[tuple[bool, ...], tuple[int, int, int]] = {}
    batches, _ = plan.batches_per_epoch()
    for g in range(batches):
        b = collate([ds.read(i) for i in plan.batch(g)], index=g)
        shape = batch_shape(b.loss_mask, num_anchors=num_anchors)
        met.setdefault(shape_class(*shape, block_size=block_size, flex=True), shape)
        # the OOM retry's half batch (two micro-batches; one sequence keeps half the anchors)
        rows, seq, blocks = shape
        half = (max(1, rows // 2), seq, blocks) if rows >= 2 else (1, seq, min(blocks, max(1, num_anchors // 2)))
        met.setdefault(shape_class(*half, block_size=block_size, flex=True), half)
    missing = {c: s for c, s in met.items() if c not in warmed}
    assert not missing, f"batches with no warmed class (rows==1, blocks==1, q<128, q<=128, kv<=128): {missing}"
    # the data makes the class the old warm-up lacked: several blocks of short queries over many keys
    short_many_keys = (batch_size == 1, False, True, True, False)
    if block_size * 2 < 128:
        assert short_many_keys in met


def test_shape_class_follows_the_cuda_guards() -> None:
    c = lambda rows, seq, blocks: shape_class(rows, seq, blocks, block_size=16, flex=True)  # noqa: E731
    assert c(1, 2048, 3) == (True, False, True, True, False)  # 48 queries: the short-query (decode) guard
    assert c(1, 2048, 8) == (True, False, False, True, False)  # exactly one query tile, not short
    assert c(1, 2048, 3) != c(1, 2048, 8)  # the pair the old warm-up took as one ("q <= 128")
    assert c(2, 2048, 9) == c(5, 300, 512)  # several of everything: one class
    assert c(2, 50, 2) == (False, False, True, True, True)  # one key tile
    assert shape_class(3, 2048, 3, block_size=16, flex=False) == shape_class(3, 10, 1, block_size=16, flex=False)


def test_warm_up_shapes_lie_in_distinct_classes_and_inside_the_config() -> None:
    shapes = warm_up_shapes(rows=4, max_length=8192, num_anchors=512, block_size=16, flex=True, taken={5120, 128})
    classes = [shape_class(*s, block_size=16, flex=True) for s in shapes]
    assert len(set(classes)) == len(shapes) == 12
    for _rows, seq, blocks in shapes:
        assert 1 <= blocks < seq <= 8192 and blocks <= 512


# --------------------------------------------------------------------------------------------
# Short queries on one row: the CUDA lowering's decode template has no config for them


class FlexRecorder:
    """A double of flex_attention: records the keyword arguments of each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, t.Any]] = []

    def __call__(self, q: t.Any, k: t.Any, v: t.Any, **kw: t.Any) -> t.Any:
        self.calls.append(kw)
        return q


class CudaLooking:
    """Stands in for a CUDA query in ``_flex``'s dispatch (it reads the shape and ``is_cuda`` only)."""

    def __init__(self, *shape: int) -> None:
        self.shape = torch.Size(shape)
        self.is_cuda = True


def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, t.Any]]:
    """The kernel options of ``_flex``'s three paths: traced into a compiled layer, the compiled kernel on
    CUDA, eager on the CPU."""
    from dflash.model import drafter

    rec = FlexRecorder()
    q, kv = torch.zeros(1, 4, 32, 16), torch.zeros(1, 2, 48, 16)
    monkeypatch.setattr(drafter, "flex_attention", rec)
    monkeypatch.setattr(drafter, "compiled_flex", lambda: rec)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
        drafter._flex(q, kv, kv, None, 0.25)
    drafter._flex(t.cast(torch.Tensor, CudaLooking(1, 4, 32, 16)), kv, kv, None, 0.25)
    drafter._flex(q, kv, kv, None, 0.25)
    assert len(rec.calls) == 3
    return [dict(c.get("kernel_options") or {}) for c in rec.calls]


def test_every_training_flex_call_asks_for_the_main_triton_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced, compiled and eager: each call carries BACKEND=TRITON, so inductor's CUDA lowering never takes
    the decode template (``use_decode = backend == "TRITON_DECODE" or (backend == "AUTO" and ...)``)."""
    assert [o.get("BACKEND") for o in flex_calls(monkeypatch)] == ["TRITON"] * 3


def test_dynamo_traces_the_backend_into_the_flex_op_of_the_graph() -> None:
    """The real trace: the flex_attention op dynamo puts in a compiled layer's graph holds the option (the
    lowering reads it from there), and the traced call computes what the eager call does."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.model import drafter

    seen: list[t.Any] = []

    def backend(gm: torch.fx.GraphModule, _inputs: t.Any) -> t.Any:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                seen.extend(a for a in node.args if isinstance(a, dict))
        return gm.forward

    q, k = torch.randn(1, 4, 32, 16), torch.randn(1, 2, 48, 16)
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi + 16, 1, 1, 32, 48, device="cpu")
    traced = torch.compile(drafter._flex, backend=backend, fullgraph=True)(q, k, k, bm, 0.25)
    assert [o.get("BACKEND") for o in seen] == ["TRITON"]
    assert torch.equal(traced, drafter._flex(q, k, k, bm, 0.25))


@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_no_warm_up_shape_lowers_to_a_decode_template_without_a_config(
    gqa: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pure model of the CUDA lowering over every warm-up shape: a shape that takes the decode template
    needs ``next_pow2(q_len * G) <= 128``; the short-query class's q = 112 at G = 2 (Qwen3-0.6B/1.7B) did not
    (torch 2.11: NoValidChoicesError in warm-up, before step 1, for batch_size 1 and 2 alike)."""
    from dflash.train.compile import decode_has_config, flex_template

    # the model itself: the failing shape of the review, and the one-block shape that passed
    assert flex_template(1, 112, heads=16, kv_heads=8, kernel_options={}) == "decode"
    assert not decode_has_config(112, gqa=2) and decode_has_config(16, gqa=8)
    assert flex_template(2, 112, heads=16, kv_heads=8, kernel_options={}) == "main"  # a symbolic batch
    assert flex_template(1, 112, heads=40, kv_heads=8, kernel_options={}) == "main"  # G = 5

    options = flex_calls(monkeypatch)
    bad = []
    for rows in (1, 4):
        for rows_, seq, blocks in warm_up_shapes(
            rows=rows, max_length=8192, num_anchors=512, block_size=block_size, flex=True
        ):
            q = blocks * block_size
            for opts in options:
                kind = flex_template(rows_, q, heads=8 * gqa, kv_heads=8, kernel_options=opts)
                if kind == "decode" and not decode_has_config(q, gqa=gqa):
                    bad.append((rows_, seq, blocks))
    assert not bad, f"shapes the decode template cannot compile at G={gqa}: {sorted(set(bad))}"


# shared_memory_per_block_optin by capability: A100, L40/4090, H100/H200, B200, RTX PRO 6000 (sm_120)
SMEM_OPTIN = {(8, 0): 166912, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}


@pytest.mark.parametrize("capability", list(SMEM_OPTIN))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_flex_tiles_fit_the_shared_memory_of_every_capability(capability: tuple[int, int], head_dim: int) -> None:
    """99 KB per block on sm_120 against 227 KB on H100/H200/B200: torch's default tiles are tuned per
    capability and version, and some exceed 99 KB by the estimate (2.13's own sm_120 forward at head dim
    256, (32, 64) x 2 stages: 147 KB; where 2.11 lacks sm_120's table, sm_100's (128, 64) x 3 stages at 128:
    131 KB). Small devices get tiles that fit; the large ones keep torch's."""
    from dflash.train.compile import flex_block_options, flex_bwd_smem, flex_fwd_smem

    assert flex_fwd_smem(32, 64, 2, 256) > SMEM_OPTIN[(12, 0)] and flex_fwd_smem(128, 64, 3, 128) > 101376
    smem = SMEM_OPTIN[capability]
    opts = flex_block_options(smem, head_dim)
    if smem >= 160 * 1024:
        assert opts == {}
        return
    m, n, s = opts["fwd_BLOCK_M"], opts["fwd_BLOCK_N"], opts["fwd_num_stages"]
    assert flex_fwd_smem(m, n, s, head_dim) <= smem and 128 % m == 0 and 128 % n == 0
    m1, n1 = opts["bwd_BLOCK_M1"], opts["bwd_BLOCK_N1"]
    assert flex_bwd_smem(m1, n1, opts["bwd_num_stages"], head_dim) <= smem
    assert n1 % m1 == 0 and (opts["bwd_BLOCK_M2"], opts["bwd_BLOCK_N2"]) == (n1, m1)  # torch's (M, N, N, M)


def test_every_flex_call_carries_the_tiles_of_the_smallest_drafter_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from dflash.model import drafter
    from dflash.train.compile import set_flex_block_options

    props = {0: 232448, 1: 101376}
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda dev: types.SimpleNamespace(shared_memory_per_block_optin=props[torch.device(dev).index]),
    )
    config = types.SimpleNamespace(head_dim=128, hidden_size=2048, num_attention_heads=16)
    replica = lambda dev: types.SimpleNamespace(device=dev, model=types.SimpleNamespace(config=config))  # noqa: E731
    try:
        opts = set_flex_block_options([replica("cuda:0"), replica("cuda:1")])
        assert opts["fwd_BLOCK_M"] == 128 and opts["fwd_num_stages"] == 2
        assert all(o == {"BACKEND": "TRITON", **opts} for o in flex_calls(monkeypatch))
        assert set_flex_block_options([replica("cuda:0")]) == {}  # 227 KB only: torch's own tiles
        assert drafter.FLEX_KERNEL_OPTIONS == {"BACKEND": "TRITON"}
    finally:
        set_flex_block_options([replica("cpu")])
    assert drafter.FLEX_KERNEL_OPTIONS == {"BACKEND": "TRITON"}  # the CPU: nothing but the backend


def test_the_smokes_class_check_reports_a_class_that_fails_to_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class whose compile raises (inductor's NoValidChoicesError, wrapped) is a failed check naming its
    shape and the error's first line; the other classes are still checked. It left main() with a traceback,
    so device_check had no figures at all."""
    import dflash.train.compile
    from bench.gpu_smoke import checks, class_check, parse_args

    real = dflash.train.compile.warm_up

    def warm_up(replica: t.Any, *, shapes: list[tuple[int, int, int]], **kw: t.Any) -> t.Any:
        if shapes[0][0] == 1:  # the class of one row, as on CUDA
            raise RuntimeError(
                "backend='inductor' raised:\nNoValidChoicesError: No choices to select.\n\nSet TORCHDYNAMO_VERBOSE=1"
            )
        return real(replica, shapes=shapes, **kw)

    monkeypatch.setattr(dflash.train.compile, "warm_up", warm_up)
    run = tiny_run(tmp_path)
    args = parse_args(["--cpu", "--quick"])
    c = class_check(args, run)
    c["eager_flex_calls"] = 0
    assert c["classes"] == 2 and c["warmed"] == 1 and not c["ok"]
    assert [f["shape"][0] for f in c["failed"]] == [1]
    assert c["failed"][0]["error"] == "RuntimeError: NoValidChoicesError: No choices to select."
    assert [b["ok"] for b in c["batches"]] == [True]  # the class that compiled is still fed
    r = {"train_exit": 0, "recompiles_after_warmup": 0, "dynamo_frames_after_warmup": 0, "mask_token_id": 1}
    r |= {"mask_token_id_expected": 1, "averaging": {"bit_identical": True, "equals_cpu_mean": True}}
    r |= {"class_check": c, "oom": None}
    (check,) = [x for x in checks(args, r) if x["name"].startswith("class check")]
    assert not check["ok"] and f"compile failed for {c['failed'][0]['shape']}" in check["name"]


# --------------------------------------------------------------------------------------------
# Item 4: fp32 accumulation of bf16 micro-batches


def test_eleven_bf16_micro_batches_sum_their_gradients_in_fp32(tmp_path: Path) -> None:
    """k = 11 micro-batches (the default accumulation at batch size 1): the masters' gradient equals the fp32
    sum of the 11 bf16 micro-batch gradients to fp32 precision. Summed in the bf16 ``.grad`` (before the fix)
    it was off by ~1e-3 relative, bf16's 8 mantissa bits compounded over 11 additions."""
    run = tiny_run(tmp_path, 'devices.drafters=["cpu"]', "drafter.dtype=bfloat16")
    r = run.drafters[0]
    assert r.separate_masters
    source = next(iter(run.sources))
    payloads = [run.targets[0].produce(next(source)) for _ in range(11)]
    state = copy.deepcopy(r.generator.get_state())

    # the reference: each micro-batch's bf16 gradient on its own, summed in fp64, scaled as accumulate does
    from dflash.model.loss import drafter_loss

    r.generator.set_state(state)
    d = r.cfg.drafter
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in r.params]
    scale = None
    weight_sum = torch.zeros((), dtype=torch.float64)
    for p in payloads:
        r.model.zero_grad(set_to_none=True)
        out = drafter_loss(
            r.model,
            r.head,
            p.input_ids,
            p.loss_mask,
            p.features,
            num_anchors=d.num_anchors,
            gamma=d.loss_gamma,
            generator=r.generator,
            chunk_size=d.loss_chunk,
        )
        if scale is None:
            scale = out.weight_sum.detach()
            out.loss.backward()
        else:
            (out.loss_sum / scale).backward()
        weight_sum += out.weight_sum.double()
        for acc, q in zip(total, r.params):
            acc += q.grad.double()
    assert scale is not None
    want = [(g * (scale.double() / weight_sum)) for g in total]

    r.generator.set_state(state)
    r.accumulate(payloads)
    got = [m.grad.double() for m in r.masters]
    err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, want))
    assert err < 1e-6, f"relative error {err:.2e}: the micro-batches were not summed in fp32"
    assert all(p.grad is None for p in r.params), "the bf16 gradients are freed after each micro-batch"
    assert not math.isnan(err)


# --------------------------------------------------------------------------------------------
# Item 5: the host runs at most two micro-batches ahead of the GPU


class EventDouble:
    """A CUDA event as ``LaunchFence`` uses it (a GPU cannot run here): ``record`` and ``synchronize`` are logged."""

    log: list[tuple[str, int]] = []
    made = 0

    def __init__(self) -> None:
        EventDouble.made += 1
        self.id = EventDouble.made

    def record(self) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("wait", self.id))


def test_a_drafter_waits_for_the_micro_batch_two_back_before_launching_the_next(tmp_path: Path) -> None:
    """Without a bound the host ran ahead until CUDA's launch queue was full, then blocked inside launches
    while holding the compiled-forward lock the other drafters wait on. With the fence, forward k starts only
    after the end event of micro-batch k-2 was waited for, and never with more than 2 ends outstanding."""
    from dflash.train.replicas import LaunchFence

    run = tiny_run(tmp_path, 'devices.drafters=["cpu"]', 'devices.targets=["cpu"]')
    r = run.drafters[0]
    EventDouble.log, EventDouble.made = [], 0
    r.fence = LaunchFence(2, EventDouble)
    r.model.register_forward_pre_hook(lambda *_: EventDouble.log.append(("forward", 0)))
    source = next(iter(run.sources))
    r.step([run.targets[0].produce(next(source)) for _ in range(5)], step=1)
    log = EventDouble.log
    forwards = [i for i, e in enumerate(log) if e[0] == "forward"]
    assert len(forwards) == 5
    for k, at in enumerate(forwards):
        recorded = {e[1] for e in log[:at] if e[0] == "record"}
        waited = {e[1] for e in log[:at] if e[0] == "wait"}
        assert len(recorded - waited) <= 1, (k, log[:at])  # this one and one more queued, at most
        if k >= 2:
            assert k - 1 in waited, (k, log[:at])  # micro-batch k-2's end (events count from 1)


# --------------------------------------------------------------------------------------------
# Item 7: the metrics read device figures outside their lock


class BlockingFigure:
    """A step figure whose read blocks, as ``.tolist()`` of a busy GPU's tensor does (no GPU here)."""

    def __init__(self, gate: threading.Event, entered: threading.Event) -> None:
        self.gate, self.entered = gate, entered

    def __float__(self) -> float:
        self.entered.set()
        self.gate.wait(120)
        return 1.0


def test_a_drafter_records_its_step_while_another_thread_reads_the_figures() -> None:
    """``Metrics._emit`` read every device's figures while holding the metrics lock, so every drafter's
    ``record`` waited for the slowest device; now an interval is closed under the lock and read outside it,
    and the lines still come out in step order."""
    from dflash.train.metrics import Metrics
    from dflash.train.pipeline import StepStats
    from testkit import retry_until

    out = io.StringIO()
    m = Metrics(log_every=1, stream=out)
    m.start()
    gate, entered, recorded = threading.Event(), threading.Event(), threading.Event()
    slow = threading.Thread(
        target=m.record,
        args=(1, StepStats(loss=BlockingFigure(gate, entered), acc=0.5, tau_tf=2.0), 10),  # type: ignore[arg-type]
    )
    slow.start()
    retry_until(entered.is_set, 30)

    def other() -> None:
        m.record(2, StepStats(loss=3.0, acc=0.5, tau_tf=2.0), 10)
        recorded.set()

    threading.Thread(target=other).start()
    try:
        retry_until(recorded.is_set, 30)  # before the fix: blocked on the lock the reader held
    finally:
        gate.set()
        slow.join(60)
    m.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 1", "step 2"]
    assert "loss 3.000" in lines[1]


# A recording double of the stream API: where each op on a CUDA figure runs (the reader stream, after its wait)
STREAMS: dict[str, t.Any] = {"recording": False, "reader": False, "waited": False, "ops": []}


class CudaFigure(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 and logs each op on it with the stream state of the time."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func: t.Any, types: t.Any, args: t.Any = (), kwargs: t.Any = None) -> t.Any:
        name = getattr(func, "__name__", str(func))
        if STREAMS["recording"] and not name.startswith("__"):
            STREAMS["ops"].append((name, STREAMS["reader"] and STREAMS["waited"]))
        if name == "to":  # to cuda:0: already there
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


class ReaderStream:
    def wait_event(self, event: t.Any) -> None:
        assert STREAMS["reader"], "waited outside the reader stream's context"
        STREAMS["waited"] = True


@contextlib.contextmanager
def on_stream(stream: t.Any) -> t.Iterator[None]:
    STREAMS["reader"] = isinstance(stream, ReaderStream)
    try:
        yield
    finally:
        STREAMS["reader"] = STREAMS["waited"] = False


def test_the_step_figures_are_built_and_read_on_the_reader_stream_after_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flattening a step's figures (``.double()``, ``torch.cat``) ran on the emitting thread's stream, queued
    after the step's ``ready`` event, while the reader stream waited only for ``ready`` and then read those
    outputs: nothing ordered the read after the writes (garbage loss/acc/tau now and then on a GPU)."""
    import dflash.train.metrics
    from dflash.train.metrics import Metrics
    from dflash.train.pipeline import StepStats

    monkeypatch.setattr(dflash.train.metrics, "_reader_stream", lambda dev: ReaderStream())
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    fig = lambda *v: torch.tensor(v if len(v) > 1 else v[0], dtype=torch.float32).as_subclass(CudaFigure)  # noqa: E731
    steps = [
        StepStats(
            loss=fig(2.5),
            acc=fig(0.5),
            tau_tf=fig(3.0),
            acc_per_slot=fig(0.75, 0.25),
            nonfinite=fig(0.0),
            ready=object(),
        ),
        StepStats(
            loss=fig(1.5),
            acc=fig(0.25),
            tau_tf=fig(2.0),
            acc_per_slot=fig(0.5, 0.0),
            nonfinite=fig(1.0),
            ready=object(),
        ),
    ]
    STREAMS.update(recording=True, ops=[])
    try:
        rows = Metrics._read_pending(steps)
    finally:
        STREAMS["recording"] = False
    assert rows == [[2.5, 0.5, 3.0, 0.0, 0.75, 0.25], [1.5, 0.25, 2.0, 1.0, 0.5, 0.0]]
    names = [n for n, _ in STREAMS["ops"]]
    assert {"double", "cat", "stack", "tolist"} <= set(names), names
    outside = [n for n, inside in STREAMS["ops"] if not inside]
    assert not outside, f"ops on CUDA figures outside the reader stream or before its wait: {outside}"


# --------------------------------------------------------------------------------------------
# Item 9: features a drafter holds count against queue.max_bytes


class CountedPipeline:
    """The real Pipeline and FeatureQueue with a real TargetReplica (tiny target, CPU) whose features are
    counted while alive, and drafters whose step holds its items a while (the target could run ahead)."""

    def __init__(self, *, drafters: int, accumulate: int, max_items: int, steps: int, until_made: bool = False) -> None:
        import types
        import weakref

        from dflash.model.target import TargetModel, tiny_target_config
        from dflash.train.pipeline import Pipeline, PipelineOptions, StepStats
        from dflash.train.replicas import TargetReplica

        target = TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)
        ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
        self.alive = {"now": 0, "peak": 0}
        lock = threading.Lock()
        alive = self.alive

        def gone(n: int) -> None:
            with lock:
                alive["now"] -= n

        class Counted(TargetReplica):
            def produce(self, batch: t.Any) -> t.Any:
                fb = super().produce(batch)
                n = int(fb.features.nbytes)
                with lock:
                    alive["now"] += n
                    alive["peak"] = max(alive["peak"], alive["now"])
                weakref.finalize(fb.features, gone, n)
                return fb

        made = threading.Event()  # the source is exhausted: every item it gave is in the queue or taken

        class Holding:
            device = "cpu"

            def step(self, payload: t.Any, *, step: int, micro_batches: int = 1) -> StepStats:
                (made if until_made else threading.Event()).wait(30 if until_made else 0.05)
                return StepStats(loss=1.0, acc=0.5, tau_tf=2.0)

            def recover(self) -> None:
                pass

        class Source:
            def __init__(self) -> None:
                self.i = 0

            def __next__(self) -> t.Any:
                self.i += 1
                if self.i > steps * accumulate * 3:
                    made.set()
                    raise StopIteration
                att = torch.ones_like(ids)
                return types.SimpleNamespace(
                    input_ids=ids, attention_mask=att, loss_mask=att, index=self.i, n_tokens=64
                )

        self.one = TargetReplica(target, "cpu", "cpu").produce(next(Source())).nbytes
        self.feature_bytes = 2 * 32 * target.feature_size * 4
        self.pipe = Pipeline(
            targets=[Counted(target, "cpu", "cpu")],
            sources=[Source()],
            drafters=[Holding() for _ in range(drafters)],
            options=PipelineOptions(
                max_steps=steps, capacity=64, max_bytes=max_items * self.one, accumulate=accumulate
            ),
        )


def test_features_taken_by_a_drafter_still_count_against_max_bytes() -> None:
    """The queue counted an item's bytes only while it was queued: a drafter accumulating 3 items held them
    outside the count, and the target made 3 more (6 alive against a bound of 3). The target now holds an
    item's bytes before its forward allocates them, and they are freed after the step that used them."""
    c = CountedPipeline(drafters=1, accumulate=3, max_items=3, steps=6)
    c.pipe.run()
    assert c.pipe.queues[0].peak_bytes <= 3 * c.one
    peak = c.alive["peak"]
    assert peak <= 3 * c.feature_bytes, f"{peak / c.feature_bytes:.0f} items alive against a bound of 3"
    assert c.alive["now"] == 0 and c.pipe.queues[0].bytes == 0


def test_the_items_left_in_the_queue_at_the_end_are_freed_with_their_bytes() -> None:
    """The run ends at max_steps with items the target made ahead still queued: they were kept (and counted)
    until the Pipeline itself was collected, a run's worth of pinned host memory on a GPU box."""
    c = CountedPipeline(drafters=1, accumulate=1, max_items=50, steps=2, until_made=True)
    assert c.pipe.run().steps == 2
    gc.collect()
    assert c.alive["now"] == 0, f"{c.alive['now'] / c.feature_bytes:.0f} items still alive"  # before: 4
    assert c.pipe.queues[0].bytes == 0 and c.pipe.queues[0].qsize() == 0


def test_drafters_holding_more_than_max_bytes_still_get_their_next_item() -> None:
    """Counting taken items could stop the run: 2 drafters accumulating 3 items each hold up to 6 while they
    wait, against a bound of 2, so no item was admitted and every worker waited forever (at the defaults, 3
    drafters x 11 items of 2048 tokens of a 27B target already exceed 4 GiB). A starved drafter now gets one
    item over the bound, one at a time."""
    from testkit import retry_until

    c = CountedPipeline(drafters=2, accumulate=3, max_items=2, steps=4)
    result: list[t.Any] = []
    runner = threading.Thread(target=lambda: result.append(c.pipe.run()), daemon=True)
    runner.start()
    try:
        retry_until(lambda: result, 120)  # before the fix: never (every worker waits on the queue)
    finally:
        if not result:
            c.pipe.request_stop()
            runner.join(30)
    assert result[0].steps == 4
    # what the waiting drafters hold, plus one item being made over the bound at a time
    assert c.alive["peak"] <= (2 * 3 + 1) * c.feature_bytes
    gc.collect()  # a feature caught in a reference cycle is freed by the collector, not at once
    assert c.alive["now"] == 0 and c.pipe.queues[0].bytes == 0


def test_the_default_byte_bound_admits_every_worker_while_the_drafters_accumulate() -> None:
    """A 27B-class target at full-length samples (5 features x 5120 wide, 3072 tokens: 256 MiB pinned
    blocks), 5 targets, 3 drafters accumulating 11: the drafters hold 8.25 GiB, over the old 4 GiB default,
    so targets ran one at a time through the over-bound path (~56% of the drafters' rate, simulated). The
    derived default lets every drafter's next item and every target's forward in, and still bounds."""
    import queue as queue_mod

    from dflash.train.feature_queue import FeatureQueue, default_max_bytes
    from dflash.train.replicas import pinned_block

    item = pinned_block(3072 * 5 * 5120 * 2)
    drafters, targets, k = 3, 5, 11
    q = FeatureQueue(64, default_max_bytes(drafters=drafters, targets=targets, accumulate=k, item_bytes=item))
    for i in range(drafters * k):  # what the drafters hold while they accumulate
        q.reserve(item, timeout=0)
        q.put(queue_item(i, item), reserved=True)
        q.get(timeout=0)
    for _ in range(drafters + targets):  # each drafter's next item, each target's forward: no wait
        q.reserve(item, timeout=0)
    with pytest.raises(queue_mod.Full):  # and it is still a bound
        q.reserve(item, timeout=0)


def queue_item(i: int, nbytes: int) -> t.Any:
    from dflash.train.feature_queue import Item

    return Item(payload=None, tokens=1, position=i, shard=0, target=0, nbytes=nbytes)


def test_a_run_derives_its_byte_bound_and_warns_when_a_set_one_is_short(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dflash.train.feature_queue import MIN_DEFAULT_BYTES

    with caplog.at_level("INFO", logger="dflash.train"):
        run = tiny_run(tmp_path / "a")
    assert run.queue_bytes == MIN_DEFAULT_BYTES  # tiny batches: the floor
    assert [r.pinned_limit for r in run.targets] == [MIN_DEFAULT_BYTES] * len(run.targets)
    assert any(m.startswith("queue.max_bytes: 4.0 GiB (derived: (") for m in caplog.messages), caplog.messages
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash.train"):
        run = tiny_run(tmp_path / "b", "queue.max_bytes=1024")
    assert run.queue_bytes == 1024
    (line,) = [m for m in caplog.messages if "queue.max_bytes 1.0 KiB is below what" in m]
    assert "unset it to derive one" in line


def test_pinned_items_count_the_host_allocators_power_of_two_blocks() -> None:
    from dflash.train.replicas import pinned_block

    assert [pinned_block(n) for n in (0, 1, 4096, 4097, 200 * 2**20)] == [0, 1, 4096, 8192, 256 * 2**20]


# --------------------------------------------------------------------------------------------
# Item 10: slice k's cross-node all_reduce overlaps slice k+1's copy and reduction


@pytest.mark.parametrize(
    ("allocated_gib", "active_gib", "trims"),
    [(30.0, 29.9, False), (30.0, 21.0, True), (2.0, 0.0, False)],
)
def test_a_target_trims_the_pinned_cache_on_its_unused_part_only(
    allocated_gib: float, active_gib: float, trims: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first checkpoint the snapshot's pinned buffers (tens of GB, in use) count in
    ``allocated_bytes``: the trim saw 30 GiB > the limit before every item and freed and re-pinned a feature
    block each time (a stream-serialising cudaHostAlloc). Only cached, unused blocks count now (limit:
    ``queue.max_bytes``, 8 GiB here)."""
    import dflash.train.replicas
    from dflash.train.replicas import TargetReplica

    gib = 1 << 30
    stats = {"allocated_bytes.current": int(allocated_gib * gib), "active_bytes.current": int(active_gib * gib)}
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(stats))
    emptied: list[int] = []
    monkeypatch.setattr(dflash.train.replicas, "empty_host_cache", lambda: emptied.append(1))
    replica = TargetReplica(t.cast(t.Any, None), "cuda:0", "cpu")
    replica.pinned_limit = 8 * gib
    replica._trim_host_cache()
    assert bool(emptied) is trims


def test_a_run_with_pinned_features_trims_past_max_bytes(tmp_path: Path) -> None:
    """The limit a run gives its targets is the queue's byte bound (on the unused part)."""
    run = tiny_run(tmp_path, "queue.max_bytes=1048576")
    assert [r.pinned_limit for r in run.targets] == [1048576] * len(run.targets)


def eval_run(tmp_path: Path) -> Run:
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join((REPO / "configs" / "tiny-data.jsonl").read_text().splitlines()[:2]) + "\n")
    return tiny_run(tmp_path, "eval.every=4", "eval.max_new=4", f"eval.prompts={prompts}")


def test_an_eval_target_that_runs_out_of_memory_names_eval_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[eval] every`` loads a second full target onto ``devices.targets[0]``: a 27B one OOMs there on an 80
    or 96 GB GPU, and the bare OutOfMemoryError read as cuda-oom on GPU 0, naming neither [eval] nor a fix."""
    import dflash.train.validation
    from dflash.config import ConfigError

    def oom(*_a: t.Any, **_k: t.Any) -> t.Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")

    monkeypatch.setattr(dflash.train.validation, "load_target", oom)
    with pytest.raises(ConfigError) as e:
        eval_run(tmp_path)
    assert e.value.path == "eval.device" and '"cpu"' in e.value.message and "\n" not in str(e.value)


def test_an_eval_device_without_room_for_the_target_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room is checked against the training target's bytes (+ a margin) before anything is loaded."""
    import dflash.train.validation
    from dflash.config import ConfigError

    loads: list[str] = []
    real = dflash.train.validation.load_target
    monkeypatch.setattr(dflash.train.validation, "load_target", lambda *a, **k: (loads.append(a[1]), real(*a, **k))[1])
    monkeypatch.setattr(dflash.train.validation, "_free_bytes", lambda device: 4096)  # the CPU as a full GPU
    with pytest.raises(ConfigError) as e:
        eval_run(tmp_path)
    assert e.value.path == "eval.device" and "needs about" in e.value.message and loads == []


def test_the_eval_room_line_names_the_gpus_that_have_room(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.config import ConfigError
    from dflash.train.validation import check_eval_room

    gib = 1 << 30
    free = {0: 20 * gib, 1: 30 * gib, 2: 70 * gib}  # cuda:0 holds training target 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free[torch.device(dev).index], 96 * gib))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ConfigError) as e:
        check_eval_room("cuda:0", 60 * gib)
    assert e.value.path == "eval.device"
    assert 'set eval.device to "cuda:2" (room enough now), "cpu"' in e.value.message
    assert "60.0 GiB on cuda:0, which has 20.0 GiB free" in e.value.message
    check_eval_room("cuda:2", 60 * gib)  # room: no error
    check_eval_room("cpu", 600 * gib)  # unknown room: no error


def test_the_cross_node_all_reduce_of_a_slice_runs_while_the_next_slice_is_reduced() -> None:
    """``NodeGroup.cross_reduce`` starts gloo's all_reduce and returns its finisher; the averager finishes
    slice k (and scatters it) only after it has started slice k+1. Before, the hook ran synchronously
    inside each slice: the all_reduce was on the critical path of every slice."""
    from dflash.train.averaging import Averager

    log: list[tuple[str, int]] = []

    def other_node(local_mean: torch.Tensor, count: int) -> t.Callable[[], None]:
        k = sum(1 for e in log if e[0] == "start")
        log.append(("start", k))

        def finish() -> None:  # another node with 2 replicas whose mean is 10 everywhere
            log.append(("finish", k))
            local_mean.mul_(count).add_(torch.full_like(local_mean, 10.0), alpha=2).div_(count + 2)

        return finish

    g = torch.Generator().manual_seed(1)
    reps = [[torch.randn(250, generator=g), torch.randn(30, generator=g)] for _ in range(3)]
    want = [(torch.stack([r[i] for r in reps]).sum(0) + 20.0) / 5 for i in range(2)]
    Averager.for_replicas(reps, chunk_numel=100, cross_reduce=other_node).average(reps)
    starts = [e[1] for e in log if e[0] == "start"]
    assert starts == [0, 1, 2, 3]  # 250 = 100 + 100 + 50, then 30
    for k in starts[:-1]:
        assert log.index(("start", k + 1)) < log.index(("finish", k)), log
    for r in reps:
        for got, w in zip(r, want):
            assert torch.allclose(got, w, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(r, reps[0]))


# --------------------------------------------------------------------------------------------
# Item 11: hybrid targets need flash-linear-attention and causal-conv1d


def hybrid_target(root: Path, layer_types: list[str] | None) -> Path:
    (root / "target").mkdir(parents=True)
    text: dict[str, t.Any] = {"model_type": "qwen3_5_text", "num_hidden_layers": 4}
    if layer_types is not None:
        text["layer_types"] = layer_types
    (root / "target" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    (root / "run.toml").write_text('[target]\npath = "target"\n')
    return root


def test_dflash_train_warns_in_one_line_when_a_hybrid_targets_kernels_are_missing() -> None:
    from dflash.model.kernels import missing_kernels, missing_kernels_warning

    hybrid = {"text_config": {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
    assert missing_kernels() == ["flash-linear-attention", "causal-conv1d"]  # not installed here
    line = missing_kernels_warning(hybrid)
    assert line is not None and "\n" not in line
    assert line.startswith("the target has 3 linear-attention (Gated DeltaNet) layers but flash-linear-attention")
    assert line.endswith("pip install flash-linear-attention causal-conv1d")
    assert missing_kernels_warning({"layer_types": ["full_attention"] * 4}) is None
    assert missing_kernels_warning({"model_type": "qwen3"}) is None


@pytest.mark.parametrize(
    ("layer_types", "stubs", "status", "words"),
    [
        (["linear_attention", "linear_attention", "linear_attention", "full_attention"], False, "fail", "3 linear"),
        (["linear_attention", "full_attention"], True, "ok", "importable"),
        (None, False, "skip", "no linear-attention layers"),
    ],
)
def test_doctor_checks_the_kernels_of_a_hybrid_target(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    layer_types: list[str] | None,
    stubs: bool,
    status: str,
    words: str,
) -> None:

    from ops import doctor
    from ops.hosts import parse_inventory
    from ops.transport import LocalTransport
    from testkit.hostsfile import dump_hosts

    work = hybrid_target(tmp_path / "w", layer_types)
    if stubs:  # doubles of the two CUDA kernel packages (they need a GPU to build): importable modules
        for mod in ("fla", "causal_conv1d"):
            (tmp_path / "stubs" / mod).mkdir(parents=True)
            (tmp_path / "stubs" / mod / "__init__.py").write_text("# a double of the kernel package\n")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stubs"))
    text = dump_hosts(
        None,
        {
            "l": {
                "transport": "local",
                "workdir": str(work),
                "python": sys.executable,
                "command": "python -m dflash train --config run.toml",
            }
        },
    )
    host = parse_inventory(text, path=None, base=tmp_path).get()
    if status == "fail":  # once through the whole doctor: its place among the checks
        report = doctor.diagnose(host)
        assert [c.name for c in report.checks][4:8] == ["torch", "kernels", "plan", "disk"]
        check = next(c for c in report.checks if c.name == "kernels")
    else:
        check = doctor.kernel_check(host, LocalTransport())
    assert check.status == status and words in check.detail, check
    if status == "fail":
        assert check.detail.endswith("pip install flash-linear-attention causal-conv1d")
        assert "flash-linear-attention, causal-conv1d" in check.detail
    assert doctor.run_config(("python", "-m", "dflash", "train", "--config=x.toml")) == "x.toml"


# --------------------------------------------------------------------------------------------
# bench/gpu_smoke.py: a part that fails keeps the others' figures


def test_the_smoke_keeps_every_parts_figures_when_one_part_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A part that raises is a failed check with its first line; the parts after it still run, and the
    figures are in --json-file after each part (the JSON came only at the very end: an exception or a
    timeout anywhere lost every figure)."""
    import bench.gpu_smoke as smoke

    def broken(run: t.Any) -> t.Any:
        raise RuntimeError("averaging broke\nthe rest of a long message")

    monkeypatch.setattr(smoke, "averaging_round", broken)
    out = tmp_path / "smoke.json"
    rc = smoke.main(["--cpu", "--quick", "--no-oom", "--steps", "1", "--json-file", str(out)])
    assert rc == 1
    r = json.loads(out.read_text())
    assert [(p["name"], p["ok"]) for p in r["parts"]] == [
        ("training", True),
        ("averaging", False),
        ("class check", True),
    ]
    assert r["parts"][1]["why"] == "RuntimeError: averaging broke"
    assert r["train_exit"] == 0 and r["class_check"]["ok"]
    failed = [c["name"] for c in r["checks"] if not c["ok"]]
    assert failed == ["part averaging ran: RuntimeError: averaging broke"]
    report = capsys.readouterr()
    assert "part averaging" in report.out and "FAILED: RuntimeError: averaging broke" in report.out
