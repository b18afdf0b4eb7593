"""The run config: TOML -> frozen dataclasses, --set overrides, errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dflash.config import ConfigError, RunConfig, apply_override, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
[target]
path = "/models/qwen"
[data]
path = "train.jsonl"
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_tiny_cpu_config_loads_with_the_documented_shape() -> None:
    cfg = load_config(REPO / "configs" / "tiny-random.toml")
    assert isinstance(cfg, RunConfig)
    assert cfg.devices.targets == ("cpu", "cpu") and cfg.devices.drafters == ("cpu", "cpu")
    assert cfg.target.tiny is not None and cfg.target.path is None
    assert cfg.queue.mode == "shared"
    assert Path(cfg.data.path).is_file(), "data.path resolves next to the config file"
    assert cfg.drafter.loss_gamma == 4.0  # B=8 -> 4, the paper's table


def test_defaults_are_the_reference_recipe(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    o = cfg.optim
    assert (o.lr, o.warmup_ratio, o.schedule, o.grad_clip) == (6e-4, 0.04, "cosine", 1.0)
    assert cfg.drafter.block_size == 16 and cfg.drafter.loss_gamma == 7.0
    assert cfg.checkpoint.resume == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.block_size=x", 'drafter.block_size: expected an integer, got "x"'),
        ("drafter.blok_size=8", "drafter.blok_size: unknown key"),
        ("drafter.block_size=1", "drafter.block_size: must be >= 2, got 1"),
        ("queue.mode=round-robin", "queue.mode: expected one of 'shared', 'per-drafter', got \"round-robin\""),
        ("devices.targets=cuda:0,gpu1", 'devices.targets[1]: expected "cpu" or "cuda:<index>", got "gpu1"'),
        ("devices.drafters=cuda:1,cuda:1", "devices.drafters[1]: cuda:1 is listed twice (only cpu may repeat)"),
        ("optim.lr=-1", "optim.lr: must be > 0, got -1"),
        ("optim.name=sgd", "optim.name: expected one of 'adamw', 'muon', got \"sgd\""),
        ("compile=yes", 'compile: expected true or false, got "yes"'),
        ("target.dtype=fp8", "target.dtype: expected one of 'float32', 'bfloat16', 'float16', got \"fp8\""),
        ("nope=1", "nope: unknown key"),
        ("drafter=3", "drafter: expected a table, got 3"),
        ("optim.betas=[0.9]", "optim.betas: expected a list of 2 values, got 1"),
        ("drafter", '--set: expected key=value, got "drafter"'),
        ("drafter.sliding_window=0", "drafter.sliding_window: must be > 0, got 0"),
        ("drafter.sliding_window=2000000", "drafter.sliding_window: must be <= 1.04858e+06, got 2000000"),
        ("drafter.layer_types=full_attention", "drafter.layer_types: expected 5 entries (drafter.layers), got 1"),
        (
            "drafter.layer_types=full_attention,sliding,full_attention,full_attention,full_attention",
            "drafter.layer_types[1]: expected one of 'sliding_attention', 'full_attention', got \"sliding\"",
        ),
        (
            "drafter.layer_types=" + ",".join(["sliding_attention"] + ["full_attention"] * 4),
            "drafter.sliding_window: needed by the sliding_attention layers of drafter.layer_types",
        ),
    ],
)
def test_bad_values_name_their_key(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL), [override])
    assert str(err.value) == message


def test_bad_file_values_name_their_key(tmp_path: Path) -> None:
    text = MINIMAL + '[drafter]\nnum_anchors = "many"\n'
    with pytest.raises(ConfigError, match=r'^drafter.num_anchors: expected an integer, got "many"$'):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"^data.path: required$"):
        parse_config({"target": {"path": "/m"}, "data": {}})
    with pytest.raises(ConfigError, match=r"^target: give exactly one of"):
        parse_config({"target": {"path": "/m", "tiny": {}}, "data": {"path": "x"}})
    with pytest.raises(ConfigError, match=r"not valid TOML"):
        load_config(write(tmp_path, "[target\n"))


def test_overrides_are_typed_by_the_field(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, MINIMAL),
        [
            "drafter.block_size=8",
            "drafter.gamma=3",  # an int where a float goes: accepted as 3.0
            "devices.targets=cuda:0,cuda:1,cpu,cpu",
            'devices.drafters=["cuda:2"]',
            "drafter.target_layer_ids=1,5,9",
            "output_dir=123",  # a str field keeps the text
            "compile=true",
            "checkpoint.resume=/ckpt/step-40",
        ],
    )
    assert cfg.drafter.block_size == 8
    assert cfg.drafter.gamma == 3.0 and isinstance(cfg.drafter.gamma, float)
    assert cfg.devices.targets == ("cuda:0", "cuda:1", "cpu", "cpu")
    assert cfg.devices.drafters == ("cuda:2",)
    assert cfg.drafter.target_layer_ids == (1, 5, 9)
    assert cfg.output_dir == "123"
    assert cfg.compile is True
    assert cfg.checkpoint.resume == "/ckpt/step-40"


def test_sliding_keys_default_to_none_and_a_window_without_a_sliding_layer_is_refused(tmp_path: Path) -> None:
    d = load_config(write(tmp_path, MINIMAL)).drafter
    assert d.sliding_window is None and d.layer_types is None  # every layer full, as before
    d = load_config(
        write(tmp_path, MINIMAL),
        ["drafter.layers=2", "drafter.sliding_window=64", "drafter.layer_types=sliding_attention,full_attention"],
    ).drafter
    assert d.sliding_window == 64 and d.layer_types == ("sliding_attention", "full_attention")
    with pytest.raises(ConfigError) as err:
        load_config(
            write(tmp_path, MINIMAL),
            ["drafter.layers=1", "drafter.sliding_window=64", "drafter.layer_types=full_attention"],
        )
    assert (
        str(err.value) == "drafter.sliding_window: no layer of drafter.layer_types is sliding_attention: leave it out"
    )


def test_override_none_clears_an_optional_value(tmp_path: Path) -> None:
    raw = {"target": {"tiny": {"vocab_size": 64}}, "data": {"path": "x"}}
    apply_override(raw, "target.tiny=none")
    apply_override(raw, "target.path=/models/q")
    cfg = parse_config(raw)
    assert cfg.target.tiny is None and cfg.target.path == "/models/q"


def test_cross_field_checks(tmp_path: Path) -> None:
    tiny = '[target.tiny]\nvocab_size = 64\nnum_layers = 8\n[data]\npath = "x"\n'
    with pytest.raises(ConfigError, match=r"^drafter.mask_token_id: 64 is outside the target vocabulary \(64\)$"):
        load_config(write(tmp_path, tiny), ["drafter.mask_token_id=64"])
    with pytest.raises(ConfigError, match=r"^drafter.target_layer_ids: layer 8 is beyond"):
        load_config(write(tmp_path, tiny), ["drafter.target_layer_ids=1,8"])
    with pytest.raises(ConfigError, match=r"^data.max_batch_tokens: must be >= data.max_length"):
        load_config(write(tmp_path, tiny), ["data.max_length=512", "data.max_batch_tokens=100"])
    with pytest.raises(ConfigError, match=r"^queue.capacity: per-drafter mode needs"):
        load_config(write(tmp_path, tiny), ["queue.mode=per-drafter", "queue.capacity=1", "devices.drafters=cpu,cpu"])


def test_run_dir_and_checkpoint_dir_follow_dflash_run_dir(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    attempt = tmp_path / "runs" / "dflash" / "attempt-3"
    env = {"DFLASH_RUN_DIR": str(attempt)}
    assert cfg.run_dir(env) == attempt
    # every attempt of a supervised run resumes from the same place
    assert cfg.checkpoint_dir(env) == (tmp_path / "runs" / "dflash" / "checkpoints").resolve()
    assert cfg.run_dir({}) == Path("runs/dflash")
    assert cfg.checkpoint_dir({}) == Path("runs/dflash/checkpoints")
    pinned = load_config(write(tmp_path, MINIMAL), ["checkpoint.dir=/ckpt"])
    assert pinned.checkpoint_dir(env) == Path("/ckpt")


def test_relative_data_path_resolves_next_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("")
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.data.path == str(tmp_path / "train.jsonl")
    assert cfg.target.path == "/models/qwen"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.selector_rank=1000000000", "drafter.selector_rank: must be <= 4096, got 1000000000"),
        ("checkpoint.sync_timeout=1e10", "checkpoint.sync_timeout: must be <= 604800 seconds (a week), got 1e+10"),
        ("barrier_timeout=1e10", "barrier_timeout: must be <= 604800 seconds (a week), got 1e+10"),
        ("distributed.timeout=1e12", "distributed.timeout: must be <= 604800 seconds (a week), got 1e+12"),
        ("target.tiny.hidden_size=1000000", "target.tiny.hidden_size: must be <= 16384, got 1000000"),
        ("drafter.num_anchors=100000000", "drafter.num_anchors: must be <= 65536, got 100000000"),
        ("data.batch_size=10000000", "data.batch_size: must be <= 65536, got 10000000"),
        ("queue.capacity=10000000", "queue.capacity: must be <= 65536, got 10000000"),
        ("epochs=1e300", "epochs: must be <= 1e+06, got 1e+300"),
    ],
)
def test_a_numeric_key_past_its_bound_is_one_line_when_the_config_is_read(override: str, message: str) -> None:
    """A 2 TB allocation traceback (selector_rank) and a traceback at the end of a finished run, its final
    sync lost (sync_timeout past what Python's waits take), are refused at start instead."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "tiny-random.toml", [override])
    assert str(e.value) == message


def test_every_bound_names_a_numeric_key_and_admits_its_default() -> None:
    """BOUNDS lists real keys (a typo would never check anything) and no default is past its bound."""
    from dflash import config
    from dflash.config import BOUNDS
    from dflash.model import model_config

    assert (config.MAX_VOCAB, config.MAX_LAYERS) == (model_config.MAX_VOCAB, model_config.MAX_LAYERS)
    cfg = load_config(REPO / "configs" / "tiny-random.toml")
    for path in BOUNDS:
        node: object = cfg
        for part in path.split("."):
            assert hasattr(node, part), path
            node = getattr(node, part)
        assert node is None or isinstance(node, (int, float)) and node <= BOUNDS[path], path


def test_train_refuses_a_bound_in_one_line_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    for override in ("drafter.selector_rank=1000000000", "checkpoint.sync_timeout=1e10"):
        p = subprocess.run(
            [sys.executable, "-m", "dflash", "train", "--config", str(REPO / "configs" / "tiny-random.toml"),
             "--set", f"output_dir={tmp_path}", "--set", override],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("dflash: "), p.stderr
        assert override.split("=")[0] + ": must be <= " in p.stderr
