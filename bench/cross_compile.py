"""The compile gate: the project's compiled drafter step, compiled for a CUDA device that is not here.

    python -m bench.cross_compile --capability 12.0 --head-dim 256 [--kind dflash|dflash2] [--only flex]
        [--options project|torch-default] [--json PATH] [--shapes N] [--any-torch]
    python -m bench.cross_compile --case 64 --case 128 --case 256 --case 256:torch-default ...

Builds the run's drafter as ``dflash train`` does (``configs/tiny-random.toml`` with the head dim, the kind and
bf16), compiles it with ``dflash.train.compile``'s own ``prepare_drafter`` and runs ``warm_up`` over every
``warm_up_shapes`` class, forward and backward, on the CPU; each graph inductor receives (the forward and the
backward of each class) is compiled once more for a fake ``cuda:0`` of the chosen capability
(``bench.fake_cuda``), with the flex kernel options the project chooses for that device's shared memory
(``set_flex_block_options``; ``--options torch-default``: torch's own tiles). Triton builds real cubins: each
kernel's row says its shared memory against the device's opt-in limit (what Triton checks at load: the
"OutOfResources: shared memory" failure), its registers and spill bytes (``cuobjdump -res-usage``, shipped in
the triton wheel), and a failure's first line. Sizes do not matter (the graphs are symbolic), the shape
classes do: the warm-up's sizes are small so the CPU runs stay cheap.

``--case HEAD_DIM[:OPTIONS]`` (repeated) compiles several head dims and option sets one after the other in one
process, so torch's and Triton's start-up is paid once (the slow test's rows); each row says its head dim and
options. ``--set KEY=INT`` (repeated) puts a flex kernel option over the chosen ones (a tile sweep:
``--set bwd_num_warps=8 --set bwd_num_stages=2``).

Exit 0 when every kernel compiled within the limit, 1 when one failed or exceeds, 2 when this torch cannot run
the gate (a CPU build: one line saying which torch it needs). Runs on a CUDA build of torch without a GPU:
``scripts/floor-venv cuda`` builds ``.venv-cuda`` (torch 2.14.1 from the wheel on disk).
"""

from __future__ import annotations

if not __package__:  # `python bench/cross_compile.py`: bench imports only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.cross_compile")

import argparse
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import typing as t
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLEX_FWD, FLEX_BWD, OTHER = "flex fwd", "flex bwd", "other"
_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


