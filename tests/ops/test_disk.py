"""Low disk and a failing sync in `dflashctl status` and the supervisor: the agent's checkpoint facts read
from real folders (ops/far/checkpoints.py), the rule (ops/disk.py), the watch line and JSON key, and one
notification per episode (ops/supervise/episode.py), delivered to a real local webhook."""

from __future__ import annotations

import json
import os
import typing as t
from pathlib import Path

import pytest

from ops.disk import next_needs
from ops.far.checkpoints import checkpoint_facts
from ops.probe import classify
from ops.supervise.episode import LOW_DISK, SYNC_FAILED, Episodes
from ops.wire import CheckpointEntry

NOW = 1_800_000_000.0
MB = 1_000_000


def write_checkpoint(root: Path, step: int, size: int, run_id: str = "r2") -> None:
    """A step-<n> folder as dflash.checkpoint writes it: the files, then the manifest naming their sizes."""
    d = root / f"step-{step}"
    d.mkdir(parents=True)
    files = {"model.safetensors": size - 300, "config.json": 100, "trainer_state.pt": 100, "dflash.py": 100}
    for name, n in files.items():
        (d / name).write_bytes(b"x" * n)
    manifest = {"format": "dflash-checkpoint/1", "step": step, "run_id": run_id, "files": files}
    (d / "checkpoint.json").write_text(json.dumps(manifest))


def test_the_agent_reads_sizes_best_and_the_trainers_record_and_never_raises(tmp_path: Path) -> None:
    root, attempt = tmp_path / "ckpt", tmp_path / "attempt-1"
    attempt.mkdir()
    for step in (100, 200, 300):
        write_checkpoint(root, step, 2 * MB)
    (root / ".tmp-step-400-99").mkdir()  # half-written: not a checkpoint
    (root / "step-400").mkdir()  # no manifest yet
    os.symlink("step-200", root / "best")
    record = {"dir": str(root), "run_id": "r2", "keep": 2, "disk_warn_bytes": None, "skipped": None, "sync": None}
    (attempt / "checkpointing.json").write_text(json.dumps(record))
    f = checkpoint_facts(str(attempt), str(tmp_path / "default"))
    assert f["dir"] == str(root) and f["record"] == record and f["best_step"] == 200 and f["error"] is None
    assert [c["step"] for c in f["checkpoints"]] == [100, 200, 300]
    # the files the manifest names, and the manifest itself
    assert [c["bytes"] for c in f["checkpoints"]] == [
        2 * MB + (root / f"step-{s}" / "checkpoint.json").stat().st_size for s in (100, 200, 300)
    ]
    assert isinstance(f["free"], int) and f["free"] > 0
    # no record (an older trainer): the default folder; one that is not JSON is an error in the facts
    (attempt / "checkpointing.json").write_text("{not json")
    bad = checkpoint_facts(str(attempt), str(root))
    assert bad["record"] is None and "checkpointing.json" in bad["error"] and len(bad["checkpoints"]) == 3
    assert checkpoint_facts(None, str(tmp_path / "nothing"))["checkpoints"] == []


@pytest.mark.parametrize(
    ("steps", "keep", "best", "needs"),
    [
        ([], 2, None, None),  # no checkpoint yet: nothing known
        ([1], 2, None, 2),  # room for one more before keep prunes
        ([1, 2], 2, None, 0),  # the oldest goes first: it frees the room
        ([1, 2], 2, 1, 2),  # ... unless it is best
        ([1, 2, 3], 3, None, 0),
        ([1, 2, 3], 1, 3, 0),  # keep 1: every other one may go, best stays
        ([1, 2, 3], 1, 1, 0),
    ],
)
def test_what_the_next_checkpoint_needs(steps: list[int], keep: int, best: int | None, needs: int | None) -> None:
    cps = [CheckpointEntry(s, 2, "r") for s in steps] + [CheckpointEntry(9, 5, "older")]
    last, got = next_needs(cps, "r", keep, best)
    assert got == needs and last == (2 if steps else None)


def facts(checkpoints: dict[str, t.Any] | None) -> dict[str, t.Any]:
    agent: dict[str, t.Any] = {
        "ok": True,
        "now": NOW,
        "tmux": {"exit_code": 1, "stderr": "no server running on /tmp/tmux-0/dflash"},
        "attempt": None,
        "supervisor": None,
    }
    if checkpoints is not None:
        agent["checkpoints"] = checkpoints
    return {"host": "pve", "session": "dflash", "socket": "dflash", "checked_at": NOW, "agent": agent}


def cps(
    free: int, *, keep: int = 2, steps: t.Sequence[int] = (100, 200), warn: int | None = None, **rec: t.Any
) -> dict[str, t.Any]:
    return {
        "dir": "/runs/dflash/checkpoints",
        "record": {"dir": "/runs/dflash/checkpoints", "run_id": "r", "keep": keep, "disk_warn_bytes": warn, **rec},
        "free": free,
        "checkpoints": [{"step": s, "bytes": 1100 * MB, "run_id": "r"} for s in steps],
        "best_step": None,
        "error": None,
    }


