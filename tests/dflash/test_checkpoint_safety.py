"""Checkpoints you can trust: run identities, sha256 verification, the background
writer, and one-line errors for bad run configs and mismatched drafters."""

from __future__ import annotations

import io
import json
import logging
import shutil
import threading
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.__main__ import main as dflash_main
from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError, RunConfig, load_config
from dflash.data.samples import DataError
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"
MASK = 511

pytestmark = pytest.mark.timeout(240)


def tiny(tmp_path: Path, *overrides: str) -> RunConfig:
    # one drafter: a checkpoint lands exactly on its interval (two may add the step in flight)
    return tiny_config(tmp_path, "log_every=100", "max_steps=4", "devices.drafters=cpu", *overrides)


def train(tmp_path: Path, *overrides: str) -> Run:
    run = Run(tiny(tmp_path, *overrides), environ={}, stream=io.StringIO())
    assert run.train() == 0
    return run


def new_drafter(seed: int = 0, **target_kw: t.Any) -> DFlashDraftModel:
    cfg = draft_config_for(tiny_target_config(**target_kw), num_layers=2, block_size=4, mask_token_id=MASK)
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> t.Iterator[t.Callable[..., tuple[int, list[str]]]]:
    """``dflash ...`` in process: (exit code, stderr lines). Restores the logging that main() sets up."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)

    def call(*args: str) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = dflash_main(list(args))
        return code, capsys.readouterr().err.strip().splitlines()

    yield call
    root.handlers[:], root.level = saved[0], saved[1]


def steps(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.name.startswith("step-")), key=lambda n: int(n[5:]))


def flip_a_byte(path: Path, offset: int) -> None:
    """Same size, other bytes: what a bad disk or a torn copy leaves."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# 11.6: every run has an identity


def test_resume_never_moves_the_first_run_aside_and_keeps_its_own_fresh_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = train(tmp_path, "max_steps=8", "checkpoint.interval=4", "checkpoint.keep=2")
    root = tmp_path / "ckpt"
    assert steps(root) == ["step-4", "step-8"]
    caplog.set_level(logging.INFO)
    # The second run restarts from scratch: before, its step-2 was pruned at once (4 and 8 are "newer")
    # and its step-4 replaced the first run's, leaving a mix that resume=auto continued as the first run.
    second = train(tmp_path, "max_steps=4", "checkpoint.interval=2", "checkpoint.keep=2", "checkpoint.resume=never")
    assert steps(root) == ["step-2", "step-4"]
    assert second.run_id != first.run_id
    assert {ckpt.run_of(root / n) for n in steps(root)} == {second.run_id}
    aside = [p for p in root.iterdir() if p.name.startswith("old-")]
    assert [p.name.startswith(f"old-{first.run_id}-") for p in aside] == [True]
    assert steps(aside[0]) == ["step-4", "step-8"], "nothing of the first run was lost"
    assert ckpt.load_checkpoint(aside[0] / "step-8").step == 8
    said = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(said) == 1 and aside[0].name in said[0] and "nothing deleted" in said[0]
    third = Run(tiny(tmp_path, "max_steps=6"), environ={}, stream=io.StringIO())
    assert (third.start_step, third.run_id) == (4, second.run_id), "resume=auto continues the newest run"


def test_keep_prunes_only_the_runs_own_checkpoints_and_never_its_newest(tmp_path: Path) -> None:
    d = new_drafter()
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step=step, drafter=d, trainer_state={}, run_id="20260101T000000Z-aaaa", keep=2)
    assert steps(tmp_path) == ["step-20", "step-30"]
    b = "20260202T000000Z-bbbb"  # a newer run, at lower steps
    ckpt.save_checkpoint(tmp_path, step=11, drafter=d, trainer_state={}, run_id=b, keep=1)
    ckpt.save_checkpoint(tmp_path, step=12, drafter=d, trainer_state={}, run_id=b, keep=1)
    assert steps(tmp_path) == ["step-12", "step-20", "step-30"]
    assert ckpt.latest_complete(tmp_path) == tmp_path / "step-12", "the newest run, not the highest step"
    assert ckpt.resume_order(tmp_path) == [tmp_path / n for n in ("step-12", "step-30", "step-20")]