@dataclasses.dataclass(frozen=True)
class Row:
    """One Triton kernel (one config of it) compiled for the fake device, or one graph that failed."""

    kernel: str
    kind: str
    shared: int | None
    limit: int
    registers: int | None
    spill_bytes: int | None
    ok: bool
    error: str | None
    tile: str = ""
    warps: int | None = None
    stages: int | None = None
    graph: str = ""
    head_dim: int = 0
    options: str = "project"

    def line(self) -> str:
        shared = f"{self.shared:>7,}" if self.shared is not None else "      -"
        regs = f"{self.registers}" if self.registers is not None else "-"
        spill = f"{self.spill_bytes}" if self.spill_bytes is not None else "-"
        verdict = "ok" if self.ok else f"FAIL {self.error}"
        return (
            f"{self.kind:8} {self.kernel[:48]:48} {self.tile:22} w{self.warps or '-'} s{self.stages or '-'} "
            f"{shared} / {self.limit:,}  regs {regs:>3} spill {spill:>5} B  {verdict}"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class Recorder:
    """Wraps ``triton.compile``: each binary's shared memory, warps, stages, tile and cubin become a row."""

    def __init__(self, limit: int, cubins: Path, only_flex: bool) -> None:
        self.limit, self.cubins, self.only_flex = limit, cubins, only_flex
        self.rows: list[Row] = []
        self.graph = ""
        self.case: dict[str, t.Any] = {}  # head_dim and options of the case being compiled, on each row
        self._seen: set[str] = set()

    def install(self) -> None:
        import triton

        real = triton.compile

        def compile(src: t.Any, target: t.Any = None, options: t.Any = None, **kw: t.Any) -> t.Any:
            text = str(getattr(getattr(src, "fn", None), "src", ""))
            kind = FLEX_BWD if "BLOCK_M1" in text else FLEX_FWD if "BLOCK_M" in text and "tem" in text else OTHER
            try:
                binary = real(src, target=target, options=options, **kw)
            except Exception as e:  # a lowering or ptxas failure is a failed row, not a traceback
                name = str(getattr(getattr(src, "fn", None), "__name__", "?"))
                self.rows.append(
                    Row(name, kind, None, self.limit, None, None, False, _first_line(e), graph=self.graph, **self.case)
                )
                raise
            self.record(binary, text, kind)
            return binary

        triton.compile = compile
        if self.only_flex:  # the other kernels are not compiled at all (the flex rows in a fraction of the time)
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner

            precompile = CachingAutotuner.precompile

            def flex_only(tuner: t.Any, *a: t.Any, **k: t.Any) -> t.Any:
                if str(tuner.inductor_meta.get("kernel_name", "")).startswith("triton_tem_"):
                    return precompile(tuner, *a, **k)
                return None

            CachingAutotuner.precompile = flex_only  # type: ignore[method-assign]

    def record(self, binary: t.Any, text: str, kind: str) -> None:
        md = binary.metadata
        if binary.hash in self._seen:
            return
        self._seen.add(binary.hash)
        consts = {
            k: m.group(1) for k in _BLOCKS if (m := re.search(rf"^\s*{k}\s*:\s*tl\.constexpr\s*=\s*(\S+)", text, re.M))
        }
        if kind == FLEX_FWD:
            tile = f"M{consts.get('BLOCK_M')} N{consts.get('BLOCK_N')}"
        elif kind == FLEX_BWD:
            tile = "/".join(str(consts.get(k)) for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
        else:
            tile = ""
        regs, spill = res_usage(binary.asm.get("cubin"), self.cubins / f"{md.name}_{binary.hash[:12]}.cubin")
        shared = int(md.shared)
        ok = shared <= self.limit
        error = None if ok else f"shared memory {shared:,} B exceeds the device's {self.limit:,} B"
        self.rows.append(
            Row(
                md.name,
                kind,
                shared,
                self.limit,
                regs,
                spill,
                ok,
                error,
                tile,
                int(md.num_warps),
                int(md.num_stages),
                self.graph,
                **self.case,
            )
        )


def cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def res_usage(cubin: bytes | None, path: Path) -> tuple[int | None, int | None]:
    """(registers, spill bytes per thread) of a cubin, by ``cuobjdump -res-usage``; (None, None) without one."""
    if not cubin:
        return None, None
    path.write_bytes(cubin)
    out = subprocess.run([cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, timeout=60).stdout
    reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(reg.group(1)) if reg else None), (int(stack.group(1)) if stack else None)


def to_fake_cuda(gm: t.Any, inputs: t.Sequence[t.Any], fake_mode: t.Any) -> tuple[t.Any, list[t.Any]]:
    """A copy of a CPU graph inductor was handed, on fake ``cuda:0``: its ``device=`` arguments, its inputs
    (same shapes and strides, symbolic sizes kept) and each node's fake value (FakeTensorProp)."""
    import torch
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    cuda = torch.device("cuda", 0)
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for name, sub in list(new.named_children()):
        if isinstance(sub, torch.fx.GraphModule):  # flex's score/mask subgraphs: a copy of their own
            setattr(new, name, torch.fx.GraphModule(sub, copy.deepcopy(sub.graph)))

    def move(x: t.Any) -> t.Any:
        return cuda if isinstance(x, torch.device) and x.type == "cpu" else x

    for mod in new.modules():
        if isinstance(mod, torch.fx.GraphModule):
            for node in mod.graph.nodes:
                node.args = torch.fx.node.map_aggregate(node.args, move)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, move)
            mod.recompile()

    def fake(x: t.Any) -> t.Any:
        if isinstance(x, torch.Tensor):
            with fake_mode:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=cuda)
        return x

    ins = [fake(x) for x in inputs]
    with fake_mode:
        FakeTensorProp(new, mode=fake_mode).propagate_dont_convert_inputs(*ins)
    return new, ins


