"""Low disk and a failing sync through the REAL dflashctl: real sshd, the fake Proxmox container, tmux and
the deployed agent reading the run's checkpoint manifests and checkpointing.json (as dflash train writes
them); restart-on-crash --once --notify tells the episode once, also across its own restarts."""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest

from testkit import retry_until
from testkit.webhook import Webhook
from tests.ops.test_status_e2e import Box, forever

PB = 10**15


def checkpoint(root: Path, step: int, size: int) -> None:
    """A step-<n> folder whose manifest says ``size`` bytes (the agent reads sizes from manifests only)."""
    d = root / f"step-{step}"
    d.mkdir(parents=True)
    files = {"model.safetensors": size, "config.json": 10, "trainer_state.pt": 10}
    (d / "checkpoint.json").write_text(
        json.dumps({"format": "dflash-checkpoint/1", "step": step, "run_id": "r", "files": files})
    )


@pytest.fixture
def box(pve_hosts: t.Any) -> t.Iterator[Box]:
    b = Box(pve_hosts)
    yield b
    b.finish.touch()


def test_status_says_low_disk_and_sync_failed_and_the_supervisor_tells_each_once(box: Box, tmp_path: Path) -> None:
    pytest.importorskip("apprise")
    box.configure(*forever(box), hang_after=600, startup_grace=0)
    box.start()
    retry_until(lambda: box.steps() >= 1, 30)
    root = box.hosts.run_dir / "dflash" / "checkpoints"
    for step in (100, 200):
        checkpoint(root, step, 2 * PB)  # more than any disk here: the next one cannot fit
    last = {"step": 200, "ok": False, "at": "2026-12-02T00:10:00Z", "error": "rclone failed (exit 1): no bucket"}
    record = {"dir": str(root), "run_id": "r", "keep": 3, "disk_warn_bytes": None, "skipped": None,
              "sync": {"command": "rclone", "last": last, "failures": 1}}  # fmt: skip
    (box.attempt() / "checkpointing.json").write_text(json.dumps(record))
    code, st = box.status()
    assert (code, st["state"]) == (0, "running")  # a flag, never a state
    disk = st["disk"]
    assert disk["low"] is True and disk["path"] == str(root) and disk["keep"] == 3
    assert disk["checkpoint_bytes"] == disk["next_needs_bytes"] > disk["free_bytes"] > 0
    assert st["sync"] == {"command": "rclone", "state": "failed", "step": 200, "at": last["at"],
                          "error": last["error"], "failures": 1}  # fmt: skip
    human = box.cli("status").stdout
    watch = next(ln for ln in human.splitlines() if ln.startswith("  watch:"))
    assert "low disk: " in watch and f"free at {root}, the next checkpoint needs " in watch, watch
    assert "sync failed (1 in a row, step 200): rclone failed (exit 1): no bucket" in watch

    state = tmp_path / "state"
    with Webhook() as hook:
        for _ in range(2):  # cron's --once twice: the second remembers the open episodes
            r = box.cli("restart-on-crash", "--once", "--state-dir", str(state), "--notify", hook.url, timeout=120)
            assert r.exit_code == 0, r.output
        retry_until(lambda: len(hook.messages) >= 2, 30)
        # room again (the checkpoints are gone) and a sync that works: the episodes end, nothing is sent
        for step in (100, 200):
            (root / f"step-{step}" / "checkpoint.json").unlink()
        record["sync"] = {"command": "rclone", "last": {"step": 300, "ok": True}, "failures": 0}
        (box.attempt() / "checkpointing.json").write_text(json.dumps(record))
        r = box.cli("restart-on-crash", "--once", "--state-dir", str(state), "--notify", hook.url, timeout=120)
        assert "low-disk over" in r.output and "sync-failed over" in r.output, r.output
    titles = hook.titles()
    assert len(titles) == 2, titles
    assert titles[0].startswith("dflash pve/dflash: low disk: ") and titles[1].startswith(
        "dflash pve/dflash: sync failed"
    )
    assert [m["type"] for m in hook.messages] == ["warning", "warning"]