def test_another_runs_checkpoint_in_the_way_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    ckpt.save_checkpoint(
        tmp_path, step=5, drafter=new_drafter(1), trainer_state={"who": "a"}, run_id="20260101T000000Z-aaaa"
    )
    ckpt.save_checkpoint(
        tmp_path, step=5, drafter=new_drafter(2), trainer_state={"who": "b"}, run_id="20260202T000000Z-bbbb"
    )
    assert ckpt.load_checkpoint(tmp_path / "step-5").trainer_state == {"who": "b"}
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("old-20260101T000000Z-aaaa-")]
    assert len(aside) == 1 and ckpt.load_checkpoint(aside[0] / "step-5").trainer_state == {"who": "a"}


def test_resuming_an_older_checkpoint_of_a_run_forks_a_new_run_that_leaves_the_later_ones_alone(tmp_path: Path) -> None:
    first = train(tmp_path, "max_steps=6", "checkpoint.interval=3", "checkpoint.keep=1")
    root = tmp_path / "ckpt"
    assert steps(root) == ["step-6"]
    shutil.copytree(root / "step-6", tmp_path / "step-6")  # a copy to resume from explicitly, later
    assert train(tmp_path, "max_steps=9", "checkpoint.interval=3").run_id == first.run_id  # it goes on: step-9
    fork = train(
        tmp_path,
        "max_steps=8",
        "checkpoint.interval=1",
        "checkpoint.keep=1",
        f"checkpoint.resume={tmp_path / 'step-6'}",
    )
    assert fork.run_id != first.run_id
    assert steps(root) == ["step-6", "step-8", "step-9"], "keep=1 of the fork pruned none of the first run's"
    assert ckpt.run_of(root / "step-9") == first.run_id and ckpt.run_of(root / "step-8") == fork.run_id


# --------------------------------------------------------------------------------------------
# 11.7: sha256 in the manifest, verified on load


def test_run_ids_made_within_one_second_sort_in_the_order_they_were_made() -> None:
    # A fork started within the second of the run it forks from must sort after it (CI saw the older run
    # win on its random hex, and resume took the wrong run's checkpoint).
    ids = [ckpt.new_run_id() for _ in range(50)]
    assert sorted(ids) == ids and len(set(ids)) == 50


def test_resume_auto_skips_a_corrupted_checkpoint_for_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = train(tmp_path, "max_steps=6", "checkpoint.interval=3")
    root = tmp_path / "ckpt"
    assert steps(root) == ["step-3", "step-6"]
    flip_a_byte(root / "step-6" / "model.safetensors", 2)  # the header: safetensors cannot parse it
    caplog.set_level(logging.WARNING)
    run = Run(tiny(tmp_path, "max_steps=9", "checkpoint.interval=3"), environ={}, stream=io.StringIO())
    assert run.start_step == 3, "continued from the previous complete checkpoint instead of crashing"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"skipping {root / 'step-6'}" in said and "model.safetensors is corrupted" in said
    assert run.run_id != first.run_id, "step-6 of the first run exists: continuing from step-3 is a new run"
    assert run.train() == 0
    assert ckpt.latest_complete(root) == root / "step-9" and ckpt.run_of(root / "step-6") == run.run_id
    bad = [p / "step-6" for p in root.iterdir() if p.name.startswith("old-")]
    assert len(bad) == 1 and ckpt.run_of(bad[0]) == first.run_id, "the corrupted one was moved aside, not deleted"


def test_a_flipped_weight_byte_is_caught_by_load_checkpoint_load_drafter_and_eval(tmp_path: Path, cli: t.Any) -> None:
    run = train(tmp_path, "max_steps=2")
    path = tmp_path / "ckpt" / "step-2"
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert set(manifest["sha256"]) == {"config.json", "dflash.py", "model.safetensors", "trainer_state.pt"}
    assert manifest["run_id"] == run.run_id
    flip_a_byte(path / "model.safetensors", (path / "model.safetensors").stat().st_size - 3)  # a weight, not the header
    with pytest.raises(CheckpointError, match="model.safetensors is corrupted"):
        ckpt.load_checkpoint(path)
    with pytest.raises(CheckpointError, match="model.safetensors is corrupted"):
        ckpt.load_drafter(path)
    assert ckpt.latest_complete(tmp_path / "ckpt") is None
    code, err = cli("eval", "--drafter", str(path), "--limit", "1")
    assert code == 2 and err == [
        f"dflash: --drafter: {path}: model.safetensors is corrupted: its sha256 is not the one in checkpoint.json"
    ]