class Gate:
    """inductor's CPU compile of each graph, captured: the graph is compiled for the fake device (rows), and
    the CPU gets the graph itself to run eagerly (the warm-up goes on to its backward and next shape)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.graphs = 0

    def backend(self, gm: t.Any, inputs: t.Any) -> t.Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs, inner_compile=self.inner)

    def inner(self, gm: t.Any, inputs: t.Sequence[t.Any], **kw: t.Any) -> t.Any:
        from torch._functorch._aot_autograd.utils import make_boxed_func
        from torch._guards import TracingContext, tracing
        from torch._inductor.compile_fx import compile_fx_inner

        self.graphs += 1
        name = f"graph {self.graphs} ({'backward' if kw.get('is_backward') else 'forward'})"
        self.recorder.graph = name
        before = len(self.recorder.rows)
        fake_mode = TracingContext.get().fake_mode
        try:
            cuda_gm, cuda_ins = to_fake_cuda(gm, inputs, fake_mode)
            with tracing(TracingContext(fake_mode)), fake_mode:
                compile_fx_inner(cuda_gm, cuda_ins, **{**kw, "cudagraphs": None})
        except Exception as e:  # noqa: BLE001  # a graph that fails to lower: a failed row, the CPU run goes on
            if os.environ.get("CROSS_COMPILE_TRACEBACK"):
                import traceback

                traceback.print_exc()
            if len(self.recorder.rows) == before or all(r.ok for r in self.recorder.rows[before:]):
                self.recorder.rows.append(
                    Row(
                        name,
                        OTHER,
                        None,
                        self.recorder.limit,
                        None,
                        None,
                        False,
                        _first_line(e),
                        graph=name,
                        **self.recorder.case,
                    )
                )
        return make_boxed_func(gm.forward)


def run_config(head_dim: int, kind: str) -> t.Any:
    """The tiny run's config with the head dim and kind asked, bf16 like the box, one drafter layer, and
    small sizes that still reach every shape class (block 16: queries < 128, = 128 and more; keys above 128)."""
    from dflash.config import load_config

    return load_config(
        REPO / "configs" / "tiny-random.toml",
        [
            f"target.tiny.head_dim={head_dim}",
            "target.dtype=bfloat16",
            "drafter.dtype=bfloat16",
            "drafter.layers=1",
            f"drafter.kind={kind}",
            "drafter.block_size=16",
            "drafter.num_anchors=12",
            "data.max_length=300",
            "data.batch_size=2",
        ],
    )


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile of the step: a head dim and whose flex tiles (the project's or torch's own)."""

    head_dim: int
    options: str = "project"

    @classmethod
    def parse(cls, text: str) -> Case:
        dim, _, options = text.partition(":")
        if not dim.isdigit() or options not in ("", "project", "torch-default"):
            raise argparse.ArgumentTypeError(f"{text!r}: want HEAD_DIM or HEAD_DIM:project|torch-default")
        return cls(int(dim), options or "project")


def compile_step(case: Case, args: argparse.Namespace, recorder: Recorder, dev: t.Any) -> list[Row]:
    """The drafter step of ``args``' kind and ``case``'s head dim, warmed up as a run warms it, through the
    gate; its rows (the first case's models are built before the fake device exists: their seeding would
    reach for its generators; a later case's seeding goes to the fake device's no-op)."""
    import types

    import torch

    from bench import fake_cuda
    from dflash.model import drafter as drafter_mod
    from dflash.models import drafter_spec, initial_drafter, load_target
    from dflash.train.compile import prepare_drafter, set_flex_block_options, shapes_for, warm_up
    from dflash.train.replicas import ReplicaConfig

    torch._dynamo.reset()  # a case after another: its own graphs, not the last case's guards
    cfg = run_config(case.head_dim, args.kind)
    target = load_target(cfg, "cpu")
    spec = drafter_spec(cfg, target)
    model = initial_drafter(spec.config, seed=0).to(torch.bfloat16)
    model.train()
    replica = types.SimpleNamespace(model=model, head=target.head(), device="cpu", cfg=ReplicaConfig.of(cfg))
    if not fake_cuda.installed():
        fake_cuda.install(dev)
        recorder.install()
    recorder.case = {"head_dim": case.head_dim, "options": case.options}
    before = len(recorder.rows)
    # the project's choice for the fake device's properties (a stand-in replica on cuda:0 reads them)
    set_flex_block_options([types.SimpleNamespace(device="cuda:0", model=model)])
    if case.options == "torch-default":
        for key in [k for k in drafter_mod.FLEX_KERNEL_OPTIONS if k != "BACKEND"]:
            del drafter_mod.FLEX_KERNEL_OPTIONS[key]  # type: ignore[misc]
    drafter_mod.FLEX_KERNEL_OPTIONS.update(args.set or {})  # type: ignore[typeddict-item]  # --set: a sweep
    print(
        f"cross_compile: kernel options at head dim {case.head_dim}: {dict(drafter_mod.FLEX_KERNEL_OPTIONS)}",
        flush=True,
    )
    gate = Gate(recorder)
    prepare_drafter(model, activation_checkpointing=True, compile=True, backend=gate.backend, dynamic=True)
    shapes = shapes_for(t.cast(t.Any, replica), attention="flex")
    if args.shapes:
        shapes = shapes[: args.shapes]
    warm_up(
        t.cast(t.Any, replica),
        feature_size=target.feature_size,
        vocab_size=target.vocab_size,
        mask_token_id=spec.mask_token_id,
        attention="flex",
        shapes=shapes,
    )
    return recorder.rows[before:]


