"""A fake CUDA device for ``bench.cross_compile``: every private torch and Triton internal it patches, in one place.

    python -m bench.fake_cuda      # says in one line whether this torch can run the gate (exit 0) or not (2)

inductor and Triton compile real CUDA kernels without a GPU once torch believes a device of a chosen
capability is there: ``torch.cuda``'s queries and properties, dynamo's ``CudaInterface`` (inductor reads the
device through it), FakeTensor's GPU context, and a Triton driver whose target is ``GPUTarget("cuda", cc,
32)``. Loading a cubin is the one step that needs a driver: inductor's launcher making is turned off, so a
compile ends with its kernels built and nothing run. Not a module of the project: a bench tool, needs a CUDA
build of torch (its CUDA libraries import without a GPU or libcuda).

Checked on torch 2.11 (triton 3.6) and 2.14 (triton 3.8): ``CHECKED``; another version is refused in one
line (``--any-torch`` tries anyway).
"""

from __future__ import annotations

if not __package__:  # `python bench/fake_cuda.py`: bench imports only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.fake_cuda")

import dataclasses
import types
import typing as t

import torch

# torch minor versions these patches were checked on (each patched name below exists there)
CHECKED = ("2.11", "2.14")


@dataclasses.dataclass(frozen=True)
class Device:
    """A capability and the numbers inductor and Triton read from its properties."""

    major: int
    minor: int
    name: str
    smem_optin: int  # shared_memory_per_block_optin: what Triton checks a kernel's shared memory against
    sms: int

    @property
    def cc(self) -> int:
        return self.major * 10 + self.minor

    @property
    def arch(self) -> str:
        return f"sm_{self.cc}"


DEVICES = {
    "12.0": Device(12, 0, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 101_376, 188),
    "9.0": Device(9, 0, "NVIDIA H200", 232_448, 132),
    "10.0": Device(10, 0, "NVIDIA B200", 232_448, 148),
    "8.0": Device(8, 0, "NVIDIA A100-SXM4-80GB", 166_912, 108),
}


class Unsupported(Exception):
    """This torch cannot run the gate (a CPU build, or a version the patches were not checked on)."""


def check_torch(any_torch: bool = False) -> None:
    """Raise ``Unsupported`` with the one line to print when this torch cannot run the gate."""
    if not torch.version.cuda:
        raise Unsupported(
            f"torch {torch.__version__} is a CPU build; the gate needs a CUDA build of torch (no GPU needed): "
            "the 2.14.1 CUDA wheel (scripts/floor-venv cuda builds .venv-cuda) or the 2.11.0+cu130 floor"
        )
    minor = ".".join(torch.__version__.split(".")[:2])
    if minor not in CHECKED and not any_torch:
        raise Unsupported(
            f"torch {torch.__version__}: the fake device's patches were checked on torch {', '.join(CHECKED)} "
            "only (bench/fake_cuda.py); --any-torch tries anyway"
        )


def _props(dev: Device) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=dev.name,
        major=dev.major,
        minor=dev.minor,
        multi_processor_count=dev.sms,
        total_memory=96 * 2**30,
        regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=1536 if dev.major == 12 else 2048,
        max_threads_per_block=1024,
        warp_size=32,
        shared_memory_per_block_optin=dev.smem_optin,
        shared_memory_per_block=49152,
        shared_memory_per_multiprocessor=dev.smem_optin + 1024,
        max_shared_memory_per_multiprocessor=dev.smem_optin + 1024,
        L2_cache_size=96 * 2**20,
        gcnArchName="",
        uuid="fake",
        clock_rate=2_000_000,
        memory_clock_rate=1_000_000,
        memory_bus_width=512,
        is_integrated=False,
        is_multi_gpu_board=False,
        pci_bus_id=0,
        pci_device_id=0,
        pci_domain_id=0,
    )


def _stream() -> t.Callable[..., torch.Stream]:
    # a new function each time: dynamo keys its handlers by function, and refuses one registered twice
    return lambda *_a, **_k: torch.Stream(stream_id=0, device_index=0, device_type=1)


def _set_all(obj: t.Any, fns: dict[str, t.Callable[..., t.Any]], *, static: bool = False) -> None:
    for name, fn in fns.items():
        setattr(obj, name, staticmethod(fn) if static else fn)


