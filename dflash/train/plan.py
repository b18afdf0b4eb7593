"""``dflash plan``: whether a run fits its GPUs and its host, from the configs alone (no weights, no GPU).

The target's config.json is read (``model_config.read``, then transformers' config class) and the target
is built on the meta device: its parameter bytes are exact for whatever ``AutoModelForCausalLM`` builds,
and no byte of weights is read. The drafter is built on the meta device from the same config the run
builds (``draft_config_for``). Everything else is arithmetic on the run config's shapes at the LONGEST
batch (``data.max_length``, the rows ``data.batch_size`` / ``max_batch_tokens`` allow at that length) and
the MOST anchors (``drafter.num_anchors``, at most ``max_length - 1`` per row):

- a target GPU: the weights, and one forward's peak (the captured feature layers, their concatenation,
  one decoder layer's transients; a padded [rows, 1, S, S] mask when rows > 1);
- a drafter GPU: the target's frozen embedding and lm_head, the features of the batch it trains on and
  of the one it prefetches, the drafter's parameters + fp32 masters + optimizer state + gradients
  (``optimizer_bytes``: AdamW's two moments, or Muon's one momentum for its matrices), and the activations
  of one step, with and without activation checkpointing (``activation_bytes``: one term per saved
  tensor of a layer; a sliding window changes no saved tensor on a GPU, where flex attention skips the tiles outside it, and adds one mask off it: ``_dense_mask``);
- the host: the queue's pinned bytes (``feature_queue.default_max_bytes``, the run's own bound, plus one
  item over it and the host allocator's cache kept up to the bound) and the checkpoint snapshot
  (every tensor's pinned block), and any device that is the CPU.

Every GPU also keeps ``GPU_RESERVE`` for the CUDA context, cuBLAS/NCCL workspaces and the caching
allocator's slack. A run that does not fit is one line naming the device, what it needs, and the nearest
setting that fits (``nearest``): activation checkpointing, fewer anchors, one row per batch, a shorter
max_length, or a smaller queue bound, tried in that order.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing as t

import torch

from dflash.config import ConfigError, RunConfig
from dflash.dtypes import torch_dtype
from dflash.errors import Failed, InputError
from dflash.model import model_config
from dflash.model.drafter import DFLASH2_KEYS, DFlashDraftModel, draft_config_for
from dflash.model.target import build_target_layer_ids, tiny_target_config_of
from dflash.train.feature_queue import default_max_bytes, feature_item_bytes, format_bytes, pinned_block
from dflash.train.optimizer import muon_split

# Sequences per update summed over the drafters when optim.sequences_per_update is not set: the published
# Qwen3-8B DFlash recipe (4 sequences per GPU x 8 GPUs).
UPDATE_SEQUENCES = 32
GPU_RESERVE = 2 << 30  # per GPU: CUDA context (~0.5 GiB), cuBLAS/NCCL workspaces, caching-allocator slack
FP32 = 4

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


class DoesNotFit(Failed):
    """The run needs more memory than a device or the host has (one line: what, and the nearest fit)."""


def parse_size(text: str, what: str) -> int:
    """``96GiB``, ``96G`` (binary), ``103GB`` (decimal), ``512 GiB``, a plain number of bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise ConfigError(what, f"{text!r} is not a size (e.g. 96GiB, 80GB, 141G)")
    unit = (m.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    base = 1000 if unit.endswith("B") and not unit.endswith("IB") and unit != "B" else 1024
    return int(float(m.group(1)) * base**power)


# --------------------------------------------------------------------------------------------
# Shapes: what the configs say


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The target's and the drafter's sizes, from their configs alone."""

    target_name: str
    target_params: int
    target_bytes: int  # parameters and buffers (tied tensors once), in target.dtype
    head_bytes: int  # the embedding and lm_head a drafter GPU holds (tied: once)
    target_itemsize: int
    hidden: int
    intermediate: int
    mixer_width: int  # the widest token-mixer projection per token (q + k + v [+ gate], or linear attention's)
    feature_layers: int
    vocab: int
    drafter_tensors: tuple[int, ...]  # numel of each trainable drafter tensor
    drafter_muon_params: int  # of those, what optim.name = "muon" gives Muon (its matrices: one momentum each)
    drafter_itemsize: int
    drafter_heads: int
    drafter_kv_heads: int
    drafter_head_dim: int
    drafter_intermediate: int
    drafter_layers: int

    @property
    def drafter_params(self) -> int:
        return sum(self.drafter_tensors)


def _target_config(cfg: RunConfig) -> t.Any:
    if cfg.target.tiny is not None:
        return tiny_target_config_of(cfg.target.tiny)
    from transformers import AutoConfig

    path = t.cast(str, cfg.target.path)
    try:
        model_config.read(path, "target.path")  # bounded and checked: a broken file is one line
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except InputError:  # model_config's own line names the file and the key already
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError("target.path", f"cannot read {path}/config.json: {str(e).splitlines()[0]}") from None


def read_shapes(cfg: RunConfig) -> Shapes:
    """The target built on the meta device from its config.json, the drafter from the run's settings."""
    from transformers import AutoModelForCausalLM

    config = _target_config(cfg)
    dtype = torch_dtype(cfg.target.dtype)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, KeyError) as e:  # an architecture transformers does not build
        raise ConfigError("target.path", f"transformers cannot build this target: {str(e).splitlines()[0]}") from None
    tensors = {id(p): p for p in (*model.parameters(), *model.buffers())}.values()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_ids = {id(embed)} | ({id(head.weight)} if head is not None else set())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = cfg.drafter
    layers = int(text.num_hidden_layers)
    ids = list(d.target_layer_ids) if d.target_layer_ids else build_target_layer_ids(layers, d.layers)
    dflash2 = {k: int(getattr(d, k)) for k in DFLASH2_KEYS} if d.kind == "dflash2" else None
    # an own draft vocabulary: the drafter's own (trainable) head of draft_vocab_size rows
    own: dict[str, t.Any] = (
        {"draft_vocab_size": d.draft_vocab_size, "has_own_lm_head": True} if d.draft_vocab_size else {}
    )
    draft = draft_config_for(
        config,
        num_layers=d.layers,
        block_size=d.block_size,
        mask_token_id=0,
        target_layer_ids=ids,
        dflash2=dflash2,
        **own,
    )
    with torch.device("meta"):
        drafter = DFlashDraftModel(draft)
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    heads, kv = (
        int(text.num_attention_heads),
        int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
    )
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    attention = (heads * (2 if getattr(text, "attn_output_gate", False) else 1) + 2 * kv) * head_dim
    linear = 0
    if getattr(text, "linear_num_value_heads", None):  # Gated DeltaNet: q, k, v, z, and the gates
        k_dim = int(text.linear_num_key_heads) * int(text.linear_key_head_dim)
        v_dim = int(text.linear_num_value_heads) * int(text.linear_value_head_dim)
        linear = 2 * k_dim + 2 * v_dim
    return Shapes(
        target_name=type(model).__name__,
        target_params=sum(p.numel() for p in model.parameters()),
        target_bytes=sum(x.numel() * x.element_size() for x in tensors),
        head_bytes=sum(x.numel() * x.element_size() for x in tensors if id(x) in head_ids),
        target_itemsize=dtype.itemsize,
        hidden=int(text.hidden_size),
        intermediate=int(text.intermediate_size),
        mixer_width=max(attention, linear),
        feature_layers=len(ids),
        vocab=int(embed.shape[0]),
        drafter_tensors=tuple(p.numel() for p in drafter.parameters()),
        drafter_muon_params=sum(named[i][1].numel() for i in muon_split(named)[0]),
        drafter_itemsize=torch_dtype(d.dtype).itemsize,
        drafter_heads=int(draft.num_attention_heads),
        drafter_kv_heads=int(t.cast(int, draft.num_key_value_heads)),
        drafter_head_dim=int(draft.head_dim),
        drafter_intermediate=int(draft.intermediate_size),
        drafter_layers=d.layers,
    )


