"""The run config: one TOML file read once into frozen dataclasses, plus ``--set key=value`` overrides.

Every unknown key and every bad value is a ``ConfigError`` that names its full key path, e.g.
``drafter.block_size: expected an integer, got "x"``. ``--set`` values are typed by the dataclass field
they land on (``--set drafter.block_size=8``, ``--set devices.targets=cuda:0,cuda:1``,
``--set checkpoint.dir=none`` to clear an optional value).

Paths: a relative ``data.path``, ``data.tokenizer`` or ``target.path`` is looked up next to the config
file first (data that ships with its config), then in the working directory; ``output_dir`` and
``checkpoint.dir`` resolve against the working directory.
``DFLASH_RUN_DIR`` (set by dflashctl's runner) wins over ``output_dir``. With no ``checkpoint.dir``,
checkpoints go next to the run dirs (``$DFLASH_RUN_DIR/../checkpoints``) so that every attempt of a
supervised run resumes from the same place; without DFLASH_RUN_DIR, to ``<output_dir>/checkpoints``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import tomllib
import types
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.dtypes import NAMES
from dflash.errors import InputError

RUN_DIR_ENV = "DFLASH_RUN_DIR"

DTYPES = NAMES  # the canonical spelling only (dflash/dtypes.py)
DRAFTER_KINDS = ("dflash", "dflash2")
POSITION_WEIGHTS = ("decay", "dpace")
LAYER_TYPES = ("sliding_attention", "full_attention")  # config.json's layer_types (dflash.model.drafter's)
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


class ConfigError(InputError, ValueError):
    """The run config (file, ``--set`` or environment) is wrong; ``path`` names the key."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


