"""`dflashctl plot` draws the dashboard of a REAL tiny run with one restart.

The real parts of tests/ops/test_demo_flow.py: make-tiny's target and data, `dflashctl deploy` of this
checkout to a local host on this test's tmux socket, the real `dflash train` (2 target + 2 drafter
threads) crashed once by DFLASH_FAULT, then `dflashctl start` again (it resumes from its checkpoint).
The PNG is read back; the plotted series are checked against metrics.jsonl through `--csv`.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
from test_demo_flow import LocalDemo, tiny  # noqa: F401  (tiny: the fixture, built once per test run)

from testkit import forkserver, retry_until
from testkit.hostsfile import dflashctl_argv
from testkit.runkit import REPO, fake_release, reap_runs

pytestmark = pytest.mark.timeout(240)

plt = pytest.importorskip("matplotlib.pyplot")  # the [plot] extra is in [test]: CI has it


def wait_ended(demo: LocalDemo, attempt: int) -> dict[str, t.Any]:
    exit_json = demo.session_dir / f"attempt-{attempt}" / "exit.json"
    retry_until(lambda: exit_json.exists() or None, 150, interval=0.3)
    return json.loads(exit_json.read_text())


def records(demo: LocalDemo, attempt: int) -> list[dict[str, t.Any]]:
    path = demo.session_dir / f"attempt-{attempt}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def demo(tmp_path: Path, tmux_socket: str, tiny: Path) -> t.Iterator[LocalDemo]:  # noqa: F811
    d = LocalDemo(tmp_path, tmux_socket, tiny)
    try:
        yield d
    finally:
        reap_runs(d.run_dir)


def test_plot_of_a_real_run_with_a_restart_draws_what_metrics_jsonl_holds_and_fetches_incrementally(
    demo: LocalDemo,
) -> None:
    demo.configure("max_steps=30", "checkpoint.interval=10", env={"DFLASH_FAULT": "raise-at-step:20"})
    assert demo.cli("deploy").exit_code == 0
    assert demo.cli("start").exit_code == 0
    assert wait_ended(demo, 1)["exit_code"] == 1
    assert demo.cli("start").exit_code == 0  # resumes from step-10; the fault fired once already
    assert wait_ended(demo, 2)["exit_code"] == 0

    out, table, state = demo.root / "dash.png", demo.root / "dash.csv", demo.root / "state"
    r = demo.cli("plot", "--out", str(out), "--csv", str(table), "--state-dir", str(state))
    assert r.exit_code == 0, r.output
    sizes = sum((demo.session_dir / f"attempt-{n}" / "metrics.jsonl").stat().st_size for n in (1, 2))
    assert f"fetched {sizes} new bytes" in r.stdout, r.stdout
    assert "attempt 1: " in r.stdout and "crashed: python-exception" in r.stdout, r.stdout
    assert "attempt 2: " in r.stdout and "succeeded" in r.stdout, r.stdout

    # the PNG: its size, and not blank
    img = plt.imread(str(out))
    assert img.shape[0] == 960 and img.shape[1] == 1120, img.shape
    assert float(img[..., :3].std()) > 0.05

    # what was drawn is what metrics.jsonl holds, attempt by attempt
    rows = list(csv.DictReader(table.open()))
    for n in (1, 2):
        for rec in records(demo, n):
            got = {
                row["series"]: float(row["value"])
                for row in rows
                if row["attempt"] == str(n) and row["step"] == str(rec["step"])
            }
            assert got["loss"] == rec["loss"] and got["tau_tf"] == rec["tau_tf"] and got["lr"] == rec["lr"]
            assert got["ktok_s"] == rec["ktok_s"] and got["queue_depth"] == rec["queue_depth"]
            assert got["drafters_live"] == rec["drafters_live"]
            for k, a in enumerate(rec["acc_per_slot"]):
                assert got[f"acc_slot_{k + 1}"] == a
            assert rec["workers"]
            for w in rec["workers"]:
                assert got[f"busy:{w['name']}"] == w["busy"]
                assert got[f"wait:{w['name']}"] == (
                    w["wait"] if "wait" in w else min(1.0, w["wait_s"] / rec["interval_s"])
                )
            at = datetime.datetime.strptime(rec["at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
            times = {float(row["time"]) for row in rows if row["attempt"] == str(n) and row["step"] == str(rec["step"])}
            assert len(times) == 1 and abs(times.pop() - at.timestamp()) < 1.2  # `at` is whole seconds
    steps1 = [rec["step"] for rec in records(demo, 1)]
    steps2 = [rec["step"] for rec in records(demo, 2)]
    assert steps1[-1] >= 15 and steps2[0] <= steps1[-1]  # attempt 2 went back to its checkpoint: both drawn
    assert len(rows) == len({(r["attempt"], r["step"], r["series"]) for r in rows})

    # incremental: nothing new on the host, nothing fetched; the same picture again
    r2 = demo.cli("plot", "--out", str(demo.root / "again.png"), "--state-dir", str(state))
    assert r2.exit_code == 0 and "fetched 0 new bytes" in r2.stdout, r2.output
    assert (demo.root / "again.png").read_bytes() == out.read_bytes()

    # --since, --time, .svg and .html
    r3 = demo.cli(
        "plot",
        "--out",
        str(demo.root / "d.html"),
        "--since",
        "20",
        "--time",
        "--csv",
        str(demo.root / "since.csv"),
        "--state-dir",
        str(state),
    )
    assert r3.exit_code == 0, r3.output
    assert (demo.root / "d.html").read_text().count("data:image/png;base64,") == 1
    since = list(csv.DictReader((demo.root / "since.csv").open()))
    assert since and min(int(row["step"]) for row in since) >= 20


def test_plot_fetches_only_new_bytes_and_refetches_an_attempt_that_shrank(tmp_path: Path, tmux_socket: str) -> None:
    """The agent's `read` verb and the cache, on hand-written records (no training): appended bytes only,
    a shrunk file from 0, an attempt dir made again by another run from 0, a removed attempt dropped."""
    from ops.hosts import parse_inventory
    from ops.plot import Cache, draw, fetch, lines, load_attempts
    from ops.remote import connect

    wd = tmp_path / "wd"
    fake_release(wd)
    sdir = wd / "runs" / "s"
    (sdir / "attempt-1").mkdir(parents=True)
    hosts = parse_inventory(
        f'[hosts.l]\ntransport = "local"\nworkdir = "{wd}"\nrun_dir = "{wd / "runs"}"\n'
        f'python = "{sys.executable}"\nsession = "s"\ncommand = "true"\n'
        f'tmux_socket = "{tmux_socket}"\n',
        path=None,
        base=tmp_path,
    )
    remote = connect(hosts.get("l"))
    cache = Cache(tmp_path / "state", "l", "s")
    from ops.errors import OpsError
    from ops.plot import plot

    with pytest.raises(OpsError, match=r"nothing to plot: session 'empty' has no attempt under .*/runs/empty$"):
        plot(remote, "empty", out=str(tmp_path / "e.png"), state_dir=tmp_path / "state")

    def line(step: int) -> str:
        return json.dumps({"step": step, "loss": 1.0 / step, "at": "2026-01-01T00:00:00Z"}) + "\n"

    m1 = sdir / "attempt-1" / "metrics.jsonl"
    (sdir / "attempt-1" / "run.json").write_text(json.dumps({"started_at": "a", "pid": 1}))
    m1.write_text(line(1) + line(2) + '{"step": 3, "lo')  # a line being written: not fetched yet
    f = fetch(remote, "s", cache)
    assert f.new_bytes == len(line(1) + line(2))
    assert [r["step"] for r in load_attempts(cache, f.meta)[0].records] == [1, 2]
    with m1.open("a") as fh:
        fh.write('ss": 0.3}\n' + line(4))
    f = fetch(remote, "s", cache)
    assert f.new_bytes == len('{"step": 3, "loss": 0.3}\n' + line(4))
    assert [r["step"] for r in load_attempts(cache, f.meta)[0].records] == [1, 2, 3, 4]
    assert fetch(remote, "s", cache).new_bytes == 0

    m1.write_text(line(7))  # shrank: from 0
    f = fetch(remote, "s", cache)
    assert f.new_bytes == len(line(7)) and [r["step"] for r in load_attempts(cache, f.meta)[0].records] == [7]
    big = line(8) + line(9)
    m1.write_text(line(7) + big)
    (sdir / "attempt-1" / "run.json").write_text(json.dumps({"started_at": "b", "pid": 2}))  # another run
    f = fetch(remote, "s", cache)
    assert f.new_bytes == len(line(7) + big)
    assert [r["step"] for r in load_attempts(cache, f.meta)[0].records] == [7, 8, 9]

    (sdir / "attempt-2").mkdir()
    many = "".join(line(s) for s in range(10, 40))
    (sdir / "attempt-2" / "metrics.jsonl").write_text(many)
    f = fetch(remote, "s", cache, cap=200)  # a few lines per call: the rounds go on until all is here
    assert f.new_bytes == len(many) and f.calls >= len(many) // 200 and sorted(f.meta["attempts"]) == ["1", "2"]
    assert cache.metrics("2").read_text() == many
    import shutil

    shutil.rmtree(sdir / "attempt-1")
    f = fetch(remote, "s", cache)
    assert sorted(f.meta["attempts"]) == ["2"] and not cache.metrics("1").exists()
    remote.close()

    attempts = load_attempts(cache, f.meta)  # .svg too (and a panel with no data says so)
    draw(str(tmp_path / "d.svg"), attempts, lines(attempts), [], title="svg")
    svg = (tmp_path / "d.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_plot_without_matplotlib_says_which_extra_to_install_in_one_line(tmp_path: Path) -> None:
    """A python where `import matplotlib` fails (an import blocker on sys.meta_path): one line, exit 1,
    before anything connects (the host here does not even exist)."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError('No module named ' + repr(name))\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ops.cli import main\n"
        "sys.argv[0] = 'dflashctl'\n"
        "main()\n"
    )
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(
        f'default = "l"\n[hosts.l]\ntransport = "local"\nworkdir = "{tmp_path}/nowhere"\n'
        f'run_dir = "{tmp_path}/nowhere/runs"\npython = "{sys.executable}"\nsession = "s"\ncommand = "true"\n'
    )
    p = subprocess.run(
        [sys.executable, "-c", blocker, "--hosts", str(hosts), "plot", "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip() == "dflashctl: drawing needs matplotlib, which is not installed: pip install 'dflash[plot]'"
    assert not (tmp_path / "x.png").exists()
    bad = subprocess.run(
        [*dflashctl_argv(), "--hosts", str(hosts), "plot", "--out", str(tmp_path / "x.gif")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 1 and bad.stderr.strip().endswith("expected a file ending in .png, .svg, .html"), (
        bad.stderr
    )


def test_plot_over_ssh_and_pct(pve_hosts: t.Any, tmp_path: Path) -> None:
    """The same `read` verb through ssh + `pct exec` (the harness's fake Proxmox host), with the fake
    trainer: a crash by exception, then a second attempt that succeeds."""
    from testkit.runkit import train_command

    pve_hosts.write(command=train_command("--steps", "4", "--interval", "0.01", "--then", "exception:boom"))
    fake_release(pve_hosts.workdir)
    sdir = pve_hosts.run_dir / "dflash"
    assert pve_hosts.cli("start").exit_code == 0
    retry_until(lambda: (sdir / "attempt-1" / "exit.json").exists(), 30)
    pve_hosts.write(command=train_command("--steps", "3", "--interval", "0.01"))
    assert pve_hosts.cli("start").exit_code == 0
    retry_until(lambda: (sdir / "attempt-2" / "exit.json").exists(), 30)

    out, table = tmp_path / "pve.png", tmp_path / "pve.csv"
    r = pve_hosts.cli("plot", "--out", str(out), "--csv", str(table), "--state-dir", str(tmp_path / "state"))
    assert r.exit_code == 0, r.output
    size = sum((sdir / f"attempt-{n}" / "metrics.jsonl").stat().st_size for n in (1, 2))
    assert f"fetched {size} new bytes" in r.stdout and "crashed: python-exception" in r.stdout, r.stdout
    rows = list(csv.DictReader(table.open()))
    for n in (1, 2):
        recs = [json.loads(x) for x in (sdir / f"attempt-{n}" / "metrics.jsonl").read_text().splitlines()]
        assert [
            (int(r["step"]), float(r["value"])) for r in rows if r["attempt"] == str(n) and r["series"] == "loss"
        ] == [(rec["step"], rec["loss"]) for rec in recs]
    assert plt.imread(str(out)).shape[:2] == (960, 1120)
    again = pve_hosts.cli("plot", "--out", str(out), "--state-dir", str(tmp_path / "state"))
    assert again.exit_code == 0 and "fetched 0 new bytes of metrics.jsonl in 1 call(s)" in again.stdout, again.output


# --------------------------------------------------------------------------------------------
# A long run, outputs that cannot be written, wrong-typed fields, flat series


@dataclasses.dataclass
class LocalHost:
    """A local host (the agent of a fake release) with session ``s``: write attempt dirs under ``sdir``."""

    root: Path
    hosts: Path
    sdir: Path

    def attempt(self, n: int, lines: t.Sequence[str | bytes]) -> Path:
        adir = self.sdir / f"attempt-{n}"
        adir.mkdir(parents=True, exist_ok=True)
        (adir / "run.json").write_text(json.dumps({"started_at": "a", "pid": n}))
        path = adir / "metrics.jsonl"
        path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
        return path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real ``dflashctl``, a fork of this worker's fork server (its imports paid once, not per call)."""
        return forkserver.shared("dflashctl").run(["--hosts", str(self.hosts), *args], timeout=120, cwd=REPO)


@pytest.fixture
def local_host(tmp_path: Path, tmux_socket: str) -> LocalHost:
    wd = tmp_path / "wd"
    fake_release(wd)
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(
        f'[hosts.l]\ntransport = "local"\nworkdir = "{wd}"\nrun_dir = "{wd / "runs"}"\n'
        f'python = "{sys.executable}"\nsession = "s"\ncommand = "true"\ntmux_socket = "{tmux_socket}"\n'
    )
    return LocalHost(tmp_path, hosts, wd / "runs" / "s")


def rec(step: int, **fields: t.Any) -> str:
    return json.dumps({"step": step, "at": "2026-01-01T00:00:00Z", **fields})


def test_a_long_run_is_parsed_once_and_drawn_with_at_most_four_points_a_bucket_spikes_kept(
    local_host: LocalHost,
) -> None:
    """20,000 records. Each line drawn holds at most first/lowest/highest/last of each of BUCKETS x
    slices (the old code drew every point), the spike and the dip survive, and so do the first and last
    step. The parsed table is kept: bytes already parsed are never parsed again (the cached raw file,
    altered in place, changes nothing), new lines are, and a table cut short is rebuilt."""
    from ops.plot import BUCKETS

    n = 20_000
    spike, dip = 7_001, 13_333

    def loss(step: int) -> float:
        return 100.0 if step == spike else -5.0 if step == dip else round(2.0 + 0.001 * (step % 7), 6)

    local_host.attempt(1, [rec(s, loss=loss(s), queue_depth=8) for s in range(1, n + 1)])
    state, table = local_host.root / "state", local_host.root / "t.csv"
    args = ("plot", "--out", str(local_host.root / "d.png"), "--csv", str(table), "--state-dir", str(state))
    r = local_host.cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"attempt 1: {n} records, steps 1..{n}, " in r.stdout, r.stdout

    def drawn(series: str) -> list[tuple[int, float]]:
        return [(int(x["step"]), float(x["value"])) for x in csv.DictReader(table.open()) if x["series"] == series]

    got = drawn("loss")
    assert len(got) <= 4 * BUCKETS < n, len(got)
    assert (spike, 100.0) in got and (dip, -5.0) in got
    assert got[0][0] == 1 and got[-1][0] == n and [s for s, _ in got] == sorted(s for s, _ in got)
    assert len(drawn("queue_depth")) <= 4 * BUCKETS

    # the raw cache altered in place (same size): a re-parse would draw 999.0; the table still says 100.0
    cached = state / "plot-cache" / "l" / "s" / "attempt-1" / "metrics.jsonl"
    raw = cached.read_bytes()
    old = b'"loss": 100.0, "queue_depth": 8'
    assert raw.count(old) == 1
    cached.write_bytes(raw.replace(old, old.replace(b"100.0", b"999.0")))
    r = local_host.cli(*args)
    assert r.returncode == 0 and "fetched 0 new bytes" in r.stdout, r.stdout + r.stderr
    assert (spike, 100.0) in drawn("loss") and not any(v == 999.0 for _, v in drawn("loss"))

    # new lines on the host: only they are fetched and parsed
    with (local_host.sdir / "attempt-1" / "metrics.jsonl").open("a") as f:
        f.write(rec(n + 1, loss=50.0) + "\n")
    r = local_host.cli(*args)
    assert r.returncode == 0 and f"fetched {len(rec(n + 1, loss=50.0)) + 1} new bytes" in r.stdout, r.stdout
    got = drawn("loss")
    assert got[-1] == (n + 1, 50.0) and (spike, 100.0) in got

    # a table file cut short (a full disk, a hand): parsed again from the raw cache (now with 999.0)
    step_file = cached.parent / "table" / "step.i8"
    os.truncate(step_file, 8)
    r = local_host.cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"attempt 1: {n + 1} records" in r.stdout and (spike, 999.0) in drawn("loss")


def test_a_metrics_line_with_a_field_of_the_wrong_type_is_skipped_counted_and_said_once(
    local_host: LocalHost,
) -> None:
    """Wrong-typed fields (by class: a number where a list goes, a step no int64 holds, text for a number,
    a worker that is no object, JSON nested 100,000 deep, not JSON at all): the line is skipped, the count
    is said in one line, the other lines are drawn; never a traceback (the old code died on the first)."""
    bad: list[str | bytes] = [
        rec(2, acc_per_slot=0.5),
        json.dumps({"step": 10**400, "loss": 1.0}),
        rec(4, workers=7),
        rec(6, workers=[3]),
        rec(7, workers=[{"name": "drafter-0", "busy": "high"}]),
        rec(8, loss="abc"),
        rec(9, loss=10**400),
        json.dumps({"step": True, "loss": 1.0}),
        json.dumps({"step": -1, "loss": 1.0}),
        json.dumps({"step": 10, "at": 12}),
        json.dumps({"step": 11, "at": "yesterday"}),
        rec(12, acc_per_slot=[0.5, "x"]),
        json.dumps([1, 2]),
        "[" * 100_000 + "]" * 100_000,
        "not json {",
        b'{"step": 13, "loss": "\xff"}',
    ]
    good = [rec(1, loss=1.0, acc_per_slot=[0.5]), rec(3, loss=float("nan")), rec(5, loss=0.5, workers=[])]
    local_host.attempt(1, [good[0], *bad[:2], good[1], *bad[2:], "", good[2]])
    table = local_host.root / "t.csv"
    args = ("plot", "--out", str(local_host.root / "d.png"), "--csv", str(table))
    for _ in range(2):  # the count is kept with the parsed table: the cached run says it too
        r = local_host.cli(*args, "--state-dir", str(local_host.root / "state"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        warning = [line for line in r.stderr.splitlines() if "metrics.jsonl" in line]
        assert len(r.stderr.splitlines()) == 1 and len(warning) == 1, r.stderr
        assert (
            f"l: skipped {len(bad)} line(s) of metrics.jsonl with a field of the wrong type "
            "(the first: attempt 1 line 2: acc_per_slot is a number, expected a list); the rest is drawn"
        ) in warning[0], warning
        assert "attempt 1: 3 records, steps 1..5" in r.stdout, r.stdout
        rows = list(csv.DictReader(table.open()))
        assert {int(x["step"]) for x in rows} == {1, 3, 5}
        assert [x["value"] for x in rows if x["series"] == "loss"] == ["1.0", "nan", "0.5"]


def test_plot_refuses_an_output_it_cannot_write_in_one_line_before_fetching(local_host: LocalHost) -> None:
    """Plot: --out, --csv, --state-dir that cannot be written (no folder, a file where a folder goes,
    a folder where the file goes, a file system that takes no files): one line, exit 1, nothing fetched
    (the old code fetched and drew everything first, then died with a traceback). A disk that fills while
    --csv is written (/dev/full) is one line too."""
    local_host.attempt(1, [rec(s, loss=1.0) for s in range(1, 4)])
    root = local_host.root
    (root / "afile").write_text("x")
    (root / "adir.png").mkdir()
    state = root / "state"
    ok = ("--out", str(root / "ok.png"))
    cases = [
        (("--out", str(root / "nofolder" / "x.png")), "--out", "does not exist"),
        (("--out", str(root / "afile" / "x.png")), "--out", "is not a folder"),
        (("--out", str(root / "adir.png")), "--out", "is a folder"),
        (("--out", "/proc/x.png"), "--out", "cannot write in /proc"),
        ((*ok, "--csv", str(root / "afile" / "x.csv")), "--csv", "is not a folder"),
        ((*ok, "--csv", "/proc/x.csv"), "--csv", "cannot write in /proc"),
    ]
    for args, option, why in cases:
        r = local_host.cli("plot", *args, "--state-dir", str(state))
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"dflashctl: {option} "), (args, r.stderr)
        assert why in r.stderr, (args, r.stderr)
        assert not (state / "plot-cache").exists(), args  # checked before anything was fetched
        assert not (root / "ok.png").exists()
    for bad_state in (root / "afile" / "state", Path("/proc/dflash-state")):
        r = local_host.cli("plot", *ok, "--state-dir", str(bad_state))
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"dflashctl: cannot keep fetched metrics under {bad_state} (--state-dir): ")
        assert not (root / "ok.png").exists()
    r = local_host.cli("plot", *ok, "--csv", "/dev/full", "--state-dir", str(state))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip() == "dflashctl: --csv /dev/full: cannot write it: No space left on device", r.stderr
    assert Path("/dev/full").is_char_device()


def test_a_flat_series_keeps_its_scale_counts_from_0_fractions_0_to_1(tmp_path: Path) -> None:
    """Section 3: queue depth 8 with one dip to 7, a constant 2 live drafters, flat accuracy and busy
    shares: the autoscale made 6.95..8.05, 1.9..2.1, 0.61..0.62 of them (their own noise). Counts start
    at 0, fractions span 0..1; loss stays autoscaled. Read from the figure's axes (Agg)."""
    from ops.plot import Cache, figure, lines, load_attempts

    cache = Cache(tmp_path, "h", "s")
    path = cache.metrics("1")
    path.parent.mkdir(parents=True)
    workers = [{"name": "drafter-0", "busy": 0.97, "wait": 0.02}, {"name": "target-0", "busy": 0.98, "wait": 0.01}]
    path.write_text(
        "".join(
            rec(
                s,
                loss=1.0 + 0.001 * (s % 2),
                acc=0.61 + 0.01 * (s % 2),
                ktok_s=6.0 + 0.1 * (s % 2),
                queue_depth=7 if s == 10 else 8,
                queue_capacity=8,
                drafters_live=2,
                drafters_total=2,
                workers=workers,
            )
            + "\n"
            for s in range(1, 21)
        )
    )
    attempts = load_attempts(cache, {"attempts": {"1": {}}, "current": 1})
    fig = figure(attempts, lines(attempts), [], title="flat")
    limits = {ax.get_title(): ax.get_ylim() for ax in fig.axes}
    assert limits["queue depth / capacity"] == pytest.approx((0.0, 8.4))
    assert limits["live workers"] == pytest.approx((0.0, 2.1))
    assert limits["Ktok/s"][0] == 0.0 and limits["Ktok/s"][1] > 6.1
    assert limits["accuracy (mean, per slot)"] == (0.0, 1.0)
    assert limits["workers: busy (solid), waiting (dashed)"] == (0.0, 1.0)
    assert 0.99 < limits["loss"][0] < limits["loss"][1] < 1.01  # no rule for loss: matplotlib's autoscale
    plt.close(fig)


def test_dflash2_selector_figures_are_read_when_present_and_drawn_in_the_accuracy_panel() -> None:
    from ops import metrics_table, plot

    base = {"step": 3, "loss": 2.0, "acc": 0.5, "tau_tf": 1.5, "acc_per_slot": [0.5]}
    dflash2 = metrics_table.read_record(json.dumps({**base, "sel_acc": 0.7, "top_k_rate": 0.9}).encode())
    assert ("sel_acc", 0.7) in dflash2.values and ("top_k_rate", 0.9) in dflash2.values
    plain = metrics_table.read_record(json.dumps(base).encode())
    assert not {"sel_acc", "top_k_rate"} & {name for name, _ in plain.values}  # optional: DFlash runs lack them
    panel = next(p for p in plot.PANELS if p.title.startswith("accuracy"))
    assert panel.wanted("sel_acc") and panel.wanted("top_k_rate") and not panel.wanted("loss")
