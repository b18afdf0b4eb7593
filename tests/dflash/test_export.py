"""Checkpoints any Hugging Face user can load (dflash.py remote code, export, MASK id)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing as t
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash.checkpoint.checkpoints import latest_complete, load_drafter, save_checkpoint
from dflash.model import hf_remote
from dflash.model.drafter import DFlashDraftModel, draft_config_for, published_mask_token_id, selector_walk
from dflash.model.target import TargetModel, build_target_layer_ids, tiny_target_config

if t.TYPE_CHECKING:
    from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[2]
MASK = 511

pytestmark = pytest.mark.timeout(240)

# Runs in a fresh interpreter: the repo is off sys.path and any import of the `dflash` package fails,
# so only transformers + torch + each folder's own dflash.py can build the model. One interpreter loads every
# folder of a venv's list (each import of torch and transformers is seconds of CPU).
LOAD = textwrap.dedent("""
    import importlib.abc, json, sys
    repo = sys.argv[1]
    venv = sys.prefix + "/"  # the interpreter's own site-packages may live under the checkout (.venv*)
    sys.path[:] = [p for p in sys.path if p and not (p == repo or (p.startswith(repo + "/") and not p.startswith(venv)))]

    class NoDflash(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "dflash" or name.startswith("dflash."):
                raise ImportError("the dflash package must not be needed: " + name)
            return None

    sys.meta_path.insert(0, NoDflash())
    import torch
    import transformers
    from transformers import AutoModel
    for folder, inputs, out in json.loads(sys.argv[2]):
        model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        x = torch.load(inputs)
        with torch.no_grad():
            hidden = model(position_ids=x["position_ids"], noise_embedding=x["noise_embedding"],
                           target_hidden=x["target_hidden"])
        drafts = None
        if getattr(model, "candidate_selector", None) is not None:  # DFlash2: the selector's walk, as remote code
            walk = sys.modules[type(model).__module__].selector_walk
            with torch.no_grad():
                logits = hidden[:, 1:] @ x["lm_head"].T
                drafts = walk(model.candidate_selector, logits, hidden[:, 1:], x["anchor"])[0]
        torch.save({"hidden": hidden, "module": type(model).__module__, "dtype": str(next(model.parameters()).dtype),
                    "transformers": transformers.__version__, "drafts": drafts}, out)
""")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)


def new_drafter(**kw: object) -> DFlashDraftModel:
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=MASK, **kw)
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def inputs(target: TargetModel) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    block = torch.tensor([[int(ids[0, -1]), MASK, MASK, MASK]])
    with torch.no_grad():
        return {
            "position_ids": torch.arange(13)[None],
            "noise_embedding": target.head().embed(block),
            "target_hidden": target.features(ids),
        }


def load_in_fresh_interpreter(
    folders: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path, python: str = sys.executable
) -> dict[str, dict[str, object]]:
    """Each NAME: (FOLDER, INPUTS) loaded with AutoModel and run on its inputs, all in one fresh interpreter."""
    jobs = []
    for name, (folder, x) in folders.items():
        torch.save(x, tmp_path / f"{name}.in.pt")
        jobs.append([str(folder), str(tmp_path / f"{name}.in.pt"), str(tmp_path / f"{name}.out.pt")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [python, "-c", LOAD, str(REPO), json.dumps(jobs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: torch.load(tmp_path / f"{name}.out.pt") for name in folders}


@dataclasses.dataclass(frozen=True)
class Served:
    """A drafter trained 2 steps (checkpoints in ckpt/) and `dflash export`ed to out/, with an eval report."""

    run: Run
    ckpt: Path
    out: Path
    stdout: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    from dflash.__main__ import main
    from dflash.train.run import Run

    root = tmp_path_factory.mktemp("served")
    run = Run(run_config(root, "a", "max_steps=2"), environ={})
    assert run.train() == 0
    report = root / "eval.json"
    report.write_text(
        json.dumps(
            {
                "tau": 6.41,
                "num_prompts": 32,
                "prompts": "eval.jsonl",
                "max_new_tokens": 64,
                "target": "tiny",
                "all_equal": True,
            }
        )
    )
    out = root / "served"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["export", str(root / "a" / "ckpt"), str(out), "--eval", str(report)]) == 0
    return Served(run, root / "a" / "ckpt", out, stdout.getvalue())


VARIANTS: dict[str, dict[str, object]] = {
    "full": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
    "dflash2": {"dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}},
}


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, target: TargetModel
) -> dict[str, tuple[DFlashDraftModel, Path, dict[str, torch.Tensor]]]:
    """Each variant: the drafter, its checkpoint (step 3) and the inputs it is run on."""
    root = tmp_path_factory.mktemp("variants")
    made = {}
    for variant, kw in VARIANTS.items():
        drafter = new_drafter(**kw).eval()
        x = inputs(target)
        if variant == "dflash2":
            with torch.no_grad():  # convolutions and selector away from their init, so that they show
                for p in drafter.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            x = {**x, "lm_head": target.head().lm_head.weight.detach().clone(), "anchor": torch.tensor([3])}
        made[variant] = (drafter, save_checkpoint(root / variant, step=3, drafter=drafter, trainer_state={}), x)
    return made


@pytest.fixture(scope="module")
def loaded(
    tmp_path_factory: pytest.TempPathFactory, target: TargetModel, checkpoints: dict, served: Served
) -> t.Callable[[str], dict[str, dict[str, object]]]:
    """python -> what AutoModel made of each variant's checkpoint in one fresh interpreter of that venv (and, in
    this one's, of the exported bf16 folder as "served")."""
    done: dict[str, dict[str, dict[str, object]]] = {}

    def load(python: str) -> dict[str, dict[str, object]]:
        if python not in done:
            folders = {variant: (path, x) for variant, (_, path, x) in checkpoints.items()}
            if python == sys.executable:
                folders["served"] = (served.out, inputs(target))
            done[python] = load_in_fresh_interpreter(folders, tmp_path_factory.mktemp("load"), python)
        return done[python]

    return load


# floor: the remote code under this venv's transformers; the 4.57 case runs once (in .venv's run): the same subprocess
@pytest.mark.parametrize(
    "transformers_4",
    [pytest.param(False, id="this-transformers", marks=pytest.mark.floor), pytest.param(True, id="transformers-4.57")],
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_automodel_loads_a_checkpoint_in_a_fresh_interpreter_without_this_package(
    target: TargetModel,
    checkpoints: dict[str, tuple[DFlashDraftModel, Path, dict[str, torch.Tensor]]],
    loaded: t.Callable[[str], dict[str, dict[str, object]]],
    variant: str,
    transformers_4: bool,
    request: pytest.FixtureRequest,
) -> None:
    # transformers 4.57 (z-lab's pin, .venv-tf457): the remote code must load there too, bit for bit
    python = request.getfixturevalue("tf457_python") if transformers_4 else sys.executable
    drafter, path, x = checkpoints[variant]
    assert latest_complete(path.parent) == path, "dflash.py is part of a complete checkpoint"
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (path / "dflash.py").read_text() == hf_remote.source()
    got = loaded(python)[variant]
    if variant == "dflash2":
        with torch.no_grad():
            hidden = drafter(**{k: v for k, v in x.items() if k not in ("lm_head", "anchor")})
            assert drafter.candidate_selector is not None
            want = selector_walk(drafter.candidate_selector, hidden[:, 1:] @ x["lm_head"].T, hidden[:, 1:], x["anchor"])
        assert torch.equal(got["drafts"], want[0])  # type: ignore[arg-type]
        x = {k: v for k, v in x.items() if k not in ("lm_head", "anchor")}
    assert str(got["transformers"]).startswith("4.57.") == transformers_4
    assert str(got["module"]).startswith("transformers_modules.") and str(got["module"]).endswith(".dflash")
    with torch.no_grad():
        ours = drafter(**x)
    assert torch.equal(got["hidden"], ours)  # type: ignore[arg-type]
    logits = target.head().lm_head
    assert torch.equal(logits(got["hidden"]).argmax(-1), logits(ours).argmax(-1))  # type: ignore[arg-type]


def test_the_remote_module_is_generated_from_the_drafter_and_inlines_its_one_import(tmp_path: Path) -> None:
    import importlib.util

    text = hf_remote.source()
    assert "from dflash" not in text and "import dflash" not in text
    spec = importlib.util.spec_from_file_location("remote_check", hf_remote.write(tmp_path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["remote_check"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["remote_check"]
    assert module.build_target_layer_ids(36, 5) == build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_published_mask_id_for_qwen3_and_none_for_other_families() -> None:
    qwen3 = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    assert published_mask_token_id(qwen3) == 151669
    assert published_mask_token_id(tiny_target_config()) is None  # the tiny target: vocabulary 512


def test_published_mask_id_of_the_qwen3_5_family_from_its_text_config() -> None:
    """Qwen3.5, 3.6 and 3.8 targets (dense and MoE, multimodal wrappers whose text config is the model's):
    published drafters use 248070 of the 248,320 rows, not the last row."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    for config in (Qwen3_5Config(), Qwen3_5MoeConfig(), Qwen3_5TextConfig(), Qwen3_5MoeTextConfig()):
        assert published_mask_token_id(config) == 248070, type(config).__name__
    assert published_mask_token_id(Qwen3_5TextConfig(vocab_size=151936)) is None  # another vocabulary


@pytest.mark.floor  # a published folder's config.json read by this transformers
@pytest.mark.parametrize(
    ("layer_types", "is_causal", "refused"),
    [
        (["full_attention"] * 2, False, None),  # what the masks are anyway: read, never written back
        (["sliding_attention"] * 2, True, None),
        (
            ["sliding_attention", "full_attention"],
            False,
            "is_causal false makes layer 0 (sliding_attention) non-causal (a sliding layer: a two-sided window)",
        ),
        (["full_attention"] * 2, True, "is_causal true makes layer 0 (full_attention) causal"),
    ],
)
def test_a_published_is_causal_is_honoured_when_it_is_our_masks_and_refused_in_one_line_otherwise(
    tmp_path: Path, layer_types: list[str], is_causal: bool, refused: str | None
) -> None:
    """z-lab's newer drafters carry a top-level ``is_causal`` (vLLM, SGLang and z-lab's reference read it for
    every layer). Training (``drafter.init_from``), ``dflash eval --drafter`` (both ``load_drafter``) and the
    remote code (the same config class) read it alike."""
    import importlib.util

    from dflash.checkpoint.checkpoints import config_json
    from dflash.checkpoint.manifest import CheckpointError

    drafter = new_drafter(layer_types=layer_types, sliding_window=5)
    ours = save_checkpoint(tmp_path / "ck", step=1, drafter=drafter, trainer_state={})
    published = tmp_path / "published"
    published.mkdir()
    data = json.loads((ours / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({**data, "is_causal": is_causal}))
    (published / "model.safetensors").write_bytes((ours / "model.safetensors").read_bytes())
    spec = importlib.util.spec_from_file_location("remote_causal", hf_remote.write(tmp_path))
    assert spec is not None and spec.loader is not None
    remote = importlib.util.module_from_spec(spec)
    sys.modules["remote_causal"] = remote
    try:
        spec.loader.exec_module(remote)
        if refused is None:
            model = load_drafter(published)
            assert "is_causal" not in json.loads(config_json(model.config))  # an export never writes it
            assert "is_causal" not in remote.DFlashDraftConfig.from_dict({**data, "is_causal": is_causal}).to_dict()
            return
        with pytest.raises(CheckpointError) as got:
            load_drafter(published)
        line = str(got.value)
        assert line.startswith(f"{published / 'config.json'}: {refused}, as vLLM, SGLang and z-lab's reference")
        assert "(vLLM _dflash_layer_causal, SGLang _get_dflash_attention_type)" in line  # the engine rule it lacks
        assert "\n" not in line and line.endswith("so it cannot train or decode this one with the masks it learnt")
        with pytest.raises(ValueError, match=f"^{re.escape(refused)}"):
            remote.DFlashDraftConfig.from_dict({**data, "is_causal": is_causal})
    finally:
        del sys.modules["remote_causal"]


# ---- warm start from a published drafter ---------------------------------------------------


def run_config(tmp_path: Path, name: str, *overrides: str):
    from tests.dflash.conftest import tiny_config

    # the run dir is <name>/run now, the checkpoints <name>/ckpt as before
    return tiny_config(
        tmp_path / name, "checkpoint.resume=never", "devices.drafters=cpu", "devices.targets=cpu", *overrides
    )


@pytest.mark.floor  # a published folder's config.json read by this transformers
def test_init_from_a_published_drafter_folder_starts_from_its_weights(tmp_path: Path, served: Served) -> None:
    import zlab_reference

    from dflash.config import ConfigError
    from dflash.train.run import Run

    ours = latest_complete(served.ckpt)  # a run of 2 steps
    assert ours is not None
    # a published-drafter folder: written by z-lab's class (config.json + model.safetensors only)
    zlab_reference.DFlashDraftModel.from_pretrained(ours).save_pretrained(tmp_path / "published")
    published = load_drafter(tmp_path / "published")

    warm = Run(run_config(tmp_path, "b", "max_steps=1", f"drafter.init_from={tmp_path / 'published'}"), environ={})
    assert warm.mask_token_id == published.mask_token_id == MASK
    for (name, a), b in zip(warm.drafters[0].model.state_dict().items(), published.state_dict().values()):
        assert torch.equal(a, b), name
    cold = Run(run_config(tmp_path, "c", "max_steps=1"), environ={})
    assert not torch.equal(cold.drafters[0].model.fc.weight, published.fc.weight)

    with pytest.raises(
        ConfigError, match=r"^drafter\.init_from: .*published: block_size is 8, but drafter\.block_size is 4$"
    ):
        Run(
            run_config(
                tmp_path, "d", "max_steps=1", "drafter.block_size=4", f"drafter.init_from={tmp_path / 'published'}"
            ),
            environ={},
        )
    with pytest.raises(ConfigError, match=r"^drafter\.mask_token_id: 7 differs from 511, the id the drafter in "):
        Run(
            run_config(
                tmp_path, "e", "max_steps=1", "drafter.mask_token_id=7", f"drafter.init_from={tmp_path / 'published'}"
            ),
            environ={},
        )
    with pytest.raises(ConfigError, match=r"^drafter\.init_from: .*nowhere: no config\.json$"):
        Run(run_config(tmp_path, "f", "max_steps=1", f"drafter.init_from={tmp_path / 'nowhere'}"), environ={})


# ---- dflash export --------------------------------------------------------------------------


@pytest.mark.floor  # AutoModel in 5.13-5.18 registers the remote class (drafter.py's config_class)
def test_export_writes_a_serving_folder_that_automodel_loads_in_bf16(
    tmp_path: Path,
    target: TargetModel,
    served: Served,
    loaded: t.Callable[[str], dict[str, dict[str, object]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from safetensors.torch import load_file

    from dflash.__main__ import main

    out, ckpt = served.out, served.ckpt  # `export CKPT OUT --eval REPORT` of a run of 2 steps
    assert f"exported bfloat16 drafter to {out}" in served.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dflash.py", "model.safetensors"]
    weights = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    trained = served.run.drafters[0].model.state_dict()
    assert weights.keys() == trained.keys()
    assert all(torch.equal(weights[k], trained[k].to(torch.bfloat16)) for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    card = (out / "README.md").read_text()
    assert "tau 6.41" in card and "tiny-data.jsonl" in card and "(step 2)" in card
    assert "a tiny random Qwen3-shaped target" in card and "MASK id 511" in card

    x = {k: v for k, v in inputs(target).items()}
    got = loaded(sys.executable)["served"]
    assert got["dtype"] == "torch.bfloat16"
    ours = load_drafter(out)
    with torch.no_grad():  # bf16: RoPE tables may be kept in another precision by from_pretrained (fp32 is exact above)
        torch.testing.assert_close(got["hidden"], ours(**x), atol=5e-2, rtol=2e-2)  # type: ignore[arg-type]

    # bad input: one line, exit 2, OUT untouched
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out)]) == 2
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 2
    assert main(["export", str(ckpt), str(tmp_path / "o3"), "--eval", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"dflash: {out}: exists and is not empty (use --force to replace it)",
        f"dflash: {tmp_path / 'nowhere'}: no such checkpoint",
        f"dflash: --eval: {tmp_path / 'x.json'} does not exist",
    ]
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    # one dtype vocabulary: the config's names (canonical, dflash/dtypes.py) and the short ones export took first
    again = tmp_path / "served"  # a copy: the module's export stays as it was written
    shutil.copytree(out, again)
    for spelling in ("fp16", "float16"):
        capsys.readouterr()
        assert main(["export", str(ckpt), str(again), "--dtype", spelling, "--force"]) == 0
        assert {v.dtype for v in load_file(str(again / "model.safetensors")).values()} == {torch.float16}
        assert f"exported float16 drafter to {again}" in capsys.readouterr().out


def test_a_qwen3_shaped_target_gets_the_published_mask_id_recorded_in_config_json(tmp_path: Path) -> None:
    from dflash.train.run import Run

    run = Run(
        run_config(tmp_path, "q", "max_steps=1", "target.tiny.vocab_size=151936", "target.tiny.num_layers=4"),
        environ={},
    )
    assert run.mask_token_id == 151669 and run.drafters[0].model.mask_token_id == 151669
    path = save_checkpoint(tmp_path / "ck", step=1, drafter=run.drafters[0].model, trainer_state={})
    assert json.loads((path / "config.json").read_text())["dflash_config"]["mask_token_id"] == 151669
    # an explicit id wins over the family's
    assert (
        Run(
            run_config(
                tmp_path,
                "r",
                "max_steps=1",
                "target.tiny.vocab_size=151936",
                "target.tiny.num_layers=4",
                "drafter.mask_token_id=151935",
            ),
            environ={},
        ).mask_token_id
        == 151935
    )


# ---- tried as a hostile user would ---------------------------------------


def export_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from dflash.__main__ import main

    capsys.readouterr()
    rc = main(["export", *args])
    return rc, capsys.readouterr().err


def test_export_force_never_deletes_what_it_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export CKPT . --force` deleted the working directory; OUT = the checkpoint replaced it (trainer
    state, manifest, fp32 weights gone); OUT = the checkpoints folder deleted every step-*. And
    `export CKPT .` in an empty folder removed it, then crashed."""
    root = tmp_path / "run" / "checkpoints"
    ckpt = save_checkpoint(root, step=1, drafter=new_drafter(), trainer_state={})
    before = sorted(p.name for p in ckpt.iterdir())
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine too")
    monkeypatch.chdir(work)
    cases = [
        ([str(ckpt), ".", "--force"], "export: OUT . is the working directory"),
        ([str(ckpt), str(tmp_path), "--force"], f"export: OUT {tmp_path} is a folder above the working directory"),
        ([str(ckpt), str(ckpt), "--force"], f"export: OUT {ckpt} is the input {ckpt}"),
        ([str(root), str(root), "--force"], f"export: OUT {root} is the input {root}"),
        ([str(ckpt), str(root), "--force"], f"export: OUT {root} holds the input {ckpt}"),
        ([str(ckpt), str(tmp_path / "run"), "--force"], f"export: OUT {tmp_path / 'run'} holds the input {ckpt}"),
        ([str(ckpt), str(other), "--force"], f"dflash: {other}: not replaced: it holds notes.txt, which export"),
    ]
    for args, line in cases:
        rc, err = export_main(capsys, *args)
        assert (rc, err.count("\n")) == (2, 1) and err.startswith(line), (args, err)
    assert sorted(p.name for p in ckpt.iterdir()) == before and (work / "keep.txt").read_text() == "mine"
    assert [p.name for p in root.iterdir()] == ["step-1"] and (other / "notes.txt").is_file()
    (work / "keep.txt").unlink()
    rc, err = export_main(capsys, str(ckpt), ".")  # an empty working directory
    assert rc == 2 and err.startswith("export: OUT . is the working directory"), err
    assert work.is_dir() and list(work.iterdir()) == []
    # an earlier export is what --force replaces
    assert export_main(capsys, str(ckpt), str(tmp_path / "served"))[0] == 0
    rc, err = export_main(capsys, str(ckpt), str(tmp_path / "served"), "--force", "--dtype", "fp32")
    assert rc == 0, err
    assert json.loads((tmp_path / "served" / "config.json").read_text())["dtype"] == "float32"


def test_an_eval_report_with_figures_that_are_not_numbers_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Smaller: `tau NaN` went into the model card ("tau nan"); a report nested 100000 deep was a traceback."""
    ckpt = save_checkpoint(tmp_path / "ck", step=1, drafter=new_drafter(), trainer_state={})
    good = {"tau": 3.5, "num_prompts": 4, "prompts": "p.jsonl", "position_acceptance": [0.5, 0.25]}
    cases = [
        ('{"tau": NaN}', "is not JSON (NaN is not a number JSON allows)"),
        ('{"tau": 1e400}', "is not JSON (1e400 is out of range)"),
        ("[" * 100_000 + "]" * 100_000, "is not JSON (nested too deeply)"),
        (json.dumps({**good, "tau": True}), ": tau is true, not what `dflash eval --json` writes"),
        (json.dumps({**good, "tau": "6"}), ': tau is "6", not what `dflash eval --json` writes'),
        (json.dumps({**good, "position_acceptance": ["x"]}), ': position_acceptance is ["x"], not what'),
        (json.dumps({**good, "num_prompts": 2.5}), ": num_prompts is 2.5, not what"),
    ]
    for k, (text, words) in enumerate(cases):
        report = tmp_path / f"r{k}.json"
        report.write_text(text)
        rc, err = export_main(capsys, str(ckpt), str(tmp_path / f"o{k}"), "--eval", str(report))
        assert (rc, err.count("\n")) == (2, 1) and err.startswith(f"dflash: --eval: {report}") and words in err, err
        assert not (tmp_path / f"o{k}").exists()
    report = tmp_path / "good.json"
    report.write_text(json.dumps(good))
    assert export_main(capsys, str(ckpt), str(tmp_path / "o"), "--eval", str(report))[0] == 0
    card = (tmp_path / "o" / "README.md").read_text()
    assert "tau 3.50" in card and "0.50 0.25" in card


def test_a_verifier_config_json_nested_too_deeply_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Smaller, the class not the case: `export --format speculators --verifier DIR` read DIR/config.json with
    json.loads, and one nested 100000 deep was a RecursionError traceback."""
    ckpt = save_checkpoint(tmp_path / "checkpoints", step=1, drafter=new_drafter(), trainer_state={})
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, err = export_main(
        capsys, str(ckpt), str(tmp_path / "out"), "--format", "speculators", "--verifier", str(verifier)
    )
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"dflash: --verifier {verifier}: {verifier}/config.json is not JSON (nested too deeply"), err
    assert not (tmp_path / "out").exists()