def _patch_torch_cuda(dev: Device, props: types.SimpleNamespace) -> None:
    """torch.cuda, torch._C's CUDA entry points, torch.accelerator: one device of ``dev``'s capability."""
    import torch.cuda.graphs as graphs

    # a new function per name (see _stream)
    def zero() -> t.Callable[..., int]:
        return lambda *_a, **_k: 0

    def none() -> t.Callable[..., None]:
        return lambda *_a, **_k: None

    def true() -> t.Callable[..., bool]:
        return lambda *_a, **_k: True

    _set_all(
        torch.cuda,
        dict(
            is_available=true(),
            _exchange_device=zero(),
            _maybe_exchange_device=zero(),
            device_count=lambda: 1,
            current_device=zero(),
            get_device_capability=lambda d=None: (dev.major, dev.minor),
            get_device_properties=lambda d=None: props,
            get_device_name=lambda d=None: dev.name,
            set_device=none(),
            _lazy_init=none(),
            is_initialized=true(),
            is_bf16_supported=true(),
            synchronize=none(),
            get_rng_state=lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
            set_rng_state=none(),
            get_rng_state_all=lambda: [],
            set_rng_state_all=none(),
            is_current_stream_capturing=lambda: False,
            current_stream=_stream(),
            default_stream=_stream(),
            manual_seed_all=lambda *a: None,
        ),
    )
    graphs.is_current_stream_capturing = lambda: False
    c = torch._C
    _set_all(
        c,
        dict(
            _cuda_isCurrentStreamCapturing=lambda: False,
            _cuda_getDeviceCount=lambda: 1,
            _cuda_getDevice=zero(),
            _cuda_exchangeDevice=zero(),
            _cuda_maybeExchangeDevice=zero(),
            _cuda_setDevice=none(),
            _cuda_getCurrentRawStream=zero(),
        ),
    )
    if hasattr(torch, "accelerator"):
        _set_all(
            torch.accelerator,
            dict(
                current_stream=_stream(),
                current_device_index=lambda: 0,
                is_available=lambda: True,
                device_count=lambda: 1,
            ),
        )


def _patch_dynamo_and_fake(dev: Device, props: types.SimpleNamespace) -> None:
    """dynamo's CudaInterface (inductor's view of the device), FakeTensor's GPU context, inductor's
    joint-graph set-up and fake-tensor updater (both make real tensors), flex's stride permutation (its
    copy_ enters the C++ CUDA guard), flex's CPU-backward refusal (the joint is traced on CPU) and the
    reinplace pass's scatter check (a copy_ too)."""
    import importlib

    from torch._dynamo import device_interface
    from torch._inductor import fx_utils
    from torch._inductor.fx_passes import joint_graph
    from torch._subclasses import fake_tensor

    # the modules (``from torch._higher_order_ops import flex_attention`` is the operator)
    flex_hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    flex_api = importlib.import_module("torch.nn.attention.flex_attention")

    cuda = device_interface.CudaInterface
    _set_all(
        cuda,
        dict(
            is_available=lambda: True,
            device_count=lambda: 1,
            current_device=lambda: 0,
            get_device_properties=lambda d=None: props,
            get_compute_capability=lambda d=None: dev.cc,
            set_device=lambda d: None,
            exchange_device=lambda d: 0,
            maybe_exchange_device=lambda d: 0,
            synchronize=lambda *a: None,
            is_bf16_supported=lambda *a, **k: True,
            get_raw_stream=lambda d: 0,
            memory_allocated=lambda *a: 0,
        ),
        static=True,
    )
    _set_all(
        cuda.Worker,
        dict(get_device_properties=lambda d=None: props, current_device=lambda: 0, set_device=lambda d: None),
        static=True,
    )
    fake_tensor.init_gpu_context = lambda *a, **k: None
    joint_graph.lazy_init = lambda *a, **k: None
    fx_utils.FakeTensorUpdater.incremental_update = lambda self, *a, **k: 0

    def permute_strides(out: torch.Tensor, query_strides: tuple[int, ...]) -> torch.Tensor:
        from torch._inductor.ir import get_fill_order, get_stride_order

        order = get_fill_order(get_stride_order(query_strides))
        strides = flex_hop._construct_strides(out.shape, order)
        return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)

    if hasattr(flex_hop, "_permute_strides"):
        flex_hop._permute_strides = permute_strides
    flex_api._validate_device = lambda *a: None
    _patch_reinplace()
    try:
        torch.utils._triton.has_triton.cache_clear()
    except AttributeError:
        pass