def test_checkpoints_without_sums_or_run_ids_still_load_and_count_as_the_oldest_run(tmp_path: Path) -> None:
    d = new_drafter()
    old = ckpt.save_checkpoint(tmp_path, step=50, drafter=d, trainer_state={})
    manifest = json.loads((old / "checkpoint.json").read_text())
    del manifest["sha256"], manifest["run_id"]  # what checkpoints written before this change hold
    (old / "checkpoint.json").write_text(json.dumps(manifest))
    assert ckpt.load_checkpoint(old).run_id is None and ckpt.latest_complete(tmp_path) == old
    assert isinstance(ckpt.load_drafter(old), DFlashDraftModel)
    new = ckpt.save_checkpoint(tmp_path, step=3, drafter=d, trainer_state={}, run_id=ckpt.new_run_id())
    assert ckpt.resume_order(tmp_path) == [new, old]


def test_all_checkpoints_corrupted_refuses_with_one_line(tmp_path: Path) -> None:
    train(tmp_path, "max_steps=2")
    flip_a_byte(tmp_path / "ckpt" / "step-2" / "trainer_state.pt", 40)
    with pytest.raises(ConfigError, match=r"^checkpoint.resume: no checkpoint in .* is intact \(step-2\)"):
        Run(tiny(tmp_path), environ={}, stream=io.StringIO())


# --------------------------------------------------------------------------------------------
# 16.7: the barrier waits for a CPU snapshot; one background write at a time


class _Gate:
    """Pickled inside the trainer state: holds the writer thread until the test opens it."""

    entered = threading.Event()
    release = threading.Event()

    def __reduce__(self) -> t.Any:
        _Gate.entered.set()
        assert _Gate.release.wait(60), "the test never released the writer"
        return (int, (0,))


def test_the_writer_runs_in_the_background_from_a_snapshot_and_keeps_order(tmp_path: Path) -> None:
    d = new_drafter()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    writer = ckpt.CheckpointWriter(tmp_path, keep=None)
    _Gate.entered.clear()
    _Gate.release.clear()
    writer.submit(ckpt.snapshot(d, step=1, trainer_state={"gate": _Gate()}, run_id="r"))
    assert _Gate.entered.wait(60)
    assert writer.busy and not (tmp_path / "step-1").exists(), "submit returned while the write is in flight"
    with torch.no_grad():
        for p in d.parameters():
            p.add_(1.0)  # training goes on after the barrier
    _Gate.release.set()
    assert writer.wait() == tmp_path / "step-1"
    saved = ckpt.load_drafter(tmp_path / "step-1").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in before.items()), "the checkpoint holds the snapshot"
    spare = writer.spare()
    assert spare is not None and writer.spare() is None, "handed over once"
    snap = ckpt.snapshot(d, step=2, trainer_state={}, run_id="r", reuse=spare)
    name = "fc.weight"
    assert snap.weights[name] is spare.weights[name], "the written snapshot's buffers are reused"
    assert torch.equal(snap.weights[name], d.fc.weight) and not torch.equal(snap.weights[name], before[name])
    writer.submit(snap)
    writer.submit(ckpt.snapshot(d, step=3, trainer_state={}, run_id="r"))  # waits for step 2 first
    assert writer.wait() == tmp_path / "step-3" and steps(tmp_path) == ["step-1", "step-2", "step-3"]
    saved = ckpt.load_drafter(tmp_path / "step-2").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in d.state_dict().items())


