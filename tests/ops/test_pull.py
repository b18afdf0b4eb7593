"""`dflashctl pull`: real checkpoints written by dflash.checkpoint on a fake Proxmox container, pulled over a
real sshd + pct exec (and a local host) by the real CLI and by ops.pull in-process (small chunks, so a file
takes many `fetch` calls): identical files, resume, refetch, refusals in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.best import set_best
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config
from ops import pull
from ops.remote import connect
from testkit import PveHosts
from testkit.forkserver import dflashctl_argv
from testkit.plugin import require
from testkit.runkit import bench_box, fake_release

pytestmark = pytest.mark.timeout(300)

RUN_ID = "20261202T000000Z-0123abcd"
LABEL = "pve (ct 200)"  # how the host is named in its lines


def write_checkpoints(root: Path) -> None:
    """Steps 2, 4 and 6 of one run as the trainer writes them, best -> step-4 (as held-out eval sets it)."""
    cfg = draft_config_for(tiny_target_config(), num_layers=1, block_size=4, mask_token_id=511)
    for step in (2, 4, 6):
        torch.manual_seed(step)  # other weights per step: a file of one step is never another's
        drafter = DFlashDraftModel(cfg)
        ckpt.save_checkpoint(
            root, step=step, drafter=drafter, trainer_state={"data_position": step}, keep=None, run_id=RUN_ID
        )
    set_best(root, {"step": 4, "tau": 2.5, "run_id": RUN_ID})


@pytest.fixture(scope="module")
def box() -> t.Iterator[PveHosts]:
    """One sshd, one fake Proxmox host with container 200 and a local host, each with the agent deployed
    (ops/ as a release) and the same checkpoints; session `bad` has one whose weights rotted on the box
    (same size, other bytes), session `empty` none; `dflash/export` is an export folder."""
    require("sshd")
    require("namespaces")
    with bench_box("dflash-pull-unused") as hosts:
        local_workdir = Path(str(hosts.local_table["workdir"]))
        local_runs = Path(str(hosts.local_table["run_dir"]))
        for workdir in (hosts.workdir, local_workdir):
            fake_release(workdir)
        ours = hosts.run_dir / "dflash" / "checkpoints"
        write_checkpoints(ours)
        shutil.copytree(ours, local_runs / "dflash" / "checkpoints", symlinks=True)
        bad = hosts.run_dir / "bad" / "checkpoints" / "step-2"
        shutil.copytree(ours / "step-2", bad)
        weights = bytearray((bad / "model.safetensors").read_bytes())
        weights[-1] ^= 0xFF
        (bad / "model.safetensors").write_bytes(bytes(weights))
        (hosts.run_dir / "empty").mkdir()
        export = hosts.run_dir / "dflash" / "export"
        export.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(ours / "step-6" / name, export / name)
        (export / "README.md").write_text("# a drafter\n")
        yield hosts


def same_files(dest: Path, src: Path) -> None:
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in src.iterdir())
    for p in src.iterdir():
        assert (dest / p.name).read_bytes() == p.read_bytes(), p.name


def test_pull_over_ssh_and_pct_copies_the_latest_checkpoint_whole_and_a_second_pull_fetches_nothing(
    box: PveHosts, tmp_path: Path
) -> None:
    dest = tmp_path / "pulled" / "step-6"  # named like a checkpoint: dflash's own reader judges the copy
    r = box.cli("pull", "--json", str(dest), timeout=120)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["kind"], out["step"], out["run_id"], out["best"]) == ("checkpoint", 6, RUN_ID, 4)
    assert [f["action"] for f in out["files"]] == ["fetched"] * 5
    assert out["files"][-1]["name"] == "checkpoint.json"  # last: a DEST that has it is whole
    assert r.stderr == ""  # --json: no progress line
    src = box.run_dir / "dflash" / "checkpoints" / "step-6"
    same_files(dest, src)
    assert ckpt.latest_complete(dest.parent) == dest  # sizes and every sha256 as dflash checks them

    again = box.cli("pull", str(dest), timeout=120)
    assert again.exit_code == 0, again.output
    assert again.stderr == ""  # not a terminal: no progress line
    assert again.stdout.splitlines() == [
        f"pulled step-6 (run {RUN_ID}) from pve:{src} to {dest}",
        "  5 files, 0.2 MiB (5 kept); 0.0 MiB fetched in 0 call(s); every file's sha256 checked",
    ]


def test_best_and_step_pick_their_checkpoint_and_a_missing_one_is_one_line_naming_what_there_is(
    box: PveHosts, tmp_path: Path
) -> None:
    root = box.run_dir / "dflash" / "checkpoints"
    r = box.cli("pull", "--best", "--json", str(tmp_path / "best"), timeout=120)
    assert r.exit_code == 0 and json.loads(r.stdout)["step"] == 4, r.output
    same_files(tmp_path / "best", root / "step-4")
    r = box.cli("pull", "--step", "2", "--json", str(tmp_path / "two"), timeout=120)
    assert r.exit_code == 0 and json.loads(r.stdout)["step"] == 2, r.output
    same_files(tmp_path / "two", root / "step-2")

    r = box.cli("pull", "--step", "9", str(tmp_path / "nine"), timeout=120)
    assert r.exit_code == 1
    assert r.stderr.strip() == (
        f"dflashctl: {LABEL}: no checkpoint step-9; there are step-2, step-4, step-6 under {root} (best: step-4)"
    )
    r = box.cli("pull", "--session", "empty", str(tmp_path / "none"), timeout=120)
    assert r.exit_code == 1
    assert r.stderr.strip() == (
        f"dflashctl: {LABEL}: no checkpoint under {box.run_dir / 'empty' / 'checkpoints'} (the run has written none yet)"
    )
    r = box.cli("pull", "--session", "bad", "--best", str(tmp_path / "nobest"), timeout=120)
    assert r.exit_code == 1
    assert "no best checkpoint" in r.stderr and "there are step-2" in r.stderr and "Traceback" not in r.stderr
    r = box.cli("pull", "--best", "--step", "2", str(tmp_path / "both"), timeout=60)
    assert r.exit_code == 2 and "--best and --step: choose one" in r.stderr
    assert not (tmp_path / "nine").exists() or not any((tmp_path / "nine").iterdir())


def test_a_dest_with_files_of_its_own_is_refused_and_left_as_it_was(box: PveHosts, tmp_path: Path) -> None:
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    (dest / "config.json").write_text("{}\n")  # a name of ours, but with a stranger beside it nothing moves
    r = box.cli("pull", str(dest), timeout=120)
    assert r.exit_code == 1
    assert r.stderr.strip() == (
        f"dflashctl: {dest} holds files that are not part of step-6 (notes.txt): pull into an empty or new folder"
    )
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "notes.txt"]
    assert (dest / "config.json").read_text() == "{}\n"


def test_a_file_rotten_on_the_box_is_fetched_twice_then_one_line_names_it(box: PveHosts, tmp_path: Path) -> None:
    dest = tmp_path / "bad"
    r = box.cli("pull", "--session", "bad", str(dest), timeout=120)
    assert r.exit_code == 1
    bad = box.run_dir / "bad" / "checkpoints" / "step-2"
    assert r.stderr.strip() == (
        "dflashctl: model.safetensors: its sha256 after the transfer is not the one the box lists, twice "
        f"(fetched again from the start): the file on the box may be corrupted ({bad}/model.safetensors)"
    )
    assert not (dest / "model.safetensors").exists() and not (dest / "model.safetensors.part").exists()
    assert not (dest / "checkpoint.json").exists()  # never there unless every file is right


@pytest.fixture
def small_chunks(box: PveHosts, monkeypatch: pytest.MonkeyPatch) -> t.Iterator[t.Any]:
    """ops.pull in-process over the box's ssh + pct, 48 KiB a call: the weights (162 KiB) take 4 calls, so a
    cut falls between two of them (each call is an ssh exec of the agent in the container: ~0.2 s of CPU)."""
    monkeypatch.setenv("HOME", str(box.home))
    monkeypatch.setattr(pull, "CHUNK", 48 << 10)
    remote = connect(box.host("pve"))
    try:
        yield remote
    finally:
        remote.close()


def test_a_pull_cut_mid_transfer_goes_on_from_the_part_file(small_chunks: t.Any, box: PveHosts, tmp_path: Path) -> None:
    dest = tmp_path / "cut"
    src = box.run_dir / "dflash" / "checkpoints" / "step-6"
    seen = 0

    def cut(n: int) -> None:
        nonlocal seen
        seen += n
        if (dest / "model.safetensors.part").exists() and (dest / "model.safetensors.part").stat().st_size > 40_000:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the weights

    with pytest.raises(KeyboardInterrupt):
        pull.pull(small_chunks, None, dest, progress=cut)
    part = (dest / "model.safetensors.part").stat().st_size
    assert 40_000 < part < (src / "model.safetensors").stat().st_size
    assert not (dest / "checkpoint.json").exists()

    r = pull.pull(small_chunks, None, dest)
    assert r.actions["model.safetensors"] == "resumed"
    assert r.actions["config.json"] == r.actions["dflash.py"] == "kept"  # done before the cut
    left = sum((src / n).stat().st_size for n in ("model.safetensors", "trainer_state.pt", "checkpoint.json")) - part
    assert r.fetched_bytes == left
    same_files(dest, src)


def test_a_part_file_with_wrong_bytes_is_fetched_again_from_the_start(
    small_chunks: t.Any, box: PveHosts, tmp_path: Path
) -> None:
    dest = tmp_path / "wrong"
    dest.mkdir()
    (dest / "model.safetensors.part").write_bytes(b"\0" * 50_000)  # a piece, but not of this file
    r = pull.pull(small_chunks, None, dest, pick={"step": 4})
    assert r.actions["model.safetensors"] == "refetched"
    same_files(dest, box.run_dir / "dflash" / "checkpoints" / "step-4")


def test_an_export_folder_on_the_box_is_pulled_with_the_sums_the_agent_computed(box: PveHosts, tmp_path: Path) -> None:
    r = box.cli("pull", "--export", "export", "--json", str(tmp_path / "exp"), timeout=120)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["kind"] == "export" and out["step"] is None
    same_files(tmp_path / "exp", box.run_dir / "dflash" / "export")
    r = box.cli("pull", "--export", "/nowhere", str(tmp_path / "none"), timeout=120)
    assert r.exit_code == 1
    assert (
        r.stderr.strip()
        == f"dflashctl: {LABEL}: no export folder /nowhere on the box (made by `dflash export CKPT /nowhere`)"
    )


def test_a_local_host_pulls_through_the_same_agent_verbs(box: PveHosts, tmp_path: Path) -> None:
    r = box.cli("--host", "local", "pull", "--best", "--json", str(tmp_path / "local"), timeout=120)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 4
    same_files(tmp_path / "local", Path(str(box.local_table["run_dir"])) / "dflash" / "checkpoints" / "step-4")


def _source(**change: t.Any) -> dict[str, t.Any]:
    files = [{"name": "model.safetensors", "size": 3 << 20, "sha256": "0" * 64}]
    return {"kind": "checkpoint", "dir": "/x/step-6", "step": 6, "run_id": RUN_ID, "best": 4, "files": files, **change}


def test_the_progress_line_rewrites_itself_and_never_passes_the_total() -> None:
    import io

    stream = io.StringIO()
    line = pull.ProgressLine(stream)
    line.start(pull.Source.parse(_source()))
    for n in (1 << 20, 1 << 20, 3 << 20, -(3 << 20)):  # a refetch takes its bytes back
        line.update(n)
    line.end()
    assert stream.getvalue().split("\r")[1:] == [
        "pull step-6: 0.0 MiB of 3.0 MiB (0%)",
        "pull step-6: 1.0 MiB of 3.0 MiB (33%)",
        "pull step-6: 2.0 MiB of 3.0 MiB (66%)",
        "pull step-6: 3.0 MiB of 3.0 MiB (100%)",
        "pull step-6: 0.0 MiB of 3.0 MiB (0%)\n",
    ]


@pytest.mark.parametrize(
    "files", [[{"name": "../../etc/passwd", "size": 1, "sha256": "0" * 64}], [{"name": "a", "size": -1, "sha256": "x"}]]
)
def test_an_answer_naming_a_path_or_a_bad_size_is_refused_before_anything_is_written(files: list[t.Any]) -> None:
    from ops import errors

    with pytest.raises(errors.AgentError, match="answer names a file this dflashctl refuses"):
        pull.Source.parse(_source(files=files))


def test_the_box_orders_checkpoints_as_dflash_resumes_them_and_marks_only_finished_ones(
    box: PveHosts, tmp_path: Path
) -> None:
    from ops.far import checkpoints

    root = tmp_path / "checkpoints"
    shutil.copytree(box.run_dir / "dflash" / "checkpoints", root, symlinks=True)
    older = root / "step-8"  # a higher step of an OLDER run: not the latest
    shutil.copytree(root / "step-2", older)
    manifest = json.loads((older / "checkpoint.json").read_text())
    (older / "checkpoint.json").write_text(json.dumps({**manifest, "step": 8, "run_id": "20261101T000000Z-00000000"}))
    (root / "step-9").mkdir()  # half-written: no checkpoint.json
    other = root / "step-10"  # a manifest of another file list (no weights, no trainer state): not ours
    shutil.copytree(root / "step-2", other)
    (other / "checkpoint.json").write_text(
        json.dumps({**manifest, "step": 10, "files": {"config.json": manifest["files"]["config.json"]}, "sha256": {}})
    )
    assert [f.path for f in checkpoints.complete(str(root))] == [str(p) for p in ckpt.resume_order(root)]
    assert checkpoints.choose(str(root), "latest").step == 6
    assert [m["step"] for m in checkpoints.marks(str(root))] == [2, 4, 6, 8, 10]  # plot marks any finished write
    (older / "model.safetensors").write_bytes(b"cut")  # a size off: not complete, for dflash nor for pull
    assert (
        [f.step for f in checkpoints.complete(str(root))]
        == [6, 4, 2]
        == [int(p.name.removeprefix("step-")) for p in ckpt.resume_order(root)]
    )


def test_an_agent_without_the_pull_verbs_says_redeploy(box: PveHosts, tmp_path: Path) -> None:
    """A release of a dflashctl from before `pull` (the verbs taken out of this agent): its `usage` answer."""
    workdir = Path(str(box.local_table["workdir"]))
    agent = fake_release(workdir, "r0000000000000002") / "ops" / "far" / "agent.py"
    text = agent.read_text()
    verbs = '    "checkpoint": functools.partial(_pulling, checkpoints.listing),\n    "fetch": functools.partial(_pulling, checkpoints.chunk),\n'
    assert verbs in text
    agent.write_text(text.replace(verbs, ""))
    try:
        r = box.cli("--host", "local", "pull", str(tmp_path / "old"), timeout=120)
    finally:
        fake_release(workdir)  # current -> the release with the verbs again
    assert (r.exit_code, r.stdout) == (1, "")
    assert r.stderr == "dflashctl: local: the deployed agent cannot pull checkpoints: run `dflashctl deploy`\n"
    assert not (tmp_path / "old").exists()


def test_a_stopped_container_is_container_down_not_a_pull_error(box: PveHosts, tmp_path: Path) -> None:
    box.pve.stop(200)
    try:
        r = box.cli("pull", str(tmp_path / "down"), timeout=120)
    finally:
        box.pve.start(200)
    assert r.exit_code == 9, r.output  # ContainerDown's code (ops/exit_codes.py), as for every command
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "down").exists()


def test_on_a_terminal_the_progress_line_runs_on_stderr(box: PveHosts, tmp_path: Path) -> None:
    import os
    import pty
    import subprocess

    from testkit.hostsfile import dflashctl_argv

    master, slave = pty.openpty()
    try:
        p = subprocess.run(
            [
                *dflashctl_argv(),
                "--hosts",
                str(box.path),
                "--host",
                "local",
                "pull",
                "--step",
                "2",
                str(tmp_path / "tty"),
            ],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=box.env(),
            timeout=120,
            check=False,
        )
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert p.returncode == 0
    rows = seen.decode().replace("\r\n", "\n").split("\r")
    assert rows[1] == "pull step-2: 0.0 MiB of 0.2 MiB (0%)" and rows[-1] == "pull step-2: 0.2 MiB of 0.2 MiB (100%)\n"
    assert p.stdout.decode().startswith("pulled step-2 ")


# --------------------------------------------------------------------------------------------
# Only what the pull made is its to write


def test_a_link_planted_as_a_part_file_is_refused_and_what_it_points_to_is_untouched(
    box: PveHosts, tmp_path: Path
) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "precious.txt"
    dest.mkdir()
    outside.write_text("the user's own file\n")
    (dest / "config.json.part").symlink_to(outside)
    r = box.cli("pull", str(dest), timeout=120)
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines() == [
        f"dflashctl: {dest}/config.json.part is a link: pull writes plain files only and never through a link; "
        "pull into an empty or new folder"
    ]
    assert outside.read_text() == "the user's own file\n"
    assert sorted(p.name for p in dest.iterdir()) == ["config.json.part"] and (dest / "config.json.part").is_symlink()


def test_a_link_planted_while_pulling_is_never_followed(small_chunks: t.Any, tmp_path: Path) -> None:
    """A .part is created with O_EXCL|O_NOFOLLOW: a link put there after DEST was checked is refused too."""
    dest, outside = tmp_path / "race", tmp_path / "precious.txt"
    outside.write_text("the user's own file\n")

    def plant(n: int) -> None:  # while the weights come, before the trainer state's turn
        link = dest / "trainer_state.pt.part"
        if (dest / "model.safetensors.part").exists() and not link.is_symlink():
            link.symlink_to(outside)

    with pytest.raises(pull.PullError, match=r"trainer_state.pt.part is a link: pull writes plain files only"):
        pull.pull(small_chunks, None, dest, progress=plant)
    assert outside.read_text() == "the user's own file\n"


def test_an_export_is_never_pulled_over_another(box: PveHosts, tmp_path: Path) -> None:
    other = box.run_dir / "dflash" / "export-b"
    shutil.copytree(box.run_dir / "dflash" / "export", other, dirs_exist_ok=True)
    (other / "config.json").write_text('{"another": "export"}\n')
    dest = tmp_path / "exp"
    r = box.cli("pull", "--export", "export", str(dest), timeout=120)
    assert r.exit_code == 0, r.output
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    r = box.cli("pull", "--export", "export-b", str(dest), timeout=120)
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines() == [
        f"dflashctl: {dest} holds another export (its config.json is not export {other}'s): pull into another folder"
    ]
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before, "nothing of the second moved in"


def test_a_pull_bigger_than_dests_free_space_is_refused_before_a_byte_moves(box: PveHosts, tmp_path: Path) -> None:
    """DEST on a 128 KiB tmpfs (a private mount namespace): the 0.2 MiB checkpoint is refused, both figures named."""
    require("namespaces")
    small = tmp_path / "small"
    small.mkdir()
    mount = 'mount -t tmpfs -o size=128k tmpfs "$0" && exec "$@" && true'
    argv = ["unshare", "-m", "sh", "-c", mount, str(small), *dflashctl_argv(), "--hosts", str(box.path)]
    p = subprocess.run(
        [*argv, "pull", str(small / "step-6")], capture_output=True, text=True, timeout=120, env=box.env(), cwd=box.root
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.splitlines() == [
        f"dflashctl: {small} has 0.1 MiB free, and step-6 needs 0.2 MiB more (5 files, 0.2 MiB in all): "
        "nothing was fetched; free some space or pull elsewhere"
    ]
