"""Issue 14 part 2: `dflashctl plot` draws the dashboard of a REAL tiny run with one restart.

The real parts of tests/ops/test_demo_flow.py: make-tiny's target and data, `dflashctl deploy` of this
checkout to a local host on this test's tmux socket, the real `dflash train` (2 target + 2 drafter
threads) crashed once by DFLASH_FAULT, then `dflashctl start` again (it resumes from its checkpoint).
The PNG is read back; the plotted series are checked against metrics.jsonl through `--csv`.
"""

from __future__ import annotations

import csv
import datetime
import json
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
from test_demo_flow import LocalDemo, tiny  # noqa: F401  (tiny: the module-scoped fixture)

from testkit import retry_until
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
    from ops.plot import Cache, draw, fetch, load_attempts, points
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
    draw(str(tmp_path / "d.svg"), attempts, points(attempts), [], title="svg")
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