def test_status_says_low_disk_in_the_watch_line_and_the_json_key() -> None:
    st = classify(facts(cps(900 * (1 << 20), keep=3)))
    assert st.disk is not None and st.disk.low
    line = "  watch:     not supervised; low disk: 900.0 MiB free at /runs/dflash/checkpoints, the next checkpoint needs 1.0 GiB"
    assert line in st.lines(), st.lines()
    assert st.to_json()["disk"] == {
        "path": "/runs/dflash/checkpoints",
        "free_bytes": 900 * (1 << 20),
        "checkpoint_bytes": 1100 * MB,
        "next_needs_bytes": 1100 * MB,  # keep 3, two written: nothing is pruned first
        "warn_bytes": 1100 * MB,
        "keep": 3,
        "low": True,
        "skipped_step": None,
    }
    assert any(e.startswith("low disk: ") for e in st.evidence)
    # keep 2: the next one fits by pruning the oldest first; under one checkpoint's size it still warns
    tight = classify(facts(cps(900 * (1 << 20))))
    assert tight.disk is not None and tight.disk.next_needs_bytes == 0 and tight.disk.low
    assert "under the 1.0 GiB of checkpoint.disk_warn_gb (default: one checkpoint)" in "\n".join(tight.lines())
    # disk_warn_gb below what is free, and room for the next one: not low, no flag
    fine = classify(facts(cps(900 * (1 << 20), warn=500 * MB)))
    assert fine.disk is not None and not fine.disk.low and "low disk" not in "\n".join(fine.lines())
    # an agent older than the facts: unknown, not fine
    old = classify(facts(None))
    assert old.disk is None and old.to_json()["disk"] is None and old.to_json()["sync"] is None


def test_status_says_sync_failed_and_the_step_it_was() -> None:
    last = {"step": 300, "ok": False, "at": "2026-12-02T00:10:00Z", "error": "rclone failed (exit 1): no bucket"}
    st = classify(facts(cps(50_000 * MB, sync={"command": "rclone", "last": last, "failures": 2})))
    assert st.sync is not None and st.sync.state == "failed" and st.to_json()["sync"]["failures"] == 2
    assert (
        "  watch:     not supervised; sync failed (2 in a row, step 300): rclone failed (exit 1): no bucket"
        in st.lines()
    )


def test_one_notification_per_episode_kept_across_a_supervisor_restart() -> None:
    low, ok = classify(facts(cps(100 * MB))), classify(facts(cps(50_000 * MB)))
    unknown = classify(facts(None))
    e = Episodes()
    first = e.observe(low, NOW)
    assert [(c.flag, c.began) for c in first] == [(LOW_DISK, True)]
    assert e.observe(low, NOW + 30) == [] and e.observe(unknown, NOW + 60) == []  # an older agent: goes on
    again = Episodes()  # the supervisor restarted: its memory says the episode is open
    again.load(json.loads(json.dumps(e.memory())))
    assert again.observe(low, NOW + 90) == []
    over = again.observe(ok, NOW + 120)
    assert [(c.flag, c.began) for c in over] == [(LOW_DISK, False)] and "room again" in over[0].text
    assert [c.began for c in again.observe(low, NOW + 150)] == [True]  # a new episode is told again
    failed = {"command": "rclone", "last": {"step": 3, "ok": False, "error": "x"}, "failures": 1}
    good = {"command": "rclone", "last": {"step": 4, "ok": True}, "failures": 0}
    s = Episodes()
    assert [c.flag for c in s.observe(classify(facts(cps(50_000 * MB, sync=failed))), NOW)] == [SYNC_FAILED]
    assert [c.began for c in s.observe(classify(facts(cps(50_000 * MB, sync=good))), NOW)] == [False]


def test_the_low_disk_message_reaches_a_real_webhook() -> None:
    pytest.importorskip("apprise")
    from ops.notify import Notifier, flag_message
    from testkit.webhook import Webhook

    st = classify(facts(cps(100 * MB)))
    assert st.disk is not None
    text = st.disk.phrase() or ""
    with Webhook() as hook:
        n = Notifier([hook.url], secrets=[], say=lambda _: None)
        n.send(flag_message(LOW_DISK, "pve", "dflash", text, 3))
        n.close(10)
    (m,) = hook.messages
    assert m["type"] == "warning" and m["title"] == f"dflash pve/dflash: {text}" and "attempt 3" in m["message"]


def test_event_records_are_no_progress_for_status_nor_figures_for_the_dashboard(tmp_path: Path) -> None:
    from ops.far.logs import metrics_facts
    from ops.metrics_table import read_record

    step = {"step": 500, "loss": 1.5, "interval_s": 2.0, "at": "2026-12-02T00:10:00Z"}
    event = {"event": "sync-failed", "step": 500, "error": "x", "at": "2026-12-02T00:10:05Z"}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(step) + "\n" + json.dumps(event) + "\n")
    facts = metrics_facts(str(path))
    assert facts is not None and facts["last"] == step
    row = read_record(json.dumps(event).encode())
    assert (row.step, row.interval, row.values) == (500, 0.0, [])
