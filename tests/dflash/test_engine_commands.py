"""Every engine command the model card and docs/serving.md print, checked flag by flag against what each engine
version accepts: the next release that drops a flag or an environment variable fails here, not on a user's night.

The table is read from the wheels (``pip download --no-deps``): vLLM 0.33.0 and 0.34.0 (``vllm/engine/arg_utils.py``
``--speculative-config``; ``vllm/config/speculative.py`` the speculative config's fields;
``vllm/platforms/interface.py`` ``validate_environ``: 0.34 refuses ``VLLM_USE_V2_MODEL_RUNNER`` other than 1),
``--port``: ``vllm/entrypoints/common/cli_args.py`` (``port: int = 8000``); SGLang 0.5.23
(``sglang/srt/arg_groups/fields/{model,spec,observability}.py``: a field ``x_y`` is ``--x-y``).
"""

from __future__ import annotations

import json
import re
import shlex
import typing as t
from pathlib import Path

import pytest

from dflash.model.drafter import draft_config_for
from dflash.model.target import tiny_target_config
from dflash.serve.export import model_card

REPO = Path(__file__).resolve().parents[2]

SPEC_KEYS = {"method", "model", "num_speculative_tokens", "attention_backend"}
ENGINES: dict[str, dict[str, t.Any]] = {
    "vLLM 0.33.0": {
        "program": ("vllm", "serve"),
        "flags": {"--speculative-config", "--port"},
        "env": {"VLLM_USE_V2_MODEL_RUNNER": {"0", "1"}},
        "spec_keys": SPEC_KEYS,
    },
    "vLLM 0.34.0": {
        "program": ("vllm", "serve"),
        "flags": {"--speculative-config", "--port"},
        "env": {"VLLM_USE_V2_MODEL_RUNNER": {"1"}},  # =0: "no longer supported: Model Runner V1 has been removed"
        "spec_keys": SPEC_KEYS,
    },
    "SGLang 0.5.23": {
        "program": ("python", "-m", "sglang.launch_server"),
        "flags": {
            "--model-path",
            "--speculative-algorithm",
            "--speculative-draft-model-path",
            "--speculative-num-draft-tokens",
            "--enable-metrics",
        },
        "env": {},
        "spec_keys": set(),
    },
}
BOOLEAN = {"--enable-metrics"}


def problems(command: str) -> list[str]:
    """What each engine version in ``ENGINES`` would refuse in ``command`` (empty: every version takes it)."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    out = []
    engines = [(n, e) for n, e in ENGINES.items() if tuple(words[: len(e["program"])]) == e["program"]]
    assert engines, f"no engine runs {command!r}"
    for name, engine in engines:
        for var, value in env.items():
            if value not in engine["env"].get(var, set()):
                out.append(f"{name}: {var}={value}")
        args = words[len(engine["program"]) :]
        if engine["program"][0] == "vllm":
            args = args[1:]  # the model
        i = 0
        while i < len(args):
            flag = args[i]
            if flag not in engine["flags"]:
                out.append(f"{name}: {flag}")
            if flag == "--speculative-config":
                unknown = set(json.loads(args[i + 1])) - engine["spec_keys"]
                out += [f"{name}: speculative config {k}" for k in sorted(unknown)]
            i += 1 if flag in BOOLEAN else 2
    return out


def commands(text: str) -> list[str]:
    """The engine commands in the fenced blocks of ``text``: continuation lines joined, a ``$`` prompt, a
    trailing ``# comment`` and ``&`` dropped."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"\bvllm serve\b|sglang\.launch_server", line):
                line = re.sub(r"\s#\s.*$", "", line.strip().removeprefix("$ ")).strip().removesuffix("&").strip()
                out.append(line)
    return out


def cards() -> dict[str, str]:
    dflash2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}
    variants: dict[str, dict[str, t.Any]] = {
        "full": {},
        "mixed": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
        "dflash2": {"dflash2": dflash2},
        "own-vocab": {"draft_vocab_size": 64, "has_own_lm_head": True},
    }
    out = {}
    for name, kw in variants.items():
        config = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=511, **kw)
        for fmt in ("zlab", "speculators"):
            out[f"{name}-{fmt}"] = model_card(
                source=Path("ckpt"), config=config, dtype="bfloat16", run={}, report=None, out=Path("/out"), fmt=fmt
            )
    return out


CARDS = cards()


def test_the_checker_fails_a_flag_or_value_a_version_does_not_take() -> None:
    assert problems('VLLM_USE_V2_MODEL_RUNNER=0 vllm serve T --speculative-config \'{"model": "d"}\'') == [
        "vLLM 0.34.0: VLLM_USE_V2_MODEL_RUNNER=0"
    ]
    assert problems("vllm serve T --attention-backend flash_attn") == [
        "vLLM 0.33.0: --attention-backend",
        "vLLM 0.34.0: --attention-backend",
    ]
    assert problems("python -m sglang.launch_server --speculative-dflash-draft-window-size 4") == [
        "SGLang 0.5.23: --speculative-dflash-draft-window-size"
    ]


@pytest.mark.parametrize("name", sorted(CARDS))
def test_every_command_a_model_card_prints_runs_on_every_engine_version(name: str) -> None:
    found = commands(CARDS[name])
    assert found and any(c.startswith("vllm serve") for c in found)
    for command in found:
        assert problems(command) == [], command


def test_every_command_the_docs_print_runs_on_every_engine_version() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {page.name: commands(page.read_text()) for page in pages}
    assert len(found["serving.md"]) >= 3 and found["gpu.md"]
    for page, lines in found.items():
        for command in lines:
            assert problems(command) == [], f"{page}: {command}"


def test_a_drafter_only_the_v2_runner_serves_gets_the_pre_0_33_note_and_no_prefix() -> None:
    for name in ("mixed-zlab", "dflash2-zlab"):
        assert "on a build before 0.33 put `VLLM_USE_V2_MODEL_RUNNER=1` in front" in CARDS[name]
    assert "VLLM_USE_V2_MODEL_RUNNER" not in CARDS["full-zlab"]
    assert "load_dflash_model" in CARDS["full-zlab"]


def test_a_drafter_with_its_own_draft_vocabulary_gets_no_sglang_command() -> None:
    assert "sglang.launch_server" in CARDS["full-zlab"] and "sglang.launch_server" not in CARDS["own-vocab-zlab"]
    assert "Not SGLang: this drafter has its own lm_head over 64 of 512 tokens" in CARDS["own-vocab-zlab"]