def _patch_reinplace() -> None:
    """inductor's reinplace pass checks a scatter's source against its view by a fake ``copy_``, which on a
    fake CUDA tensor enters the C++ CUDA guard ("CUDA driver version is insufficient": DFlash2's backward,
    a select_scatter): the same check by shapes. The views are applied as the original applies them."""
    from contextlib import nullcontext

    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes import reinplace
    from torch.utils import _pytree as pytree

    if not hasattr(reinplace, "_inplace_generalized_scatter"):
        return

    def inplace_generalized_scatter(inp: torch.Tensor, src: torch.Tensor, view_ops: list[t.Any]) -> torch.Tensor:
        tmp = inp
        for view in view_ops:
            args, kwargs = pytree.tree_map(
                lambda n: n.meta["val"] if isinstance(n, torch.fx.Node) else n, (view.args, view.kwargs)
            )
            mode = detect_fake_mode(args)
            env = mode.shape_env if mode else None
            with env.ignore_fresh_unbacked_symbols() if env else nullcontext():
                tmp = view.target(tmp, *args, **kwargs)
        if tuple(torch.broadcast_shapes(src.shape, tmp.shape)) != tuple(tmp.shape):
            raise RuntimeError(f"shape error in scatter op, can not broadcast {src.shape} to {tmp.shape}")
        return inp

    reinplace._inplace_generalized_scatter = inplace_generalized_scatter


def _patch_triton(dev: Device) -> None:
    """A Triton driver whose target is ``dev``; inductor's launchers (they load the cubin) off."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Utils:
        def get_device_properties(self, device: int) -> dict[str, int]:
            return {
                "max_shared_mem": dev.smem_optin,
                "multiprocessor_count": dev.sms,
                "sm_clock_rate": 2_000_000,
                "mem_clock_rate": 1_000_000,
                "mem_bus_width": 512,
                "max_num_regs": 65536,
                "warpSize": 32,
            }

    class Driver:
        utils = Utils()
        backend = "cuda"

        @staticmethod
        def is_active() -> bool:
            return True

        def get_current_target(self) -> t.Any:
            return GPUTarget("cuda", dev.cc, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cuda", 0)

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, d: int) -> None:
            pass

        def get_current_stream(self, d: int | None = None) -> int:
            return 0

        def get_device_interface(self) -> t.Any:
            return torch.cuda

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.nvidia.driver import ty_to_cpp

            return str(ty_to_cpp(ty))

    driver.set_active(Driver())
    import torch._inductor.runtime.triton_helpers as helpers
    import torch._inductor.runtime.triton_heuristics as heuristics

    helpers.set_driver_to_gpu = lambda: None
    heuristics.CachingAutotuner._make_launchers = lambda self: None


_installed: list[Device] = []


def installed() -> bool:
    """Whether ``install`` has patched this process (a second device would mix two targets: refused)."""
    return bool(_installed)


def install(dev: Device) -> None:
    """Patch torch, inductor and Triton for one fake ``cuda:0`` of ``dev``'s capability (process-wide, for
    good: the gate is a process of its own). Compiles run in this process, one thread, no caches."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if _installed:
        if _installed[0] != dev:
            raise RuntimeError(f"fake_cuda: this process is {_installed[0].arch} already, not {dev.arch}")
        return
    _installed.append(dev)
    props = _props(dev)
    _patch_torch_cuda(dev, props)
    _patch_dynamo_and_fake(dev, props)
    _patch_triton(dev)
    functorch_config.force_non_lazy_backward_lowering = True
    inductor_config.compile_threads = 1
    inductor_config.force_disable_caches = True


def main() -> int:
    try:
        check_torch()
    except Unsupported as e:
        print(f"fake_cuda: {e}")
        return 2
    print(f"fake_cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) can run the gate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
