"""A disk that fills: the trainer makes room for a checkpoint (prunes what keep lets go, never best) or skips
it with one line and a checkpoint-skipped record, on a real small tmpfs in a mount namespace of its own."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(400)

# $1 the tmpfs (the checkpoints), $2 python, $3 the run dir, $4 the config, $5 checkpoint.keep, $6 run 1's
# max_steps, $7 run 2's, $8 where each run's stderr and exit code and the folder's listing after it go. Run 1
# fills the tmpfs with checkpoints (1.1 MB each); then a filler (another process) leaves 600 KB free, less
# than one checkpoint, and run 2 resumes.
DISK = """
set -e
mount -t tmpfs -o size=4m dflash-test "$1"
set +e
train() { "$2" -m dflash train --config "$4" --set output_dir="$3" --set checkpoint.dir="$1" \\
    --set checkpoint.interval=5 --set checkpoint.keep="$5" --set log_every=5 --set max_steps="$6" 2>"$8/$7.err"
    echo $? >"$8/$7.rc"; ls "$1" >"$8/$7.ls"; }
train "$1" "$2" "$3" "$4" "$5" "$6" "one" "$8"
"$2" -c 'import os, shutil, sys; free = shutil.disk_usage(sys.argv[1]).free
open(os.path.join(sys.argv[1], "filler"), "wb").write(b"x" * max(0, free - 600000))' "$1"
train "$1" "$2" "$3" "$4" "$5" "$7" "two" "$8"
"""


@dataclasses.dataclass
class Ran:
    err: str  # its stderr
    rc: int
    listing: list[str]  # the checkpoint folder after it


def disk_full_runs(tmp_path: Path, keep: int, first: int, second: int) -> tuple[Ran, Ran]:
    """Both runs on a 4 MiB tmpfs in a mount namespace of our own (the mount goes with it)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true: this test needs root and unshare", pytrace=False)
        pytest.skip("needs root and unshare (a tmpfs in a mount namespace of its own)")
    disk, run, out = tmp_path / "disk", tmp_path / "run", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", DISK, "sh", str(disk), sys.executable, str(run),
         str(TINY), str(keep), str(first), str(second), str(out)],
        capture_output=True, text=True, timeout=380, cwd=REPO, env=env, check=True,
    )  # fmt: skip
    runs = [
        Ran(
            (out / f"{n}.err").read_text(),
            int((out / f"{n}.rc").read_text()),
            sorted((out / f"{n}.ls").read_text().split()),
        )
        for n in ("one", "two")
    ]
    return runs[0], runs[1]


def skip_events(run: Path) -> list[dict[str, t.Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"checkpoint-skipped"' in x]


def test_a_checkpoint_that_does_not_fit_prunes_early_only_when_that_makes_room_and_a_lost_final_fails(
    tmp_path: Path,
) -> None:
    one, two = disk_full_runs(tmp_path, keep=2, first=15, second=25)
    assert "Traceback" not in one.err + two.err and one.rc == 0, one.err
    assert "pruned early: the next one needs its room" in one.err, one.err
    assert "skipped" not in one.err
    last = int(re.findall(r"checkpoint step (\d+) written", one.err)[-1])  # two drafters: a step in flight may add one
    assert len(one.listing) == 2 and one.listing[-1] == f"step-{last}", one.listing
    # run 2: pruning the older checkpoint would free 1.1 MB, short of the 2 MB needed: nothing is pruned
    assert "pruned early" not in two.err, two.err
    skips = [ln for ln in two.err.splitlines() if "skipped:" in ln]
    assert len(skips) == 2, two.err
    events = skip_events(tmp_path / "run")
    assert [e["pruned"] for e in events] == [[], []] and events[-1]["step"] == 25, events
    assert all(e["free_bytes"] < e["need_bytes"] for e in events)
    assert re.search(r"\(pruning what keep lets go would free only 1\.\d MiB: nothing pruned\)", skips[0]), skips[0]
    assert f"the last checkpoint stays step-{last}" in skips[1], skips[1]
    # the final checkpoint lost is a failure with its own code and one line, never exit 0
    assert two.rc == 4, two.err
    end = two.err.strip().splitlines()[-1]
    assert end.startswith("dflash: disk full: the run's last checkpoint (step 25) was not written: it needs "), end
    assert end.endswith(f"(No space left on device); the last checkpoint on disk is step-{last}"), end
    # nothing keep protects is deleted, and nothing half-written is left
    assert two.listing == ["filler", *one.listing], two.listing
    facts = json.loads((tmp_path / "run" / "checkpointing.json").read_text())
    assert facts["skipped"]["step"] == 25 and facts["dir"] == str(tmp_path / "disk") and facts["keep"] == 2


def test_keep_1_never_prunes_the_only_checkpoint_for_one_not_yet_written(tmp_path: Path) -> None:
    """The run's newest checkpoint goes only after the next one is written: with keep = 1 and a disk another
    process filled, the trainer used to prune its only checkpoint, skip the new one and exit 0 with an empty
    folder."""
    one, two = disk_full_runs(tmp_path, keep=1, first=10, second=20)
    assert "Traceback" not in one.err + two.err and one.rc == 0, one.err
    assert one.listing == ["step-10"]
    assert "pruned early" not in two.err, two.err
    events = skip_events(tmp_path / "run")
    assert [e["pruned"] for e in events] == [[], []] and events[-1]["step"] == 20, events
    assert two.rc == 4, two.err
    assert two.err.strip().splitlines()[-1] == (
        "dflash: disk full: the run's last checkpoint (step 20) was not written: it needs "
        + re.findall(r"it needs (\S+ MiB and \S+ has \S+ MiB free)", two.err)[-1]
        + " (No space left on device); the last checkpoint on disk is step-10"
    ), two.err
    assert two.listing == ["filler", "step-10"], two.listing
