"""The far side's modules in-process: the release program's verbs on a tmp workdir, the id
rule bundle.py shares with it, the by-value program, the one liveness verdict and the one lock.
The same program end to end (local and the fake Proxmox container) is tests/ops/test_deploy.py."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest

from ops import deploy as deploy_mod
from ops.bundle import TarStream, build_bundle, release_id
from ops.far import lock, procfs, records, release
from ops.far.atomic import switch_link


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> t.Iterator[None]:
    """release.main installs its own SIGTERM/SIGHUP/SIGINT handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def source(root: Path, mark: str) -> Path:
    for rel, text in {
        "pyproject.toml": "[project]\n",
        "ops/__init__.py": f"MARK = {mark!r}\n",
        "dflash/__init__.py": "",
        "dflash/same.py": "",
        "dflash/train.py": f"# {mark}\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def verb(name: str, req: dict[str, t.Any], stdin: t.IO[bytes] | None = None) -> dict[str, t.Any]:
    out = io.StringIO()
    code = release.main([name, json.dumps(req)], stdin=stdin or io.BytesIO(), stdout=out)
    answer = json.loads(out.getvalue())
    assert code == (0 if answer["ok"] else 1) and answer["protocol"] == 1 and answer["verb"] == name
    return t.cast(dict[str, t.Any], answer)


def upload(src: Path, have: t.Iterable[str] = ()) -> tuple[str, io.BytesIO]:
    bundle = build_bundle(src)
    stream = TarStream(
        bundle,
        [f for f in {f.sha256: f for f in bundle.files}.values() if f.sha256 not in set(have)],
        bundle.manifest_bytes(),
    )
    return bundle.full_id, io.BytesIO(b"".join(stream))


class Unreadable(io.RawIOBase):
    def read(self, n: int = -1) -> bytes:
        raise AssertionError("the upload must not be read")


def test_bundle_and_the_far_side_share_one_id_rule(tmp_path: Path) -> None:
    bundle = build_bundle(source(tmp_path / "src", "v1"))
    rows = [f.row() for f in bundle.files]
    assert release_id(bundle.files) == release.release_id(rows) == release.release_id(list(reversed(rows)))
    assert bundle.full_id == release.release_id(rows)


def test_install_inspect_rollback_in_process(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    base = {"workdir": str(wd), "run_dir": str(tmp_path / "runs"), "session": "s", "modules": ["json", "no_such_mod"]}
    empty = verb("inspect", base)
    assert empty["current"] is None and empty["missing"] == ["no_such_mod"] and empty["run"] == {"state": "none"}
    assert empty["state"] == release.state_digest(None, [])

    v1, tar = upload(source(tmp_path / "a", "v1"))
    a = verb("install", {**base, "id": v1, "keep": 3}, tar)
    assert a["ok"] and a["switched"] and a["from"] is None and os.readlink(wd / "current") == f"releases/{v1[:16]}"
    assert a["after"]["current"] == v1
    v2, tar = upload(source(tmp_path / "b", "v2"), have=a["after"]["hashes"])
    b = verb("install", {**base, "id": v2, "keep": 3}, tar)
    assert b["from"] == v1[:16] and (wd / "releases" / v2[:16] / "ops" / "__init__.py").read_text() == "MARK = 'v2'\n"
    seen = verb("inspect", base)
    assert seen["current"]["id"] == v2 and seen["previous"] == v1[:16] and seen["damaged"] == []

    back = verb("rollback", {**base, "keep": 3})
    assert back == {"ok": True, "protocol": 1, "verb": "rollback", "from": v2[:16], "to": v1[:16]}
    (wd / "releases" / v2[:16] / "dflash" / "train.py").write_text("edited in place\n")
    refused = verb("rollback", {**base, "keep": 3})
    assert refused["error"] == "refused" and "differs from its manifest (dflash/train.py)" in refused["message"]


def test_one_trip_install_checks_the_host_before_it_reads_the_upload(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    base = {
        "workdir": str(wd),
        "run_dir": str(tmp_path / "runs"),
        "session": "s",
        "modules": ["json"],
        "keep": 3,
        "min_python": [3, 8],
    }
    v1, tar = upload(source(tmp_path / "a", "v1"))
    first = verb("install", {**base, "id": v1, "expect": release.state_digest(None, [])}, tar)
    assert first["ok"] and first["facts"]["current"] is None
    after = first["after"]

    stale = verb("install", {**base, "id": v1, "expect": release.state_digest(None, [])}, Unreadable())
    assert stale["error"] == "recheck" and stale["facts"]["current"]["id"] == v1

    same = verb(
        "install", {**base, "id": v1, "expect": release.state_digest(after["current"], after["hashes"])}, Unreadable()
    )
    assert same["ok"] and same["switched"] is False

    old = verb("install", {**base, "id": v1, "expect": same["facts"]["state"], "min_python": [99]}, Unreadable())
    assert old["error"] == "recheck" and old["message"] == "python is too old"


def test_the_program_travels_by_value_and_ignores_any_ops_on_the_far_side(tmp_path: Path) -> None:
    """The -c program carries its modules: a bare host has none, and an `ops` found there is not used."""
    decoy = tmp_path / "decoy"
    (decoy / "ops" / "far").mkdir(parents=True)
    (decoy / "ops" / "__init__.py").write_text("raise SystemExit('the decoy ops was imported')\n")
    req = json.dumps({"workdir": str(tmp_path / "wd"), "run_dir": str(tmp_path), "session": "s", "modules": []})
    r = subprocess.run(
        [sys.executable, "-c", deploy_mod.REMOTE_PROGRAM, "inspect", req],
        cwd=decoy,
        env={**os.environ, "PYTHONPATH": str(decoy)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    assert len(deploy_mod.REMOTE_PROGRAM) < 64_000  # one argv item: well under the kernel's 128 KiB per argument


def test_one_liveness_verdict(tmp_path: Path) -> None:
    st = procfs.proc_stat(os.getpid())
    assert st is not None
    ticks = st[1]
    assert procfs.alive(os.getpid(), ticks) and not procfs.alive(os.getpid(), ticks + 1)  # a reused pid is not ours
    began = procfs.start_epoch(ticks)
    assert began is not None
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began))
    assert procfs.alive(os.getpid(), None, iso)  # no ticks recorded: the start time decides
    long_before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began - 3600))
    assert not procfs.alive(os.getpid(), None, long_before)  # born an hour after the record: another process
    zombie = subprocess.Popen(["true"])
    try:
        assert procfs_retry(lambda: (procfs.proc_stat(zombie.pid) or ("?",))[0] == "Z")
        assert not procfs.alive(zombie.pid, None)
    finally:
        zombie.wait()
    assert procfs.process_facts(zombie.pid, None) == {"pid": zombie.pid, "alive": False, "state": None, "same": None}

    # deploy's "is a run live": the records of a session whose command is this process
    sdir = tmp_path / "runs" / "s"
    (sdir / "attempt-1").mkdir(parents=True)
    switch_link(str(sdir), records.CURRENT, "attempt-1", tmp_prefix=".")
    (sdir / "attempt-1" / records.RUN_JSON).write_text(
        json.dumps({"attempt": 1, "child_pid": os.getpid(), "child_start": ticks})
    )
    assert release.run_state(str(tmp_path / "runs"), "s")["state"] == "alive"
    assert records.current_attempt(str(sdir)) == str(sdir / "attempt-1")


def procfs_retry(check: t.Callable[[], bool]) -> bool:
    from testkit import retry_until

    retry_until(check, 10)
    return True


def test_one_lock_with_a_bounded_wait(tmp_path: Path) -> None:
    path = str(tmp_path / ".lock")
    with lock.Lock(path, holder="start by pid 1"):
        with pytest.raises(lock.Busy) as busy:
            with lock.Lock(path, wait=0.2):
                pass
        assert busy.value.holder == "start by pid 1"
    with lock.Lock(path, wait=0):  # free again once the holder closed it
        pass


def test_what_travels_by_value_runs_on_an_old_python_to_say_it_is_too_old(tmp_path: Path) -> None:
    """The release program must run far enough on an old interpreter (3.7 up) to report it."""
    import ast

    from ops.far import HERE

    for name in (*deploy_mod.RELEASE_DEPS, "release"):
        ast.parse((Path(HERE) / f"{name}.py").read_text(), filename=f"{name}.py", feature_version=(3, 7))
    req = json.dumps({"workdir": str(tmp_path / "wd"), "run_dir": str(tmp_path), "session": "s", "modules": []})
    for version in ("3.7.16", "3.8.18"):  # pyenv builds this machine kind keeps (CI's image too)
        old = Path(f"/root/.pyenv/versions/{version}/bin/python")
        if old.exists():
            r = subprocess.run(
                [str(old), "-I", "-S", "-c", deploy_mod.REMOTE_PROGRAM, "inspect", req],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["python"] == [int(x) for x in version.split(".")]