# --------------------------------------------------------------------------------------------
# The terms


@dataclasses.dataclass(frozen=True)
class Batch:
    """The longest batch: rows of ``seq`` tokens, ``anchors`` blocks of ``block`` per row."""

    rows: int
    seq: int
    anchors: int
    block: int

    @classmethod
    def longest(cls, cfg: RunConfig) -> Batch:
        d = cfg.data
        rows = (
            d.batch_size
            if d.max_batch_tokens is None
            else max(1, min(d.batch_size, d.max_batch_tokens // d.max_length))
        )
        anchors = max(1, min(cfg.drafter.num_anchors, d.max_length - 1))
        return cls(rows, d.max_length, anchors, cfg.drafter.block_size)

    @property
    def queries(self) -> int:
        return self.rows * self.anchors * self.block


def target_forward_bytes(s: Shapes, b: Batch) -> int:
    """One target forward's peak (no grad): the feature layers it keeps, their concatenation, one layer's
    transients (residual, norm, the mixer's projections, the MLP's gate/up/product), the padding mask."""
    tokens, e = b.rows * b.seq, s.target_itemsize
    layer = tokens * (2 * s.hidden + s.mixer_width + 3 * s.intermediate) * e
    feature = tokens * s.hidden * e
    mask = b.rows * b.seq * b.seq if b.rows > 1 else 0  # transformers' [rows, 1, S, S] bool mask for padded rows
    return max((s.feature_layers - 1) * feature + layer, 2 * s.feature_layers * feature) + mask


def _keys(b: Batch) -> int:
    """Keys a drafter layer projects: the whole context and the blocks (a sliding window cuts only what a
    query attends to, not what is projected)."""
    return b.rows * (b.seq + b.anchors * b.block)


def _dense_mask(b: Batch) -> int:
    """Off the GPU the mask is a dense bool [rows, 1, Q, K] (SDPA's CPU kernel is a flash kernel: no scores
    are kept). A sliding window's layers get one more such mask."""
    q, k = b.anchors * b.block, b.seq + b.anchors * b.block
    return b.rows * q * k


def activation_bytes(s: Shapes, b: Batch, *, checkpointing: bool, chunk: int, dense: bool) -> int:
    """One drafter step's activations: what the forward saves for the backward, the backward's working set,
    and one loss chunk's logits (``drafter.loss_chunk`` blocks through lm_head in fp32)."""
    e, h, q, keys, ctx = s.drafter_itemsize, s.hidden, b.queries, _keys(b), b.rows * b.seq
    qd, kvd, inter = (
        s.drafter_heads * s.drafter_head_dim,
        s.drafter_kv_heads * s.drafter_head_dim,
        s.drafter_intermediate,
    )
    # per layer: residual, norms, o_proj and MLP outputs (6H); q's projection, norm, rope and attention
    # output (4 qd); the MLP's gate, up, activation and product (4I); [context; block] and k's projection,
    # norm, rope and v (H + 5 kvd) over every key; the attention's log-sum-exp (fp32)
    layer = e * (q * (6 * h + 4 * qd + 4 * inter) + keys * (h + 5 * kvd)) + q * s.drafter_heads * FP32
    # once: fc and hidden_norm over the context, the block's embedding, final norm, the loss's kept blocks,
    # RoPE's cos/sin over every key
    once = e * (2 * ctx * h + 4 * q * h + 2 * keys * s.drafter_head_dim)
    backward = e * (keys * (h + 2 * kvd) + q * (2 * h + 2 * inter + 2 * qd) + ctx * h)
    rows = min(chunk or b.rows * b.anchors, b.rows * b.anchors) * b.block
    loss = rows * s.vocab * (s.target_itemsize + 3 * FP32)  # logits, fp32 logits, log-softmax, their grad
    saved = s.drafter_layers * (e * q * h) + layer if checkpointing else s.drafter_layers * layer
    return saved + once + backward + loss + (_dense_mask(b) if dense else 0)


def optimizer_bytes(cfg: RunConfig, s: Shapes) -> int:
    """Optimizer state per drafter replica: AdamW's two fp32 moments per master; with Muon, one fp32 momentum
    per master of its matrices and AdamW's two for the rest (dflash.train.optimizer.muon_split)."""
    if cfg.optim.name == "muon":
        return FP32 * s.drafter_muon_params + 2 * FP32 * (s.drafter_params - s.drafter_muon_params)
    return 2 * FP32 * s.drafter_params


def drafter_state(cfg: RunConfig, s: Shapes) -> dict[str, int]:
    """A drafter replica's parameters, fp32 masters (when it trains in another dtype), optimizer state and
    gradients (the model's own, and the fp32 sum the micro-batches fold into)."""
    n, e = s.drafter_params, s.drafter_itemsize
    separate = e != FP32
    return {
        "parameters": n * e,
        "fp32 masters": n * FP32 if separate else 0,
        "optimizer": optimizer_bytes(cfg, s),
        "gradients": n * e + (n * FP32 if separate else 0),
    }


def accumulate(cfg: RunConfig) -> int:
    """Batches per drafter update (the run's rule: ``Run._derive_steps``)."""
    spu = cfg.optim.sequences_per_update or math.ceil(UPDATE_SEQUENCES / len(cfg.devices.drafters))
    return math.ceil(spu / cfg.data.batch_size)


def queue_terms(cfg: RunConfig, s: Shapes) -> tuple[int, int, int]:
    """(the bound, one item at the largest batch, pinned): the run's ``queue.max_bytes`` or its derivation."""
    tokens = cfg.data.max_batch_tokens or cfg.data.batch_size * cfg.data.max_length
    gpus = [dv for dv in (*cfg.devices.targets, *cfg.devices.drafters) if dv.startswith("cuda")]
    pinned = bool(gpus) and cfg.devices.targets[0].startswith("cuda")
    item = feature_item_bytes(tokens, s.feature_layers * s.hidden, s.target_itemsize, pinned=pinned)
    if cfg.queue.max_bytes is not None:
        return cfg.queue.max_bytes, item, pinned
    drafters, targets = len(cfg.devices.drafters), len(cfg.devices.targets)
    return (
        default_max_bytes(drafters=drafters, targets=targets, accumulate=accumulate(cfg), item_bytes=item),
        item,
        pinned,
    )


def snapshot_bytes(cfg: RunConfig, s: Shapes) -> int:
    """A checkpoint's CPU snapshot of one replica: weights, and with ``checkpoint.optimizer`` the two
    moments and the fp32 masters; from a GPU each tensor is a pinned block (a power of two)."""
    gpu = cfg.devices.drafters[0].startswith("cuda")
    block = pinned_block if gpu else (lambda n: n)
    per = [block(n * s.drafter_itemsize) for n in s.drafter_tensors]
    if cfg.checkpoint.optimizer:
        copies = 3 if s.drafter_itemsize != FP32 else 2
        per += [copies * block(n * FP32) for n in s.drafter_tensors]
    return sum(per)


# --------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Budget:
    """One device (or the host): its figures, and what it has (None: not known, not judged)."""

    name: str
    roles: tuple[str, ...]
    figures: tuple[tuple[str, int], ...]
    capacity: int | None
    other: int = 0  # activations at the other activation-checkpointing setting (a drafter GPU's)

    def get(self, label: str) -> int:
        return sum(v for k, v in self.figures if k == label)

    @property
    def total(self) -> int:
        return sum(v for _, v in self.figures)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    shapes: Shapes
    batch: Batch
    gpus: tuple[Budget, ...]
    host: Budget

    @property
    def fits(self) -> bool:
        return self.host.fits and all(g.fits for g in self.gpus)

    def first_over(self) -> Budget | None:
        over = [b for b in (*self.gpus, self.host) if not b.fits]
        return max(over, key=lambda b: b.total - t.cast(int, b.capacity)) if over else None


def make_plan(cfg: RunConfig, s: Shapes, *, gpu_memory: t.Callable[[str], int | None], host_memory: int | None) -> Plan:
    """Every device's figures and the host's; ``gpu_memory(device)``: its bytes, None when not known."""
    b = Batch.longest(cfg)
    ac = cfg.activation_checkpointing
    queue_bound, item, pinned = queue_terms(cfg, s)
    shared = not pinned or cfg.queue.mode == "per-drafter" or len(set(cfg.devices.drafters)) == 1
    figures: dict[str, list[tuple[str, int]]] = {}
    roles: dict[str, list[str]] = {}
    other: dict[str, int] = {}
    feats = b.rows * b.seq * s.feature_layers * s.hidden * s.target_itemsize
    for dev in cfg.devices.targets:
        roles.setdefault(dev, []).append("target")
        # the concatenated features are the forward's output, held until copied off: the rest is transient
        forward = target_forward_bytes(s, b) - feats
        figures.setdefault(dev, []).extend([("weights", s.target_bytes), ("features", feats), ("activations", forward)])
    drafters = cfg.devices.drafters
    for dev in drafters:
        roles.setdefault(dev, []).append("drafter")
        dense = not dev.startswith("cuda")  # flex attention on a GPU; a dense mask and SDPA's math path elsewhere
        act = {
            on: activation_bytes(s, b, checkpointing=on, chunk=cfg.drafter.loss_chunk, dense=dense)
            for on in (False, True)
        }
        other[dev] = other.get(dev, 0) + act[not ac]
        in_flight = 2 * feats  # the batch it trains on and the next one, prefetched
        if shared and dev.startswith("cuda"):  # the queue's items live on this GPU, not in pinned host memory
            in_flight += queue_bound // len(set(drafters))
        figures.setdefault(dev, []).extend(
            [
                ("weights", s.head_bytes),
                ("features", in_flight),
                *drafter_state(cfg, s).items(),
                ("activations", act[ac]),
            ]
        )
    gpus = []
    cpu_total = 0
    for dev, figs in figures.items():
        if dev.startswith("cuda"):
            figs.append(("reserve", GPU_RESERVE))
            gpus.append(Budget(dev, tuple(roles[dev]), tuple(figs), gpu_memory(dev), other.get(dev, 0)))
        else:
            budget = Budget(dev, tuple(roles[dev]), tuple(figs), None, other.get(dev, 0))
            gpus.append(budget)
            cpu_total += budget.total
    host_figs = [("checkpoint snapshot", snapshot_bytes(cfg, s))]
    if pinned and not shared:
        # held: the bound and one item over it (the queue's over-bound path); cached: trimmed above the bound
        host_figs += [("queue pinned (held)", queue_bound + item), ("queue pinned (cached)", queue_bound)]
    if cpu_total:
        host_figs.append(("cpu devices", cpu_total))
    return Plan(cfg, s, b, tuple(gpus), Budget("host", ("host",), tuple(host_figs), host_memory))


# --------------------------------------------------------------------------------------------
# The nearest setting that fits


def _candidates(cfg: RunConfig) -> t.Iterator[tuple[str, RunConfig]]:
    """Settings to try, in order: activation checkpointing; then with it, fewer anchors (the most that
    fit); one row per batch; a shorter max_length (the longest that fits, in 1,024s); a smaller queue bound."""
    r = dataclasses.replace
    base, sets = cfg, []
    if not cfg.activation_checkpointing:
        base, sets = r(cfg, activation_checkpointing=True), ["activation_checkpointing=true"]
        yield " ".join(f"--set {x}" for x in sets), base
    d = base.drafter
    for a in range(min(d.num_anchors, base.data.max_length - 1) - 64, 63, -64):
        yield _sets(sets, f"drafter.num_anchors={a}"), r(base, drafter=r(d, num_anchors=a))
    if base.data.batch_size > 1:
        one = r(base, data=r(base.data, batch_size=1, max_batch_tokens=None))
        yield _sets(sets, "data.batch_size=1"), one
    for m in range(
        base.data.max_length - base.data.max_length % 1024 - (1024 if base.data.max_length % 1024 == 0 else 0),
        1023,
        -1024,
    ):
        yield _sets(sets, f"data.max_length={m}"), r(base, data=r(base.data, max_length=m))
    for gib in (256, 128, 64, 32, 16, 8, 4):
        yield _sets(sets, f"queue.max_bytes={gib << 30}"), r(base, queue=r(base.queue, max_bytes=gib << 30))


def _sets(first: list[str], more: str) -> str:
    return " ".join(f"--set {x}" for x in (*first, more))


def nearest(plan: Plan, *, gpu_memory: t.Callable[[str], int | None], host_memory: int | None) -> str | None:
    """The first setting (``_candidates``' order) under which every device and the host fit; None: none does."""
    for sets, cfg in _candidates(plan.cfg):
        if make_plan(cfg, plan.shapes, gpu_memory=gpu_memory, host_memory=host_memory).fits:
            return sets
    return None


def refusal(plan: Plan, advice: str | None) -> str:
    """The one line a run that does not fit gets."""
    over = plan.first_over()
    assert over is not None
    what = "the host" if over.name == "host" else f"{over.name} ({'+'.join(over.roles)})"
    need = f"{format_bytes(over.total)} of {format_bytes(t.cast(int, over.capacity))}"
    top = max(over.figures, key=lambda f: f[1])
    fix = f"it fits with {advice}" if advice else "no setting of anchors, max_length, batch or queue makes it fit"
    return (
        f"dflash plan: {what} needs {need} ({top[0]} {format_bytes(top[1])}) at {plan.batch.rows} x "
        f"{plan.batch.seq} tokens and {plan.batch.anchors} anchors; {fix}"
    )


# --------------------------------------------------------------------------------------------
# Where it runs: the memory it plans against


def host_ram() -> int | None:
    """This machine's RAM (MemTotal), None when /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def local_gpu_memory(device: str) -> int | None:
    """``cuda:N``'s total memory on this machine; None without CUDA or past its devices."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = int(device.split(":")[1])
    if index >= torch.cuda.device_count():
        return None
    return int(torch.cuda.get_device_properties(index).total_memory)


def memory_of(gpu: int | None) -> t.Callable[[str], int | None]:
    """``--gpu-memory`` for every GPU when given, else this machine's devices."""
    return (lambda _dev: gpu) if gpu is not None else local_gpu_memory


def check_before_loading(cfg: RunConfig) -> None:
    """``dflash train``'s check at start: on CUDA devices whose memory this machine knows, a run that cannot
    fit is refused in one line (``DoesNotFit``); CPU runs and unknown GPUs are not judged."""
    devices = (*cfg.devices.targets, *cfg.devices.drafters)
    if not all(d.startswith("cuda") for d in devices) or any(local_gpu_memory(d) is None for d in devices):
        return
    plan = make_plan(cfg, read_shapes(cfg), gpu_memory=local_gpu_memory, host_memory=host_ram())
    if not plan.fits:
        raise DoesNotFit(refusal(plan, nearest(plan, gpu_memory=local_gpu_memory, host_memory=host_ram())))


# --------------------------------------------------------------------------------------------
# The table


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def render(plan: Plan, *, source: str) -> list[str]:
    """The plan as the command prints it: a header, a row per GPU, the host, the verdict."""
    s, b, cfg = plan.shapes, plan.batch, plan.cfg
    ac = cfg.activation_checkpointing
    lines = [
        f"target   {s.target_name} ({source}): {s.target_params / 1e9:.2f}B parameters in {cfg.target.dtype}, "
        f"{s.feature_layers} feature layers x {s.hidden}",
        f"drafter  {cfg.drafter.kind}, {s.drafter_layers} layers: {s.drafter_params / 1e9:.2f}B parameters in "
        f"{cfg.drafter.dtype}; {'Muon (matrices) + AdamW' if cfg.optim.name == 'muon' else 'AdamW'} on fp32 masters",
        f"batch    longest: {b.rows} x {b.seq} tokens, {b.anchors} anchors x {b.block} = {b.anchors * b.block} "
        f"block queries per row; activation checkpointing {'on' if ac else 'off'}",
        "",
        f"{'device':<8} {'role':<14} {'weights':>8} {'features':>8} {'drafter':>8} "
        f"{'activations':>17} {'total':>7} {'memory':>7} {'margin':>7}",
        f"{'':<8} {'':<14} {'GiB':>8} {'GiB':>8} {'state':>8} {'AC off / AC on':>17} {'GiB':>7} {'GiB':>7} {'GiB':>7}",
    ]
    state_keys = ("parameters", "fp32 masters", "optimizer", "gradients")
    for g in plan.gpus:
        act = g.get("activations")
        pair = (act, g.other) if not ac else (g.other, act)
        acts = f"{_gib(pair[0])} / {_gib(pair[1])}"
        if "drafter" not in g.roles:
            acts = f"{_gib(act)} (forward)"
        state = sum(g.get(k) for k in state_keys)
        cap = "-" if g.capacity is None else _gib(g.capacity)
        margin = "-" if g.capacity is None else _gib(g.capacity - g.total)
        lines.append(
            f"{g.name:<8} {'+'.join(g.roles):<14} {_gib(g.get('weights')):>8} {_gib(g.get('features')):>8} "
            f"{_gib(state) if state else '-':>8} {acts:>17} {_gib(g.total):>7} {cap:>7} {margin:>7}"
            + ("" if g.fits else "  OVER")
        )
    d = next((g for g in plan.gpus if "drafter" in g.roles), None)
    if d is not None:
        parts = ", ".join(f"{k} {_gib(d.get(k))}" for k in state_keys)
        lines.append(f"drafter state per replica (GiB): {parts}; every GPU keeps {_gib(GPU_RESERVE)} GiB in reserve")
    h = plan.host
    cap = "not checked (--host-memory)" if h.capacity is None else f"of {format_bytes(h.capacity)}"
    lines.append(
        "host     "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in h.figures)
        + f": {format_bytes(h.total)} {cap}"
        + ("" if h.fits else "  OVER")
    )
    unknown = [g.name for g in plan.gpus if g.capacity is None and g.name.startswith("cuda")]
    if unknown:
        lines.append(f"not checked: no memory known for {', '.join(unknown)} (--gpu-memory 96GiB)")
    return lines


def verdict(plan: Plan) -> str:
    checked = [g for g in plan.gpus if g.capacity is not None]
    if not checked and plan.host.capacity is None:
        return "fits: nothing to check against (give --gpu-memory and --host-memory)"
    least = min(checked, key=lambda g: t.cast(int, g.capacity) - g.total) if checked else None
    gpu = (
        f"every GPU with at least {format_bytes(t.cast(int, least.capacity) - least.total)} to spare ({least.name})"
        if least
        else ""
    )
    host = "" if plan.host.capacity is None else f"the host with {format_bytes(plan.host.capacity - plan.host.total)}"
    return "fits: " + ", ".join(x for x in (gpu, host) if x)


def run_plan(cfg: RunConfig, *, source: str, gpu: int | None, host: int | None, say: t.Callable[[str], None]) -> None:
    """``dflash plan``: print the table; ``DoesNotFit`` (exit 1, one line) when something is over."""
    shapes = read_shapes(cfg)
    gpu_memory = memory_of(gpu)
    if host is None and gpu is None and any(local_gpu_memory(d) for d in cfg.devices.drafters):
        host = host_ram()  # planning for this very machine: its RAM is the host's
    plan = make_plan(cfg, shapes, gpu_memory=gpu_memory, host_memory=host)
    for line in render(plan, source=source):
        say(line)
    if not plan.fits:
        raise DoesNotFit(refusal(plan, nearest(plan, gpu_memory=gpu_memory, host_memory=host)))
    say(verdict(plan))


__all__ = [
    "GPU_RESERVE",
    "UPDATE_SEQUENCES",
    "Batch",
    "Budget",
    "DoesNotFit",
    "Plan",
    "Shapes",
    "activation_bytes",
    "check_before_loading",
    "make_plan",
    "nearest",
    "parse_size",
    "read_shapes",
    "refusal",
    "render",
    "run_plan",
    "target_forward_bytes",
]