def test_a_failed_background_write_is_raised_by_the_next_wait(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    writer = ckpt.CheckpointWriter(blocker / "ckpt")
    writer.submit(ckpt.snapshot(new_drafter(), step=7, trainer_state={}))
    with pytest.raises(ckpt.CheckpointWriteError, match=r"^checkpoint step 7 could not be written to .*a-file/ckpt: "):
        writer.wait()
    assert writer.wait() is None, "raised once"


def test_a_run_whose_checkpoint_cannot_be_written_fails_after_training(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file where the checkpoint dir should be")
    run = Run(tiny(tmp_path, "max_steps=3"), environ={}, stream=io.StringIO())
    with pytest.raises(ckpt.CheckpointWriteError, match="checkpoint step 3 could not be written"):
        run.train()


def test_one_replicas_moments_are_saved_and_every_replica_resumes_with_them(tmp_path: Path) -> None:
    train(tmp_path, "max_steps=4", "devices.drafters=cpu,cpu")
    saved = ckpt.load_checkpoint(tmp_path / "ckpt" / "step-4")
    assert len(saved.optimizer_state["replicas"]) == 1 and saved.trainer_state["drafters"] == 2
    again = Run(tiny(tmp_path, "max_steps=6", "devices.drafters=cpu,cpu"), environ={}, stream=io.StringIO())
    want = saved.optimizer_state["replicas"][0]["state"]
    for r in again.drafters:
        got = r.optimizer.state_dict()["state"]
        assert all(torch.equal(got[i]["exp_avg"], want[i]["exp_avg"]) for i in want)


# --------------------------------------------------------------------------------------------
# 11.14: one line instead of a traceback


def test_a_run_config_that_is_not_utf8_or_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"max_steps = 3\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"^--config: .*latin1.toml is not UTF-8 text \(byte 19\)"):
        load_config(bad)
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.toml: not valid TOML: tables or arrays nested too deeply$"):
        load_config(deep)
    with pytest.raises(ConfigError, match=r"^drafter.layers: expected an integer"):
        load_config(TINY, ["drafter.layers=" + "[" * 100_000])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=99999999999999999999999", "seed: 99999999999999999999999 is out of range for a 64-bit integer"),
        ("seed=99999999999", "seed: must be in [0, 4294967295], got 99999999999"),
        ("optim.lr=nan", "optim.lr: expected a finite number, got nan"),
        ("optim.lr=inf", "optim.lr: expected a finite number, got inf"),
        ("barrier_timeout=-inf", "barrier_timeout: expected a finite number, got -inf"),
        ("optim.betas=[0.9, nan]", "optim.betas[1]: expected a finite number, got nan"),
        ("optim.eps=1" + "0" * 400, "optim.eps: expected a finite number, got a huge integer"),
    ],
)
def test_numbers_out_of_range_or_not_finite_name_their_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert str(err.value) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^devices.targets\[0\]: cuda:0 asked for, but this machine .* has no CUDA device$"
    ):
        Run(tiny(tmp_path, "devices.targets=cuda:0"), environ={})


def test_data_path_a_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^data.path: .* is a directory; expected a JSONL file$"):
        Run(tiny(tmp_path, f"data.path={tmp_path}"), environ={})


def test_eval_with_a_drafter_for_another_target_says_so_before_decoding(tmp_path: Path, cli: t.Any) -> None:
    cfg = tiny(tmp_path)
    from dflash.config import to_dict

    other = new_drafter(hidden_size=32, head_dim=8)  # trained for a target of hidden size 32; the run's is 64
    path = ckpt.save_checkpoint(tmp_path / "other", step=1, drafter=other, trainer_state={"config": to_dict(cfg)})
    (tmp_path / "prompts.jsonl").write_text('{"input_ids": [1, 2, 3, 4]}\n')
    code, err = cli("eval", "--drafter", str(path), "--prompts", str(tmp_path / "prompts.jsonl"))
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("dflash: --drafter: its hidden size is 32 (fc reads 64 features); this target's is 64")
    ), err
    # weights that do not fit their own config.json: one line, not load_state_dict's traceback
    conf = json.loads((path / "config.json").read_text())
    conf["intermediate_size"] += 1
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=r"model.safetensors does not match .*config.json: size mismatch"):
        _load_without_sums(path)


def _load_without_sums(path: Path) -> DFlashDraftModel:
    manifest = json.loads((path / "checkpoint.json").read_text())
    del manifest["sha256"]  # the edit above changed config.json on purpose
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    return ckpt.load_drafter(path)