def kernel_option(text: str) -> tuple[str, int]:
    key, _, value = text.partition("=")
    if not re.fullmatch(r"(fwd_|bwd_)?(BLOCK_[MN][12]?|num_warps|num_stages)", key) or not value.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=INT, KEY a flex tile option (bwd_num_warps, ...)")
    return key, int(value)


def parse(argv: t.Sequence[str] | None) -> argparse.Namespace:
    from bench.fake_cuda import DEVICES

    ap = argparse.ArgumentParser(prog="python -m bench.cross_compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--capability", choices=list(DEVICES), default="12.0")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kind", choices=["dflash", "dflash2"], default="dflash")
    ap.add_argument("--only", choices=["flex"], default=None, help="rows of the flex kernels only")
    ap.add_argument("--options", choices=["project", "torch-default"], default="project")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--shapes", type=int, default=0, help="the first N warm-up shape classes only (0: all)")
    ap.add_argument(
        "--case",
        type=Case.parse,
        action="append",
        default=None,
        metavar="HEAD_DIM[:OPTIONS]",
        help="compile this head dim (and options) too, in this process (repeated; replaces --head-dim/--options)",
    )
    ap.add_argument(
        "--set",
        type=kernel_option,
        action="append",
        default=None,
        metavar="KEY=INT",
        help="a flex kernel option over the chosen ones, e.g. bwd_num_warps=8 (repeated; a tile sweep)",
    )
    ap.add_argument("--any-torch", action="store_true", help="try a torch version the patches were not checked on")
    args = ap.parse_args(argv)
    args.set = dict(args.set or [])
    return args


def main(argv: t.Sequence[str] | None = None) -> int:
    args = parse(argv)
    from bench import fake_cuda

    try:
        fake_cuda.check_torch(args.any_torch)
    except fake_cuda.Unsupported as e:
        print(f"cross_compile: {e}", file=sys.stderr)
        return 2
    dev = fake_cuda.DEVICES[args.capability]
    cases = args.case or [Case(args.head_dim, args.options)]
    import torch

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="cross_compile-") as tmp:
        recorder = Recorder(dev.smem_optin, Path(tmp), args.only == "flex")
        for case in cases:
            got = compile_step(case, args, recorder, dev)
            if args.only == "flex":
                got = [r for r in got if r.kind != OTHER or not r.ok]
            options = "" if case.options == "project" else f", {case.options} options"
            print(
                f"cross_compile: torch {torch.__version__}, {dev.arch} ({dev.name}), head dim {case.head_dim}, "
                f"{args.kind}{options}"
            )
            for r in got:
                print(r.line())
            rows += got or [
                Row(
                    f"head dim {case.head_dim}",
                    OTHER,
                    None,
                    dev.smem_optin,
                    None,
                    None,
                    False,
                    "no kernel compiled",
                    **recorder.case,
                )
            ]
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    bad = [r for r in rows if not r.ok]
    for r in bad:
        print(f"cross_compile: head dim {r.head_dim} {r.kind} {r.kernel}: {r.error}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.exit(main())