# --------------------------------------------------------------------------------------------
# Sections


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyTargetConfig:
    """A random-init Qwen3 target built from a config (tests, demo): no download."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # larger: sharper random logits (a tiny target with more structure)
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TargetConfig:
    """The frozen target: a local HF checkpoint (``path``) OR a tiny config (``[target.tiny]``)."""

    path: str | None = None
    tiny: TinyTargetConfig | None = None
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    layers: int = 5
    block_size: int = 16
    gamma: float | None = None  # None: 7 for B=16, 5 for B=10, 4 for B=8 (the paper's table), else 7*B/16
    num_anchors: int = 512
    target_layer_ids: tuple[int, ...] | None = None  # None: build_target_layer_ids(L, layers)
    # None: the id published drafters use for the target's family (Qwen3: 151669, Qwen3.5: 248070), else the last row of
    # the target vocabulary; with init_from, the published drafter's own id
    mask_token_id: int | None = None
    init_from: str | None = None  # a drafter folder (config.json + model.safetensors, z-lab names) to start from
    dtype: str = "bfloat16"
    loss_chunk: int = 128  # blocks per lm_head + cross-entropy chunk
    # "dflash" (z-lab's drafter) or "dflash2" (a grouped dynamic convolution around each sublayer over the
    # block, and a low-rank selector that reranks the top-k tokens of each slot by the token before it)
    kind: str = "dflash"
    conv_kernel_size: int = 2  # dflash2: taps of each convolution (the slot and the ones before it in the block)
    conv_group_size: int = 16  # dflash2: hidden channels sharing one dynamic tap weight (divides hidden_size)
    selector_rank: int = 256  # dflash2: rank of the selector's token codebooks
    selector_top_k: int = 16  # dflash2: candidates per slot the selector reranks
    # None: the target's vocabulary (the target's lm_head scores). N: an own lm_head over the N most frequent
    # supervised tokens of the training data (dflash.model.draft_vocab), mapped back by d2t
    draft_vocab_size: int | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included; None: no sliding layer
    layer_types: tuple[str, ...] | None = None  # one of LAYER_TYPES per layer; None: all sliding with a window

    @property
    def loss_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, 7.0 * self.block_size / 16)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossConfig:
    """How block slots are weighted (``dflash.model.loss``), and the DFlash2 selector's share of the loss."""

    # "decay": exp(-(k-1)/gamma) per slot (the paper's); "dpace": per block, from the drafter's own
    # confidence in each slot (what each slot adds to the expected accepted length; D-PACE)
    position_weight: str = "decay"
    dpace_alpha: float = 0.5  # dpace: confidences are smoothed to (1 - alpha) * p + alpha, in [0, 1]
    selector_weight: float = 1.0  # dflash2: the selector's cross-entropy over its top-k, beside the block loss


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    path: str
    format: str = "auto"  # "tokens" ({"input_ids", "loss_mask"}), "chat" ({"messages"}), or "auto" per line
    tokenizer: str | None = None  # needed for chat records; default: target.path
    # passed to the chat template as serving passes them, e.g. {enable_thinking = false} for Qwen3
    chat_template_kwargs: dict[str, t.Any] = dataclasses.field(default_factory=dict)
    max_length: int = 3072  # longer samples are cut
    batch_size: int = 1  # sequences per batch at most
    max_batch_tokens: int | None = None  # padded tokens per batch at most (None: batch_size * max_length)
    bucket_window: int = 64  # batches' worth of samples sorted by length together (bucketing)
    shuffle: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DevicesConfig:
    targets: tuple[str, ...] = ("cpu",)
    drafters: tuple[str, ...] = ("cpu",)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueueConfig:
    capacity: int = 64  # batches of features in flight at most; per-drafter mode splits it over the queues
    # ... and bytes of features in flight at most (pinned host memory, or the drafter GPU's memory).
    # None: derived from the run, room for what every drafter accumulates plus one batch per worker
    # (``feature_queue.default_max_bytes``, at least 4 GiB). A batch larger than it still passes alone.
    # Per-drafter mode splits it like the capacity.
    max_bytes: int | None = None
    mode: str = "shared"  # "shared" (one queue) or "per-drafter" (round-robin, for comparison only)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW (or Muon on the hidden matrices, AdamW on the rest) on fp32 master weights; linear warmup then
    cosine (or linear, constant) decay."""

    name: str = "adamw"  # "adamw" | "muon" (dflash.train.optimizer)
    lr: float = 6e-4
    # Muon's peak lr, on the same schedule; None: ``lr`` (its update is scaled to AdamW's RMS, so lr carries over)
    muon_lr: float | None = None
    warmup_ratio: float = 0.04
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping
    oom_retry: bool = True  # a drafter step that runs out of memory is retried once as two half-batches
    # Sequences per optimizer update of ONE drafter replica (gradient accumulation over
    # ceil(sequences_per_update / data.batch_size) batches, one weight sum over all of them).
    # None: ceil(32 / drafters), so drafters x sequences ~ 32 (the Qwen3-8B recipe: 4 per GPU x 8 GPUs).
    sequences_per_update: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    interval: int = 1000  # global steps; 0: only at the end and on SIGTERM
    dir: str | None = None
    keep: int = 3
    # "auto" (the newest run's latest intact checkpoint, if any), "never" (a new run; checkpoints already
    # in the dir are moved into old-<run id>-<time>/), or a checkpoint path
    resume: str = "auto"
    optimizer: bool = True  # save one replica's optimizer state + fp32 masters (resume gives them to every replica)
    # `dflashctl status` says `low disk` under this many GB free where checkpoints go; None: one checkpoint's size
    disk_warn_gb: float | None = None
    # a command run in the background after each checkpoint and each switch of `best` (dflash.checkpoint.sync):
    # "rclone copy {dir} remote:bucket/run"; {dir} is the checkpoints folder, {step} the step; no shell
    sync: str | None = None
    sync_timeout: float = 3600.0  # seconds a sync may run before it is killed (its process group)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    """A Weights & Biases run per attempt, grouped by the run id (the ``wandb`` extra)."""

    project: str
    mode: str = "online"  # "online" (to the W&B server) or "offline" (files in the attempt dir, `wandb sync` later)
    entity: str | None = None  # the team or user; None: the logged-in user's default


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """Where progress goes besides the step line and metrics.jsonl."""

    tensorboard: bool = False  # TensorBoard event files in the attempt dir (the `tensorboard` extra)
    wandb: WandbConfig | None = None  # the same scalars to W&B: {project = "...", mode = "offline" | "online"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out tau of the averaged drafter during training (``dflash.train.validation``); every eval is a checkpoint,
    and ``checkpoints/best`` points to the one with the highest tau."""

    every: int = 0  # global steps between evals; 0: no eval during training
    # a prompt file (as `dflash eval --prompts` reads it: token or chat records), or a suite as `--suite`
    # names one (NAME, or NAME=PATH for a local copy); None: eval.jsonl next to data.path (make-tiny writes it)
    prompts: str | None = None
    max_new: int = 64  # new tokens per prompt at most (decoding stops at EOS), as `dflash eval --max-new`
    limit: int | None = None  # the first N prompts only (a suite: the first N of z-lab's selection)
    device: str | None = None  # where the eval's own target and drafter copies run; None: devices.targets[0]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistributedConfig:
    """A run over several nodes (torchrun, one ``dflash train`` per node; see dflash.train.distributed)."""

    # seconds any collective (a barrier's averaging or checkpoint) waits for the other nodes before the
    # run exits: a dead or hung node ends the others after at most this long
    timeout: float = 600.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """What the trainer does with a diverging run (``dflash.train.divergence``)."""

    # "stop": the first update with a non-finite loss or gradient norm ends the run (exit 3, no checkpoint);
    # "skip": that update is skipped (counted in metrics.jsonl) and the run stops after nonfinite_limit in a row
    on_nonfinite: str = "stop"
    nonfinite_limit: int = 10
    # a loss above spike_factor x the median of the last spike_window steps' for spike_steps steps in a row is
    # a warning and a metrics record, never a stop (0: not watched)
    spike_factor: float = 3.0
    spike_steps: int = 20
    spike_window: int = 200


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    target: TargetConfig
    drafter: DrafterConfig = dataclasses.field(default_factory=DrafterConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    data: DataConfig
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    queue: QueueConfig = dataclasses.field(default_factory=QueueConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    # global steps: optimizer updates by all drafters together (each update is optim.sequences_per_update
    # sequences of one drafter). None: derived from `epochs` and the corpus size.
    max_steps: int | None = None
    epochs: float = 6.0  # passes over the corpus when max_steps is not set
    log_every: int = 10
    average_every: int = 50  # global steps between replica averagings
    barrier_timeout: float = 600.0  # seconds drafters wait for each other at an averaging/checkpoint barrier
    compile: bool = False
    compile_backend: str = "inductor"
    activation_checkpointing: bool = False
    seed: int = 0
    output_dir: str = "runs/dflash"

    def run_dir(self, environ: t.Mapping[str, str] | None = None) -> Path:
        """Where metrics.jsonl goes: ``$DFLASH_RUN_DIR`` when set, else ``output_dir``."""
        env = os.environ if environ is None else environ
        return Path(env.get(RUN_DIR_ENV) or self.output_dir).expanduser()

    def checkpoint_dir(self, environ: t.Mapping[str, str] | None = None) -> Path:
        """Durable across attempts: see the module docstring."""
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir).expanduser()
        env = os.environ if environ is None else environ
        if env.get(RUN_DIR_ENV):
            return Path(env[RUN_DIR_ENV]).expanduser().resolve().parent / "checkpoints"
        return Path(self.output_dir).expanduser() / "checkpoints"


# --------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike[str], overrides: t.Sequence[str] = ()) -> RunConfig:
    """Read ``path`` and apply ``key=value`` overrides; the one entry point for ``dflash train``."""
    p = Path(path).expanduser()
    try:  # a regular file (inputs.read_bytes): a FIFO would block here forever
        text = inputs.without_bom(inputs.read_bytes(p, "--config")).decode("utf-8")
    except inputs.InputFileError as e:
        raise ConfigError("--config", str(e).removeprefix("--config: ")) from None
    except UnicodeDecodeError as e:
        raise ConfigError("--config", f"{p} is not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(p), f"not valid TOML: {e}") from e
    except RecursionError:  # tomllib recurses once per nesting level
        raise ConfigError(str(p), "not valid TOML: tables or arrays nested too deeply") from None
    for item in overrides:
        apply_override(raw, item)
    return parse_config(raw, base=p.resolve().parent)


def parse_config(raw: t.Mapping[str, t.Any], *, base: Path | None = None) -> RunConfig:
    """Validate a TOML-shaped dict into a ``RunConfig``; ``base`` resolves data paths."""
    cfg = _build(RunConfig, raw, "")
    _check(cfg)
    if base is not None:
        data = cfg.data
        kw: dict[str, t.Any] = {"path": _resolve(base, data.path)}
        if data.tokenizer is not None:
            kw["tokenizer"] = _resolve(base, data.tokenizer)
        tkw: dict[str, t.Any] = {}
        if cfg.target.path is not None:
            tkw["path"] = _resolve(base, cfg.target.path)
        ekw: dict[str, t.Any] = {}
        if cfg.eval.prompts is not None and not is_suite(cfg.eval.prompts):
            ekw["prompts"] = _resolve(base, cfg.eval.prompts)
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(data, **kw),
            target=dataclasses.replace(cfg.target, **tkw),
            eval=dataclasses.replace(cfg.eval, **ekw),
        )
    return cfg


# The published tables' suites by name (dflash/eval/suites.py defines them; a test holds the two equal): the
# config reads names only, and importing the suites' module would put the eval stage under the config.
SUITES = (
    "gsm8k",
    "math500",
    "aime24",
    "aime25",
    "humaneval",
    "mbpp",
    "livecodebench",
    "swe-bench",
    "mt-bench",
    "alpaca",
    "lbpp",
)


def is_suite(prompts: str) -> bool:
    """``eval.prompts`` names a suite (``gsm8k``, or ``gsm8k=PATH`` for a local copy), not a prompt file."""
    name, _, _ = prompts.partition("=")
    return name.strip() in SUITES


# [checkpoint] sync's template, read here (a config value's language); dflash/checkpoint/checkpoints/sync.py runs it.
SYNC_FIELD = re.compile(r"\{(\w*)\}")
SYNC_FIELDS = ("dir", "step")


class SyncError(InputError, ValueError):
    """A sync template that cannot be run (the message is one line; the caller names the key)."""


def parse_template(text: str) -> tuple[str, ...]:
    """The template's words; SyncError when it cannot be split, is empty, names no ``{dir}`` or an unknown field."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise SyncError(f"cannot split {text!r} like a shell would: {e}") from None
    if not words:
        raise SyncError("empty command")
    for word in words:
        for name in SYNC_FIELD.findall(word):
            if name not in SYNC_FIELDS:
                raise SyncError(f"unknown field {{{name}}} in {word!r} (known: {{dir}}, {{step}})")
    if not any("{dir}" in w for w in words):
        raise SyncError('names no {dir} (the checkpoints folder to copy), e.g. "rclone copy {dir} remote:bucket/run"')
    return tuple(words)


def _resolve(base: Path, value: str) -> str:
    """A relative path is looked up next to the config file first, then in the working directory."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    beside = base / p
    if beside.exists() or not p.exists():
        return str(beside) if beside.exists() else value
    return str(p.resolve())


def apply_override(raw: dict[str, t.Any], item: str) -> None:
    """Apply one ``dotted.key=value`` to the raw dict, typed by the field it names."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("--set", f'expected key=value, got "{item}"')
    parts = key.split(".")
    hint = _field_type(parts)
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a table")
        node = child
    parsed = _parse_cli_value(value.strip(), hint)
    if parsed is _NONE:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = parsed


_NONE = object()
_INT64 = 1 << 63
SEED_MAX = (1 << 32) - 1
WEEK = 7 * 24 * 3600.0  # seconds: the longest a timeout may be (threading's waits refuse past ~292 years)
EVAL_MAX_NEW = 2048  # dflash.eval.evaluate.MAX_NEW_TOKENS (not imported: that module pulls in torch)


def _field_type(parts: list[str]) -> t.Any:
    """The type annotation of the field a dotted key names (errors name unknown keys)."""
    cls: t.Any = RunConfig
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ConfigError(path, "unknown key")
        hints = t.get_type_hints(cls)
        if part not in hints:
            raise ConfigError(path, "unknown key")
        cls = _unwrap_optional(hints[part])
    return cls


def _unwrap_optional(tp: t.Any) -> t.Any:
    if t.get_origin(tp) in (t.Union, types.UnionType):
        args = [a for a in t.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _parse_cli_value(value: str, tp: t.Any) -> t.Any:
    if value.lower() in ("none", "null"):
        return _NONE
    if tp is str:
        return value
    if t.get_origin(tp) is tuple:
        if value.startswith("["):
            return _toml_value(value)
        return [_toml_value(v.strip()) for v in value.split(",") if v.strip()]
    return _toml_value(value)


def _toml_value(value: str) -> t.Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return value  # a bare word (or nesting too deep to parse): the field's type check reports it by name


# --------------------------------------------------------------------------------------------
# Typed building (dataclass fields drive the checks)


def _build(cls: type, raw: t.Any, prefix: str) -> t.Any:
    where = prefix or "config"
    if not isinstance(raw, t.Mapping):
        raise ConfigError(where, f"expected a table, got {_show(raw)}")
    hints = t.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(_join(prefix, key), "unknown key")
    kw: dict[str, t.Any] = {}
    for f in dataclasses.fields(cls):
        path = _join(prefix, f.name)
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(path, "required")
            continue
        kw[f.name] = _value(hints[f.name], raw[f.name], path)
    return cls(**kw)


def _value(tp: t.Any, v: t.Any, path: str) -> t.Any:
    inner = _unwrap_optional(tp)
    if inner is not tp and v is None:
        return None
    tp = inner
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, v, path)
    if tp is bool:
        if not isinstance(v, bool):
            raise ConfigError(path, f"expected true or false, got {_show(v)}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(path, f"expected an integer, got {_show(v)}")
        if not -_INT64 <= v < _INT64:  # torch (seeds, sizes) overflows past 64 bits
            raise ConfigError(path, f"{v} is out of range for a 64-bit integer")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(path, f"expected a number, got {_show(v)}")
        try:
            number = float(v)  # an integer too large for a float raises
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):  # TOML has nan and inf; no setting means either
            raise ConfigError(path, f"expected a finite number, got {v if isinstance(v, float) else 'a huge integer'}")
        return number
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(path, f"expected a string, got {_show(v)}")
        return v
    if t.get_origin(tp) is dict:  # a TOML table of plain values (chat template kwargs)
        if not isinstance(v, t.Mapping):
            raise ConfigError(path, f"expected a table, got {_show(v)}")
        for k, x in v.items():
            if isinstance(x, (dict, list)) or x is None:
                raise ConfigError(f"{path}.{k}", f"expected a string, number or true/false, got {_show(x)}")
        return dict(v)
    if t.get_origin(tp) is tuple:
        args = t.get_args(tp)
        if not isinstance(v, (list, tuple)):  # a tuple: a config saved by to_dict (a checkpoint's)
            raise ConfigError(path, f"expected a list, got {_show(v)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], x, f"{path}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise ConfigError(path, f"expected a list of {len(args)} values, got {len(v)}")
        return tuple(_value(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    raise AssertionError(f"unsupported config type {tp!r} at {path}")  # programmer error


def _positive(path: str, v: float, *, zero: bool = False) -> None:
    if v < 0 or (v == 0 and not zero):
        raise ConfigError(path, f"must be {'>= 0' if zero else '> 0'}, got {v:g}")


def _choice(path: str, v: str, allowed: t.Sequence[str]) -> None:
    if v not in allowed:
        raise ConfigError(path, f"expected one of {', '.join(map(repr, allowed))}, got {_show(v)}")


# Upper bounds of the numeric keys (when a config is read, one line naming the key): far above any real run,
# below what fails later as a traceback (a 2 TB allocation, a timeout Python's waits refuse, a torch overflow).
MAX_VOCAB = 1 << 24  # dflash.model.model_config.MAX_VOCAB (not imported: the model stage is below the config)
MAX_LAYERS = 4096  # model_config.MAX_LAYERS
BOUNDS: dict[str, float] = {
    "target.tiny.vocab_size": 1 << 20,
    "target.tiny.hidden_size": 1 << 14,
    "target.tiny.intermediate_size": 1 << 16,
    "target.tiny.num_layers": 256,
    "target.tiny.num_heads": 256,
    "target.tiny.num_kv_heads": 256,
    "target.tiny.head_dim": 1024,
    "target.tiny.max_position_embeddings": 1 << 20,
    "target.tiny.initializer_range": 10.0,
    "drafter.layers": 256,
    "drafter.block_size": 1024,
    "drafter.num_anchors": 1 << 16,
    "drafter.loss_chunk": 1 << 16,
    "drafter.sliding_window": 1 << 20,
    "drafter.conv_kernel_size": 1024,
    "drafter.conv_group_size": 1 << 18,
    "drafter.selector_rank": 4096,  # a (vocabulary x rank) codebook: 151,936 x 4096 fp32 is 2.5 GB already
    "drafter.selector_top_k": 1024,
    "drafter.mask_token_id": MAX_VOCAB - 1,
    "data.max_length": 1 << 20,
    "data.batch_size": 1 << 16,
    "data.max_batch_tokens": 1 << 26,
    "data.bucket_window": 1 << 20,
    "queue.capacity": 1 << 16,
    "queue.max_bytes": 1 << 50,
    "optim.eps": 1.0,
    "optim.sequences_per_update": 1 << 20,
    "checkpoint.disk_warn_gb": 1e9,
    "checkpoint.sync_timeout": WEEK,
    "eval.limit": 1 << 24,
    "epochs": 1e6,
    "barrier_timeout": WEEK,
    "distributed.timeout": WEEK,
    "train.spike_window": 1 << 20,
}


def _bounded(path: str, v: float | None) -> None:
    """``v`` at most ``BOUNDS[path]``; ConfigError naming the key (None: an unset optional value)."""
    hi = BOUNDS[path]
    if v is not None and v > hi:
        shown = f"{v:g}" if isinstance(v, float) else str(v)
        unit = " seconds (a week)" if hi == WEEK else ""
        raise ConfigError(path, f"must be <= {hi:g}{unit}, got {shown}")


def _check_bounds(cfg: RunConfig) -> None:
    """Every key of ``BOUNDS`` (after the sections' own checks: a bound is the last word on a value)."""
    for path in BOUNDS:
        node: t.Any = cfg
        for part in path.split("."):
            node = getattr(node, part) if node is not None else None
        _bounded(path, node)
    ids = cfg.drafter.target_layer_ids or ()
    if ids and max(ids) >= MAX_LAYERS:
        raise ConfigError("drafter.target_layer_ids", f"layer {max(ids)} is beyond {MAX_LAYERS - 1}")


def _check(cfg: RunConfig) -> None:
    """Range and cross-field checks, each naming its key: one check per section, in the order a file reads."""
    _check_target(cfg.target)
    _check_drafter(cfg.drafter, cfg.target.tiny)
    _check_sliding(cfg.drafter)
    _check_loss(cfg.loss)
    _check_drafter_layers(cfg.drafter, cfg.target.tiny)
    _check_data(cfg.data)
    _check_devices(cfg.devices)
    _check_queue(cfg.queue, drafters=len(cfg.devices.drafters))
    _check_optim(cfg.optim)
    _check_checkpoint(cfg.checkpoint)
    _check_metrics(cfg.metrics)
    _check_eval(cfg.eval)
    _check_top(cfg)
    _check_train(cfg.train)
    _choice("compile_backend", cfg.compile_backend, ("inductor", "aot_eager", "eager"))
    if not cfg.output_dir.strip():
        raise ConfigError("output_dir", "must not be empty")
    _check_bounds(cfg)


def _check_target(tg: TargetConfig) -> None:
    if (tg.path is None) == (tg.tiny is None):
        raise ConfigError("target", "give exactly one of target.path (a local checkpoint) or [target.tiny]")
    if tg.path is not None and not tg.path.strip():
        raise ConfigError("target.path", "must not be empty")
    _choice("target.dtype", tg.dtype, DTYPES)
    if tg.tiny is None:
        return
    tiny = tg.tiny
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        _positive(f"target.tiny.{name}", getattr(tiny, name))
    _positive("target.tiny.initializer_range", tiny.initializer_range)
    if tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError("target.tiny.num_kv_heads", f"must divide num_heads ({tiny.num_heads})")
    if tiny.num_layers < 4:
        raise ConfigError(
            "target.tiny.num_layers", f"must be >= 4 (features come from layers 1..L-3), got {tiny.num_layers}"
        )


def _check_drafter(d: DrafterConfig, tiny: TinyTargetConfig | None) -> None:
    """The drafter's sizes and kind (its dtype and target layers: ``_check_drafter_layers``)."""
    _positive("drafter.layers", d.layers)
    if d.block_size < 2:
        raise ConfigError("drafter.block_size", f"must be >= 2, got {d.block_size}")
    if d.gamma is not None:
        _positive("drafter.gamma", d.gamma)
    _positive("drafter.num_anchors", d.num_anchors)
    _positive("drafter.loss_chunk", d.loss_chunk)
    _choice("drafter.kind", d.kind, DRAFTER_KINDS)
    if d.draft_vocab_size is not None:
        _positive("drafter.draft_vocab_size", d.draft_vocab_size)
        if d.kind == "dflash2":
            raise ConfigError("drafter.draft_vocab_size", "a dflash2 drafter reranks the target's vocabulary")
        if tiny is not None and d.draft_vocab_size >= tiny.vocab_size:
            raise ConfigError("drafter.draft_vocab_size", f"must be below the vocabulary ({tiny.vocab_size})")
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        _positive(f"drafter.{name}", getattr(d, name))
    if d.kind == "dflash2" and d.conv_kernel_size > d.block_size:
        raise ConfigError(
            "drafter.conv_kernel_size", f"must be <= drafter.block_size ({d.block_size}), got {d.conv_kernel_size}"
        )
    if d.kind == "dflash2" and tiny is not None:
        if tiny.hidden_size % d.conv_group_size:
            raise ConfigError(
                "drafter.conv_group_size",
                f"must divide the hidden size ({tiny.hidden_size}), got {d.conv_group_size}",
            )
        if d.selector_top_k > tiny.vocab_size:
            raise ConfigError(
                "drafter.selector_top_k", f"must be <= the vocabulary ({tiny.vocab_size}), got {d.selector_top_k}"
            )


def _check_sliding(d: DrafterConfig) -> None:
    """The sliding keys: a window, and per layer an attention kind, sliding ones only with a window."""
    if d.sliding_window is not None:
        _positive("drafter.sliding_window", d.sliding_window)
    if d.layer_types is None:
        return
    if len(d.layer_types) != d.layers:
        raise ConfigError(
            "drafter.layer_types", f"expected {d.layers} entries (drafter.layers), got {len(d.layer_types)}"
        )
    for i, kind in enumerate(d.layer_types):
        _choice(f"drafter.layer_types[{i}]", kind, LAYER_TYPES)
    if (LAYER_TYPES[0] in d.layer_types) != (d.sliding_window is not None):
        raise ConfigError(
            "drafter.sliding_window",
            "needed by the sliding_attention layers of drafter.layer_types"
            if d.sliding_window is None
            else "no layer of drafter.layer_types is sliding_attention: leave it out",
        )


def _check_loss(lo: LossConfig) -> None:
    _choice("loss.position_weight", lo.position_weight, POSITION_WEIGHTS)
    if not 0 <= lo.dpace_alpha <= 1:
        raise ConfigError("loss.dpace_alpha", f"must be in [0, 1], got {lo.dpace_alpha:g}")
    _positive("loss.selector_weight", lo.selector_weight, zero=True)


def _check_drafter_layers(d: DrafterConfig, tiny: TinyTargetConfig | None) -> None:
    """The drafter's dtype, the target layers it reads and its MASK id, against a tiny target's sizes."""
    _choice("drafter.dtype", d.dtype, DTYPES)
    if d.target_layer_ids is not None:
        if not d.target_layer_ids:
            raise ConfigError("drafter.target_layer_ids", "must not be empty (leave it out for the default)")
        for i, lid in enumerate(d.target_layer_ids):
            _positive(f"drafter.target_layer_ids[{i}]", lid, zero=True)
        if tiny is not None and max(d.target_layer_ids) >= tiny.num_layers:
            raise ConfigError(
                "drafter.target_layer_ids",
                f"layer {max(d.target_layer_ids)} is beyond the target's {tiny.num_layers} layers",
            )
    if d.mask_token_id is not None:
        _positive("drafter.mask_token_id", d.mask_token_id, zero=True)
        if tiny is not None and d.mask_token_id >= tiny.vocab_size:
            raise ConfigError(
                "drafter.mask_token_id", f"{d.mask_token_id} is outside the target vocabulary ({tiny.vocab_size})"
            )


def _check_data(da: DataConfig) -> None:
    if not da.path.strip():
        raise ConfigError("data.path", "must not be empty")
    _choice("data.format", da.format, ("auto", "tokens", "chat"))
    if da.max_length < 2:
        raise ConfigError("data.max_length", f"must be >= 2, got {da.max_length}")
    _positive("data.batch_size", da.batch_size)
    _positive("data.bucket_window", da.bucket_window)
    if da.max_batch_tokens is not None and da.max_batch_tokens < da.max_length:
        raise ConfigError(
            "data.max_batch_tokens",
            f"must be >= data.max_length ({da.max_length}) so every sample fits, got {da.max_batch_tokens}",
        )


def _check_devices(dv: DevicesConfig) -> None:
    for role in ("targets", "drafters"):
        devices = getattr(dv, role)
        if not devices:
            raise ConfigError(f"devices.{role}", "needs at least one device")
        seen: set[str] = set()
        for i, dev in enumerate(devices):
            if not _DEVICE.match(dev):
                raise ConfigError(f"devices.{role}[{i}]", f'expected "cpu" or "cuda:<index>", got {_show(dev)}')
            if dev != "cpu" and dev in seen:
                raise ConfigError(f"devices.{role}[{i}]", f"{dev} is listed twice (only cpu may repeat)")
            seen.add(dev)


def _check_queue(q: QueueConfig, *, drafters: int) -> None:
    _positive("queue.capacity", q.capacity)
    if q.max_bytes is not None:
        _positive("queue.max_bytes", q.max_bytes)
    _choice("queue.mode", q.mode, ("shared", "per-drafter"))
    if q.mode == "per-drafter" and q.capacity < drafters:
        raise ConfigError("queue.capacity", f"per-drafter mode needs at least one slot per drafter ({drafters})")


def _check_optim(o: OptimConfig) -> None:
    _choice("optim.name", o.name, ("adamw", "muon"))
    _positive("optim.lr", o.lr)
    if o.muon_lr is not None:
        _positive("optim.muon_lr", o.muon_lr)
    if not 0 <= o.warmup_ratio < 1:
        raise ConfigError("optim.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio:g}")
    _choice("optim.schedule", o.schedule, ("cosine", "linear", "constant"))
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio:g}")
    _positive("optim.weight_decay", o.weight_decay, zero=True)
    for i, b in enumerate(o.betas):
        if not 0 <= b < 1:
            raise ConfigError(f"optim.betas[{i}]", f"must be in [0, 1), got {b:g}")
    _positive("optim.eps", o.eps)
    _positive("optim.grad_clip", o.grad_clip, zero=True)


def _check_checkpoint(c: CheckpointConfig) -> None:
    _positive("checkpoint.interval", c.interval, zero=True)
    _positive("checkpoint.keep", c.keep)
    if c.dir is not None and not c.dir.strip():
        raise ConfigError("checkpoint.dir", "must not be empty (leave it out for the default)")
    if not c.resume.strip():
        raise ConfigError("checkpoint.resume", 'expected "auto", "never" or a checkpoint path')
    if c.disk_warn_gb is not None:
        _positive("checkpoint.disk_warn_gb", c.disk_warn_gb, zero=True)
    _positive("checkpoint.sync_timeout", c.sync_timeout)
    if c.sync is not None:
        try:
            parse_template(c.sync)
        except SyncError as e:
            raise ConfigError("checkpoint.sync", str(e)) from None


def _check_metrics(mt: MetricsConfig) -> None:
    if mt.wandb is None:
        return
    if not mt.wandb.project.strip():
        raise ConfigError("metrics.wandb.project", "must not be empty")
    _choice("metrics.wandb.mode", mt.wandb.mode, ("online", "offline"))
    if mt.wandb.entity is not None and not mt.wandb.entity.strip():
        raise ConfigError("metrics.wandb.entity", "must not be empty (leave it out for the default)")


def _check_eval(ev: EvalConfig) -> None:
    _positive("eval.every", ev.every, zero=True)
    if not 1 <= ev.max_new <= EVAL_MAX_NEW:
        raise ConfigError("eval.max_new", f"expected 1 to {EVAL_MAX_NEW} new tokens, got {ev.max_new}")
    if ev.limit is not None:
        _positive("eval.limit", ev.limit)
    if ev.prompts is not None and not ev.prompts.strip():
        raise ConfigError("eval.prompts", "must not be empty (leave it out for eval.jsonl next to data.path)")
    if ev.prompts is not None and "=" in ev.prompts and not is_suite(ev.prompts):
        name = ev.prompts.partition("=")[0].strip()
        if not Path(ev.prompts).exists():  # NAME=PATH with an unknown NAME, not a file with "=" in its name
            raise ConfigError("eval.prompts", f"unknown suite {name!r} (known: {', '.join(SUITES)})")
    if ev.device is not None and not _DEVICE.match(ev.device):
        raise ConfigError("eval.device", f'expected "cpu" or "cuda:<index>", got {_show(ev.device)}')


def _check_top(cfg: RunConfig) -> None:
    """The top-level keys (seeds, steps, intervals, timeouts) and the two that count like them."""
    if not 0 <= cfg.seed <= SEED_MAX:  # replica generators are seeded with seed * 1000 + index
        raise ConfigError("seed", f"must be in [0, {SEED_MAX}], got {cfg.seed}")
    tiny = cfg.target.tiny
    if tiny is not None and not 0 <= tiny.seed <= SEED_MAX:
        raise ConfigError("target.tiny.seed", f"must be in [0, {SEED_MAX}], got {tiny.seed}")
    if cfg.max_steps is not None:
        _positive("max_steps", cfg.max_steps)
    if not cfg.epochs > 0:
        raise ConfigError("epochs", f"must be > 0, got {cfg.epochs:g}")
    if cfg.optim.sequences_per_update is not None:
        _positive("optim.sequences_per_update", cfg.optim.sequences_per_update)
    _positive("log_every", cfg.log_every)
    _positive("average_every", cfg.average_every)
    _positive("barrier_timeout", cfg.barrier_timeout)
    _positive("distributed.timeout", cfg.distributed.timeout)


def _check_train(tr: TrainConfig) -> None:
    _choice("train.on_nonfinite", tr.on_nonfinite, ("stop", "skip"))
    _positive("train.nonfinite_limit", tr.nonfinite_limit)
    if tr.spike_factor and not (math.isfinite(tr.spike_factor) and tr.spike_factor > 1):
        raise ConfigError("train.spike_factor", f"must be > 1 (0: no spike watch), got {tr.spike_factor:g}")
    _positive("train.spike_steps", tr.spike_steps)
    _positive("train.spike_window", tr.spike_window)


def check_devices(cfg: RunConfig) -> None:
    """The devices the config names exist on this machine (at start-up, not when a config is parsed)."""
    import torch  # parsing a config needs no torch (dflashctl, --help): only this start-up check does

    named = [
        (f"devices.{role}[{i}]", dev)
        for role in ("targets", "drafters")
        for i, dev in enumerate(getattr(cfg.devices, role))
    ]
    if cfg.eval.every and cfg.eval.device is not None:
        named.append(("eval.device", cfg.eval.device))
    for key, dev in named:
        if dev == "cpu":
            continue
        if not torch.cuda.is_available():
            raise ConfigError(key, f"{dev} asked for, but this machine (or this torch build) has no CUDA device")
        index = int(dev.split(":")[1])
        if index >= torch.cuda.device_count():
            raise ConfigError(key, f"{dev} asked for, but there are only {torch.cuda.device_count()} CUDA device(s)")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _show(v: t.Any) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list):
        return "a list"
    return repr(v)


def to_dict(cfg: RunConfig) -> dict[str, t.Any]:
    """The config as plain data (saved with checkpoints and printed at start)."""
    return dataclasses.asdict(cfg)


__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DevicesConfig",
    "DistributedConfig",
    "DrafterConfig",
    "EvalConfig",
    "LossConfig",
    "MetricsConfig",
    "OptimConfig",
    "QueueConfig",
    "RUN_DIR_ENV",
    "RunConfig",
    "TargetConfig",
    "TinyTargetConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_override",
    "check_devices",
    "is_suite",
    "load_config",
    "parse_config",
    "to_dict",
]
