"""[checkpoint] sync: the template's words, one sync at a time, a failing and a hanging command (killed by
its process group), and the real `dflash train` with a sync that hangs while training goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash.checkpoint.sync import CheckpointSync, SyncResult, command
from dflash.config import ConfigError, SyncError, load_config, parse_template
from testkit import retry_until

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(240)


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose (its parent, the shell of the test, reaps it later)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


# --------------------------------------------------------------------------------------------
# The template


def test_the_template_is_split_once_and_each_word_stays_one_argv_item() -> None:
    words = parse_template("rclone copy {dir} 'remote:bucket/my run/step-{step}' --log-level INFO")
    folder = Path("/runs/a b; rm -rf ~/{step}")
    assert command(words, folder=folder, step=7) == [
        "rclone",
        "copy",
        "/runs/a b; rm -rf ~/{step}",  # one pass: the path's own "{step}" is not a field
        "remote:bucket/my run/step-7",
        "--log-level",
        "INFO",
    ]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "empty command"),
        ("rclone copy 'unclosed {dir}", "cannot split"),
        ("rclone copy /data remote:x", "names no {dir}"),
        ("rclone copy {dir} remote:{run}", "unknown field {run}"),
    ],
)
def test_a_template_that_cannot_run_is_refused(text: str, said: str) -> None:
    with pytest.raises(SyncError, match=said.replace("{", r"\{").replace("}", r"\}")):
        parse_template(text)


def test_the_config_refuses_a_bad_sync_in_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["checkpoint.sync=rclone copy /data remote:x"])
    assert str(e.value).startswith("checkpoint.sync: names no {dir}") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^checkpoint.sync_timeout: must be > 0, got 0$"):
        load_config(TINY, ["checkpoint.sync=cp -r {dir} /x", "checkpoint.sync_timeout=0"])
    cfg = load_config(TINY, ["checkpoint.sync=cp -r {dir} /x", "checkpoint.disk_warn_gb=2.5"])
    assert cfg.checkpoint.sync == "cp -r {dir} /x" and cfg.checkpoint.disk_warn_gb == 2.5


# --------------------------------------------------------------------------------------------
# Real commands


class Ends:
    def __init__(self) -> None:
        self.results: list[SyncResult] = []
        self.cond = threading.Condition()

    def __call__(self, r: SyncResult) -> None:
        with self.cond:
            self.results.append(r)
            self.cond.notify_all()


def test_a_copy_a_failure_and_a_hanging_sync_killed_with_its_process_group(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    (src / "step-5").mkdir(parents=True)
    (src / "step-5" / "model.safetensors").write_bytes(b"w" * 100)
    ends = Ends()
    copy = script(tmp_path / "copy.sh", 'mkdir -p "$2" && cp -r "$1"/. "$2"/ && echo copied\n')
    sync = CheckpointSync(
        parse_template(f"{copy} {{dir}} {tmp_path / 'dest'}"),
        src,
        timeout=60,
        log_path=tmp_path / "sync.log",
        on_end=ends,
    )
    sync.request(5, "checkpoint")
    assert sync.close(60)
    assert [(r.ok, r.step, r.exit_code) for r in ends.results] == [(True, 5, 0)]
    assert (tmp_path / "dest" / "step-5" / "model.safetensors").read_bytes() == b"w" * 100

    fail = script(tmp_path / "fail.sh", 'echo "starting"; echo "ERROR: bucket $1 not found" >&2; exit 3\n')
    ends = Ends()
    sync = CheckpointSync(
        parse_template(f"{fail} {{dir}} s3:secret-key"), src, timeout=60, log_path=tmp_path / "sync.log", on_end=ends
    )
    sync.request(5, "best")
    assert sync.close(60)
    (r,) = ends.results
    assert (r.ok, r.exit_code, r.timed_out, r.why) == (False, 3, False, "best")
    assert r.error == f"fail.sh failed (exit 3): ERROR: bucket {src} not found"  # the name only, no arguments
    assert r.record()["event"] == "sync-failed"

    # a hang: the script and the sleep it started (one process group) are both killed at the timeout
    hang = script(tmp_path / "hang.sh", 'echo $$ > "$2"; sleep 600 & echo $! >> "$2"; wait\n')
    ends = Ends()
    pids = tmp_path / "pids"
    sync = CheckpointSync(parse_template(f"{hang} {{dir}} {pids}"), src, timeout=1, log_path=None, on_end=ends)
    sync.request(5, "checkpoint")
    assert sync.close(120)
    (r,) = ends.results
    assert (r.ok, r.timed_out, r.exit_code) == (False, True, None)
    assert r.error == "hang.sh ran past checkpoint.sync_timeout (1 s): killed"
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 2
    retry_until(lambda: not any(alive(p) for p in started), 30)  # a killed process may take a moment to go


def test_one_sync_at_a_time_and_the_newest_request_goes_next(tmp_path: Path) -> None:
    """Requests while a sync runs: none starts beside it; the newest one runs when it ends."""
    gate, log = tmp_path / "gate", tmp_path / "log"
    body = (
        f'[ -e {tmp_path}/running ] && echo overlap >> {log}; touch {tmp_path}/running; echo "start $2" >> {log}\n'
        f"while [ ! -e {gate} ]; do sleep 0.05; done\n"
        f'rm {tmp_path}/running; echo "end $2" >> {log}\n'
    )
    slow = script(tmp_path / "slow.sh", body)
    ends = Ends()
    sync = CheckpointSync(parse_template(f"{slow} {{dir}} {{step}}"), tmp_path, timeout=120, log_path=None, on_end=ends)
    sync.request(1, "checkpoint")
    for _ in range(200):
        if log.exists():
            break
        threading.Event().wait(0.05)
    sync.request(2, "checkpoint")
    sync.request(3, "best")
    gate.touch()
    assert sync.close(120)
    assert log.read_text().split("\n")[:-1] == ["start 1", "end 1", "start 3", "end 3"]
    assert [(r.step, r.why, r.ok) for r in ends.results] == [(1, "checkpoint", True), (3, "best", True)]


# --------------------------------------------------------------------------------------------
# Through dflash train


def test_dflash_train_syncs_each_checkpoint_and_a_hanging_sync_never_holds_the_steps(tmp_path: Path) -> None:
    """The first sync (step 5 or so) hangs until it sees training go past its step (so the steps were not held),
    then on; it is killed at sync_timeout, the next checkpoint's sync copies, the run exits 0."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    body = (
        'if [ ! -e "$3.hung" ]; then echo $$ > "$3.hung"\n'
        "  while :; do\n"
        f'    {sys.executable} -c \'import json,sys; sys.exit(0 if any(json.loads(l).get("step",0) > int(sys.argv[2]) and "event" '
        f'not in json.loads(l) for l in open(sys.argv[1]) if l.strip()) else 1)\' {metrics} "$4" && break\n'
        "    sleep 0.2\n"
        '  done; echo "saw progress" >> "$3.hung"; sleep 600; fi\n'
        'mkdir -p "$2" && cp -r "$1"/. "$2"/\n'
    )
    sync = script(tmp_path / "sync.sh", body)
    proc = subprocess.run(
        [sys.executable, "-m", "dflash", "train", "--config", str(TINY),
         "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
         "--set", "max_steps=10", "--set", "checkpoint.interval=5", "--set", "log_every=1",
         "--set", f"checkpoint.sync={sync} {{dir}} {tmp_path / 'dest'} {tmp_path / 'marker'} {{step}}",
         "--set", "checkpoint.sync_timeout=30"],
        cwd=REPO, capture_output=True, text=True, timeout=200,
        env={**{k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    hung = (tmp_path / "marker.hung").read_text().split("\n")
    assert hung[1] == "saw progress", hung  # training went past step 5 while its sync hung
    retry_until(lambda: not alive(int(hung[0])), 30)
    events = [json.loads(x) for x in metrics.read_text().splitlines() if '"event"' in x]
    first = events[0]["step"]  # the barrier at or just after step 5
    assert 5 <= first < 10
    assert [(e["event"], e["step"], e["timed_out"]) for e in events] == [
        ("sync-failed", first, True),
        ("synced", 10, False),
    ]
    assert f"sync of step {first} (checkpoint) failed: sync.sh ran past checkpoint.sync_timeout (30 s): killed" in (
        proc.stderr
    )
    assert (tmp_path / "dest" / "step-10" / "checkpoint.json").is_file()
    facts = json.loads((tmp_path / "run" / "checkpointing.json").read_text())
    assert facts["sync"]["failures"] == 0 and facts["sync"]["last"]["step"] == 10 and facts["keep"] == 2


KEY_ID = "AKIAHOSTILE0EXAMPLE7"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLE"  # 38 characters: "/" and "+" are percent-encoded in a URL


def test_a_failing_syncs_last_line_never_carries_the_commands_own_words(tmp_path: Path) -> None:
    """rclone repeats an inline remote's credentials when it fails: in the one line of `sync-failed` (metrics.jsonl,
    checkpointing.json, train.log) the command's own words are redacted in every form, before the line is cut,
    so a secret straddling the cut leaves no head either."""
    remote = f":s3,access_key_id={KEY_ID},secret_access_key={SECRET_KEY}:bucket/run"
    pad = "x" * (200 - len("ERROR : ") - 20)  # the secret key starts 20 characters before the 200th
    body = (
        'echo "copying $2"\n'
        f'echo "ERROR : {pad}{SECRET_KEY} quoted=$(printf %s "$3" | {sys.executable} -c '
        '\'import sys, urllib.parse; print(urllib.parse.quote(sys.stdin.read(), safe=""))\')"\n'
        'echo "Failed to copy: directory not found: $2 in $3" >&2\n'
        "exit 1\n"
    )
    sync = script(tmp_path / "rclone", body)
    proc = subprocess.run(
        [sys.executable, "-m", "dflash", "train", "--config", str(TINY),
         "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
         "--set", "max_steps=5", "--set", "checkpoint.interval=5", "--set", "log_every=1",
         "--set", f"checkpoint.sync={sync} copy {{dir}} {remote}", "--set", "checkpoint.sync_timeout=30"],
        cwd=REPO, capture_output=True, text=True, timeout=200,
        env={**{k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert SECRET_KEY in (tmp_path / "run" / "sync.log").read_text(), "the tool printed it (its own log keeps it)"
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    (failed,) = [e for e in events if e["event"] == "sync-failed"]
    assert failed["error"].startswith("rclone failed (exit 1): Failed to copy: directory not found: ")
    assert failed["error"].endswith(" in [redacted]"), failed["error"]
    facts = (tmp_path / "run" / "checkpointing.json").read_text()
    said = "\n".join([proc.stderr, json.dumps(events), facts])
    for word in (KEY_ID, SECRET_KEY[:6], "secret_access_key=", remote[:20]):
        assert word not in said, word

    # the line before the cut: the secret straddles the 200th character, percent-encoded after it
    (tmp_path / "run2").mkdir()
    quiet = script(tmp_path / "rclone2", "\n".join(body.splitlines()[:2]) + "\nexit 1\n")
    from dflash.checkpoint.sync import command_secrets

    ends = Ends()
    job = CheckpointSync(
        (str(quiet), "copy", "{dir}", remote), tmp_path / "ckpt", timeout=60, log_path=tmp_path / "s.log", on_end=ends
    )
    job.request(5, "checkpoint")
    assert job.close(60)
    (r,) = ends.results
    assert r.error is not None and len(r.error) <= 200 + len("rclone2 failed (exit 1): ")
    assert SECRET_KEY[:6] not in r.error and "wJalrX" not in r.error, r.error
    assert SECRET_KEY in command_secrets((str(quiet), "copy", "{dir}", remote))
