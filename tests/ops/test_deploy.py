"""deploy: content-addressed releases, incremental upload, atomic switch, rollback.

Every flow test runs twice: on a ``transport = "local"`` host and on host ``pve`` (the real sshd
+ the fake Proxmox container 200, whose workdir the test also sees on this machine).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import filecmp
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import typing as t
from pathlib import Path

import pytest

from ops import deploy as deploy_mod
from ops.bundle import MANIFEST_NAME, FileEntry, build_bundle, release_id
from ops.deploy import REMOTE_PROGRAM, Progress, deploy, rollback
from ops.errors import DeployError, MissingDependencies, NotDeployed, OpsError, RunActive
from ops.hosts import Host, parse_inventory
from ops.remote import Remote, connect
from ops.transport import CommandResult
from testkit import retry_until

# --------------------------------------------------------------------------------------------
# Fixtures


def write_source(root: Path, mark: str = "v1") -> Path:
    """A small checkout whose ``ops`` and ``dflash`` packages say which version they are."""
    files = {
        "pyproject.toml": '[project]\nname = "dflash"\n',
        "README.md": "# demo\n",
        "ops/__init__.py": f'MARK = "{mark}"\n',
        "ops/agent.py": "def main():\n    return 0\n",
        "dflash/__init__.py": f'MARK = "{mark}"\n',
        "dflash/train.py": "STEPS = 2\n",
        "dflash/empty_a.py": "",
        "dflash/empty_b.py": "",  # same content twice: sent once
        "configs/tiny-cpu.toml": "steps = 2\n",
        "ops/__pycache__/agent.cpython-311.pyc": "never shipped",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@dataclasses.dataclass
class Target:
    """A host to deploy to, and its workdir as this machine sees it (the fake CT shares the folder)."""

    name: str
    host: Host
    remote: Remote
    workdir: Path

    @property
    def run_dir(self) -> Path:
        return Path(self.host.run_dir)

    def current(self) -> str | None:
        link = self.workdir / "current"
        return os.readlink(link) if link.is_symlink() else None

    def releases(self) -> list[str]:
        root = self.workdir / "releases"
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def inside(self, argv: list[str]) -> CommandResult:
        return self.remote.run(argv, timeout=60)


def local_host(tmp_path: Path, **extra: t.Any) -> Host:
    table = {
        "transport": '"local"',
        "workdir": json.dumps(str(tmp_path / "wd")),
        "run_dir": json.dumps(str(tmp_path / "runs")),
        "python": json.dumps(sys.executable),
        "command": '"true"',
        "keep_releases": "3",
    }
    table.update({k: v if isinstance(v, str) and v.startswith(('"', "[")) else json.dumps(v) for k, v in extra.items()})
    text = "[hosts.local]\n" + "".join(f"{k} = {v}\n" for k, v in table.items())
    return parse_inventory(text, path=None, base=tmp_path).get("local")


@pytest.fixture(autouse=True)
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """dflashctl's state dir (the deploy cache) per test, never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture(params=["local", "pve"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> t.Iterator[Target]:
    if request.param == "local":
        host = local_host(tmp_path)
        workdir = Path(host.workdir)
    else:
        pve_hosts = request.getfixturevalue("pve_hosts")
        pve_hosts.write(keep_releases=3)
        host = pve_hosts.host("pve")
        workdir = pve_hosts.workdir
    remote = connect(host)
    try:
        yield Target(request.param, host, remote, workdir)
    finally:
        remote.close()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_source(tmp_path / "src")


def lines() -> tuple[list[str], t.Callable[[str], None]]:
    out: list[str] = []
    return out, out.append


def manifest_of(release: Path) -> dict[str, t.Any]:
    return json.loads((release / MANIFEST_NAME).read_text())


def verify_release(release: Path, src: Path) -> None:
    """Every file the manifest names is there with its hash and mode, and equals the source; nothing else."""
    doc = manifest_of(release)
    rows = doc["files"]
    assert release_id(FileEntry(*r) for r in rows) == doc["id"]
    for path, sha, size, mode in rows:
        data = (release / path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == size, path
        assert (release / path).stat().st_mode & 0o777 == mode, path
        assert filecmp.cmp(release / path, src / path, shallow=False), path
    on_disk = {
        p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    assert on_disk == {r[0] for r in rows} | {MANIFEST_NAME}


# --------------------------------------------------------------------------------------------
# The flow, on both hosts


def test_first_deploy_creates_a_release_and_current(target: Target, src: Path) -> None:
    out, echo = lines()
    outcome = deploy(target.remote, target.host, source=str(src), echo=echo)
    bundle = build_bundle(src)
    assert outcome.action == "deployed" and outcome.release == bundle.id
    assert target.current() == f"releases/{bundle.id}"  # relative
    assert target.releases() == [bundle.id]
    release = target.workdir / "releases" / bundle.id
    verify_release(release, src)
    assert manifest_of(release)["id"] == bundle.full_id
    assert (
        outcome.files_sent == len({f.sha256 for f in bundle.files}) == len(bundle.files) - 2
    )  # same content: sent once
    assert outcome.summary.startswith(f"deployed {bundle.id} to {target.host.label}: {len(bundle.files)} files added, ")
    assert outcome.summary.endswith(f"; current -> releases/{bundle.id}")

    # A program run from current where the run lives imports the deployed packages.
    current = f"{target.host.workdir}/current"
    r = target.inside(
        [
            "env",
            "-C",
            current,
            f"PYTHONPATH={current}",
            target.host.python,
            "-c",
            "import ops, dflash, dflash.train; print(ops.MARK, dflash.MARK, ops.__file__)",
        ]
    )
    assert r.exit_code == 0, r.err
    mark_ops, mark_dflash, path = r.out.split()
    assert (mark_ops, mark_dflash) == ("v1", "v1")
    assert os.path.realpath(path) == str(release.resolve() / "ops" / "__init__.py")


def test_same_release_again_uploads_nothing(target: Target, src: Path) -> None:
    deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    before = target.releases()
    outcome = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert outcome.action == "unchanged" and outcome.bytes_sent == 0
    assert "nothing uploaded (0 B sent)" in outcome.summary
    assert target.releases() == before


def test_one_file_change_sends_that_file_and_the_manifest(target: Target, src: Path) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    (src / "dflash" / "train.py").write_text("STEPS = 3  # changed\n" + "x = 1\n" * 400)
    bundle = build_bundle(src)
    manifest_size = len(bundle.manifest_bytes(built_at="2026-01-01T00:00:00Z", source=str(bundle.root)))
    file_size = (src / "dflash" / "train.py").stat().st_size

    outcome = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert outcome.action == "deployed" and outcome.release == bundle.id != first.release
    assert outcome.plan is not None and outcome.plan.changed == ("dflash/train.py",) and outcome.files_sent == 1
    # Tar framing: a 512-byte header per member, padding to 512, two end blocks.
    payload = file_size + manifest_size
    assert payload + 2 * 512 + 1024 <= outcome.bytes_sent <= payload + 2 * 512 + 2 * 511 + 1024
    assert "1 file changed" in outcome.summary
    assert target.current() == f"releases/{bundle.id}"
    assert os.readlink(target.workdir / "previous") == f"releases/{first.release}"
    verify_release(target.workdir / "releases" / bundle.id, src)
    assert sorted(target.releases()) == sorted([first.release, bundle.id])


def test_dry_run_lists_the_change_and_changes_nothing(target: Target, src: Path) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    (src / "ops" / "agent.py").write_text("def main():\n    return 1\n")
    (src / "dflash" / "new.py").write_text("NEW = 1\n")
    (src / "configs" / "tiny-cpu.toml").unlink()
    snapshot = sorted(str(p) for p in target.workdir.rglob("*"))

    out, echo = lines()
    outcome = deploy(target.remote, target.host, source=str(src), dry_run=True, echo=echo)
    assert out == ["+ dflash/new.py", "~ ops/agent.py", "- configs/tiny-cpu.toml"]
    assert outcome.action == "dry-run" and outcome.bytes_sent == 0
    assert "nothing was sent or switched" in outcome.summary and "would send 2 files" in outcome.summary
    assert sorted(str(p) for p in target.workdir.rglob("*")) == snapshot
    assert target.current() == f"releases/{first.release}"


def test_rollback_restores_the_previous_release(target: Target, src: Path) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    write_source(src, mark="v2")
    second = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)

    outcome = rollback(target.remote, target.host, echo=lambda s: None)
    assert (
        outcome.summary
        == f"rolled back {target.host.label}: current releases/{second.release} -> releases/{first.release}"
    )
    assert target.current() == f"releases/{first.release}"
    current = f"{target.host.workdir}/current"
    r = target.inside(
        ["env", "-C", current, f"PYTHONPATH={current}", target.host.python, "-c", "import ops; print(ops.MARK)"]
    )
    assert r.out.strip() == "v1"
    # Rolling back again returns to where we were (previous now names the release we left).
    rollback(target.remote, target.host, echo=lambda s: None)
    assert target.current() == f"releases/{second.release}"


def test_deploy_interrupted_mid_upload_leaves_current_alone(
    target: Target, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    (src / "dflash" / "big.bin.txt").write_bytes(os.urandom(6 << 20).hex().encode()[: 6 << 20])
    new_id = build_bundle(src).id
    cut = cut_connection(target)

    class Cutting(Progress):
        def __call__(self, sent: int) -> None:
            if sent > (3 << 20) and not cut.done:  # 256 KiB chunks: the far side is well into the file
                cut()

    monkeypatch.setattr(deploy_mod, "Progress", Cutting)
    with pytest.raises(OpsError) as err:
        deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert cut.done
    assert "the upload was cut after" in str(err.value) and "nothing was switched" in str(err.value)
    assert target.current() == f"releases/{first.release}"
    assert new_id not in target.releases()  # no half release visible as a release
    if target.name == "pve":
        # The far side saw its stdin end mid-tar and removed its own .partial.
        retry_until(lambda: target.releases() == [first.release], 20)
    else:
        # SIGKILL: no chance to clean up; the .partial is never a release and the next deploy sweeps it.
        assert target.releases() == sorted([first.release, f"{new_id}.partial"])
    monkeypatch.undo()

    # The next deploy (a new connection) sweeps any leftover .partial and completes.
    target.remote.close()
    target.remote = connect(target.host)
    outcome = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert outcome.release == new_id and target.current() == f"releases/{new_id}"
    assert sorted(target.releases()) == sorted([first.release, new_id])  # no .partial left either
    verify_release(target.workdir / "releases" / new_id, src)


class _Cut:
    def __init__(self, action: t.Callable[[], None]) -> None:
        self.action = action
        self.done = False

    def __call__(self) -> None:
        self.done = True
        self.action()


def cut_connection(target: Target) -> _Cut:
    """How to kill the upload mid-stream: the sshd process serving our connection (pve), or the
    far-side program itself with SIGKILL (local: no cleanup at all, the worst case)."""
    me = os.getpid()
    if target.name == "pve":
        sshd_pid = int(Path(target.host.identity_file).parent.joinpath("sshd.pid").read_text())

        def kill_session() -> None:
            for child in children(sshd_pid):
                os.kill(child, signal.SIGKILL)

        return _Cut(kill_session)

    def kill_program() -> None:
        for pid in children(me):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"install" in cmd and REMOTE_PROGRAM.encode() in cmd:
                os.kill(pid, signal.SIGKILL)

    return _Cut(kill_program)


def children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == ppid:
                out.append(int(entry))
    return out


def test_old_releases_are_pruned_but_never_current_or_previous(target: Target, src: Path) -> None:
    ids = []
    for n in range(1, 6):  # keep_releases = 3
        write_source(src, mark=f"v{n}")
        ids.append(deploy(target.remote, target.host, source=str(src), echo=lambda s: None).release)
    assert sorted(target.releases()) == sorted(ids[2:])
    rollback(target.remote, target.host, echo=lambda s: None)  # current v4, previous v5
    for n in (6, 7):
        write_source(src, mark=f"v{n}")
        ids.append(deploy(target.remote, target.host, source=str(src), echo=lambda s: None).release)
    # Recency of use: v7 (current), v6 (previous), v4 (rolled back to); v5 and v3 go.
    assert target.current() == f"releases/{ids[6]}"
    assert os.readlink(target.workdir / "previous") == f"releases/{ids[5]}"
    assert sorted(target.releases()) == sorted([ids[3], ids[5], ids[6]])


# --------------------------------------------------------------------------------------------
# The far-side program refuses what could escape the release


def crafted_upload(
    rows: list[FileEntry], members: list[tuple[tarfile.TarInfo, bytes | None]], *, full_id: str | None = None
) -> tuple[str, bytes]:
    """A tar as deploy sends it (manifest first), followed by hand-made members."""
    full = full_id or release_id(rows)
    manifest = json.dumps({"format": 1, "id": full, "files": [r.row() for r in rows]}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_NAME)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return full, buf.getvalue()


def raw_install(target: Target, full: str, data: bytes) -> tuple[CommandResult, str]:
    """The release program's ``install`` verb by hand (no checks first): its result and its answer's message."""
    r = target.remote.run(deploy_mod._program(target.host, "install", {"id": full, "keep": 3}), stdin=data, timeout=60)
    answer = json.loads(r.out.strip().splitlines()[-1])
    assert answer["protocol"] == 1 and answer["verb"] == "install" and answer["ok"] is False, answer
    return r, answer["message"]


def member(
    name: str, data: bytes | None = b"evil\n", *, kind: bytes = tarfile.REGTYPE, link: str = ""
) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o644
    return info, (data if kind == tarfile.REGTYPE else None)


GOOD = FileEntry("ops/agent.py", hashlib.sha256(b"ok\n").hexdigest(), 3, 0o644)

ESCAPES = {
    "dotdot": ([member("../../escaped.txt")], "refused tar member '../../escaped.txt': it would be extracted outside"),
    "dotdot-inner": ([member("ops/../../escaped.txt")], "refused tar member 'ops/../../escaped.txt'"),
    "absolute": ([member("/var/tmp/escaped-abs.txt")], "refused tar member '/var/tmp/escaped-abs.txt': absolute path"),
    "symlink-out": ([member("ops/agent.py", kind=tarfile.SYMTYPE, link="../../../escaped.txt")], "would link to"),
    "symlink-absolute": (
        [member("ops/agent.py", kind=tarfile.SYMTYPE, link="/etc/passwd")],
        "is a link to an absolute path",
    ),
    "hardlink-out": ([member("ops/agent.py", kind=tarfile.LNKTYPE, link="../../escaped.txt")], "would link to"),
    "symlink-inside": ([member("ops/agent.py", kind=tarfile.SYMTYPE, link="other.py")], "links are not accepted"),
    "device": ([member("ops/agent.py", kind=tarfile.CHRTYPE)], "special file"),
    "not-in-manifest": ([member("ops/extra.py")], "refused tar member 'ops/extra.py': not in the manifest"),
    "wrong-content": ([member("ops/agent.py", b"no\n")], "ops/agent.py: received content does not match the manifest"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_tar_members_that_try_to_escape_are_refused(target: Target, src: Path, case: str) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    members, message = ESCAPES[case]
    full, data = crafted_upload([GOOD], members)
    r, why = raw_install(target, full, data)
    assert r.exit_code == 1 and message in why, why
    assert target.current() == f"releases/{first.release}"
    assert target.releases() == [first.release]  # no release, no .partial left behind
    for outside in (
        target.workdir / "escaped.txt",
        target.workdir.parent / "escaped.txt",
        Path("/var/tmp/escaped-abs.txt"),
    ):
        assert not outside.exists()


def test_a_manifest_that_names_a_path_outside_is_refused(target: Target) -> None:
    bad = FileEntry("../outside.py", GOOD.sha256, 3, 0o644)
    full, data = crafted_upload([bad], [member("../outside.py", b"ok\n")])
    r, why = raw_install(target, full, data)
    assert r.exit_code == 1 and "manifest: refused path '../outside.py'" in why
    full, data = crafted_upload([GOOD], [member("ops/agent.py", b"ok\n")], full_id="0" * 64)
    r, why = raw_install(target, "0" * 64, data)
    assert r.exit_code == 1 and "the manifest does not hash to release 0000000000000000" in why
    assert target.current() is None and target.releases() == []


def test_a_truncated_upload_is_refused_and_cleaned_up(target: Target, src: Path) -> None:
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    content = b"y" * 100_000
    entry = FileEntry("ops/agent.py", hashlib.sha256(content).hexdigest(), len(content), 0o644)
    full, data = crafted_upload([entry], [member("ops/agent.py", content)])
    r, why = raw_install(target, full, data[:60_000])
    assert r.exit_code == 1 and "the upload was cut short" in why and "nothing was switched" in why
    assert target.current() == f"releases/{first.release}" and target.releases() == [first.release]


# --------------------------------------------------------------------------------------------
# Refusals and checks (local host: the far-side program is the same everywhere)


@pytest.fixture
def local(tmp_path: Path) -> t.Iterator[Target]:
    host = local_host(tmp_path)
    remote = connect(host)
    yield Target("local", host, remote, Path(host.workdir))
    remote.close()


def write_run(
    target: Target,
    pid: int,
    *,
    started_at: datetime.datetime | None = None,
    ended: bool = False,
    pid_start: int | None = None,
    **extra: int | None,
) -> None:
    """A run record as ops.far.runner writes it (the keys deploy reads)."""
    attempt = target.run_dir / target.host.session / "attempt-1"
    attempt.mkdir(parents=True)
    (target.run_dir / target.host.session / "current").symlink_to("attempt-1")
    started = started_at or datetime.datetime.now(datetime.UTC)
    record = {"pid": pid, "attempt": 1, "started_at": started.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if pid_start is not None:
        record["pid_start"] = pid_start
    record.update(extra)
    (attempt / "run.json").write_text(json.dumps(record))
    if ended:
        (attempt / "exit.json").write_text(json.dumps({"exit_code": 0}))


@pytest.fixture
def live_process() -> t.Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_run_blocks_deploy_unless_forced(
    local: Target, src: Path, live_process: subprocess.Popen[bytes]
) -> None:
    deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    write_source(src, mark="v2")
    second = deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    write_run(local, live_process.pid)
    write_source(src, mark="v3")
    with pytest.raises(
        RunActive,
        match=r"a run is live in session 'dflash' on local \(pid \d+, attempt 1\): refusing to deploy: "
        r"a running Python process keeps the modules it already imported",
    ):
        deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    with pytest.raises(RunActive, match="refusing to roll back"):
        rollback(local.remote, local.host, echo=lambda s: None)
    assert local.current() == f"releases/{second.release}"

    out, echo = lines()
    outcome = deploy(local.remote, local.host, source=str(src), force=True, echo=echo)
    assert outcome.action == "deployed" and local.current() == f"releases/{outcome.release}"
    assert any(line.startswith("warning: a run is live") and "going on because of --force" in line for line in out)


def test_an_ended_run_or_a_reused_pid_does_not_block(
    local: Target, src: Path, live_process: subprocess.Popen[bytes]
) -> None:
    write_run(local, live_process.pid, ended=True)
    assert deploy(local.remote, local.host, source=str(src), echo=lambda s: None).action == "deployed"
    # A record from an hour before the process with that pid began: the pid was reused.
    import shutil

    shutil.rmtree(local.run_dir)
    write_run(local, live_process.pid, started_at=datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1))
    write_source(src, mark="v2")
    assert deploy(local.remote, local.host, source=str(src), echo=lambda s: None).action == "deployed"
    # The runner's pid_start (clock ticks since boot) decides when present: another start = another process.
    from ops.far.runner import proc_stat

    ticks = proc_stat(live_process.pid)[1]
    for pid_start, blocked in ((ticks + 1, False), (ticks, True)):
        shutil.rmtree(local.run_dir)
        write_run(local, live_process.pid, pid_start=pid_start)
        write_source(src, mark=f"v{pid_start}")
        if blocked:
            with pytest.raises(RunActive):
                deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
        else:
            assert deploy(local.remote, local.host, source=str(src), echo=lambda s: None).action == "deployed"


def test_missing_modules_are_named_and_install_is_offered(tmp_path: Path, src: Path) -> None:
    # An interpreter without site-packages: torch, transformers... are all missing there.
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    host = local_host(tmp_path, python=str(bare))
    remote = connect(host)
    with pytest.raises(MissingDependencies) as err:
        deploy(remote, host, source=str(src), echo=lambda s: None)
    assert err.value.modules == ("torch", "transformers", "safetensors", "accelerate", "numpy", "click")
    assert "cannot import torch, transformers, safetensors, accelerate, numpy, click (needed by training)" in str(
        err.value
    )
    assert "dflashctl deploy --install" in str(err.value)
    assert not Path(host.workdir, "current").exists()
    out, echo = lines()
    deploy(remote, host, source=str(src), dry_run=True, install=True, echo=echo)
    assert out[0].startswith("would pip-install into ") and out[0].endswith(
        "torch transformers>=5.17,<6 safetensors>=0.4 accelerate>=1.1 numpy>=1.24 click>=8.1"
    )


def test_a_python_that_is_not_there_or_too_old_is_a_clear_error(tmp_path: Path, src: Path) -> None:
    host = local_host(tmp_path, python="/nonexistent/python3")
    with pytest.raises(DeployError, match=r"local: cannot run '/nonexistent/python3' there .*set hosts.local.python"):
        deploy(connect(host), host, source=str(src), echo=lambda s: None)
    old = Path("/root/.pyenv/versions/3.8.18/bin/python3")
    if old.exists():  # the far-side program itself still runs on 3.8, to say why it cannot go on
        host = local_host(tmp_path, python=str(old))
        with pytest.raises(DeployError, match=r"is Python 3\.8\.18; dflash needs >= 3\.11"):
            deploy(connect(host), host, source=str(src), echo=lambda s: None)


def test_one_deploy_at_a_time(local: Target, src: Path) -> None:
    local.workdir.mkdir(parents=True)
    with open(local.workdir / ".deploy.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DeployError, match=r"another deploy into .* is in progress"):
            deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    assert local.current() is None
    assert deploy(local.remote, local.host, source=str(src), echo=lambda s: None).action == "deployed"


def test_a_kept_copy_edited_in_place_is_detected_and_resent(local: Target, src: Path) -> None:
    first = deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    hotfixed = local.workdir / "releases" / first.release / "ops" / "agent.py"
    hotfixed.write_text("def main():\n    return 42  # hotfix\n")
    out, echo = lines()
    again = deploy(local.remote, local.host, source=str(src), echo=echo)
    assert again.action == "unchanged" and out == [
        f"warning: releases/{first.release} on local differs from its manifest (edited in place?): ops/agent.py"
    ]

    (src / "dflash" / "train.py").write_text("STEPS = 5\n")
    out, echo = lines()
    outcome = deploy(local.remote, local.host, source=str(src), echo=echo)
    assert "1 kept copy was damaged on local (edited in place?); sending it too" in out
    verify_release(local.workdir / "releases" / outcome.release, src)


def test_rollback_with_nothing_to_go_back_to(local: Target, src: Path) -> None:
    with pytest.raises(NotDeployed, match="nothing is deployed"):
        rollback(local.remote, local.host, echo=lambda s: None)
    first = deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    with pytest.raises(
        DeployError, match=f"no previous release to roll back to \\(current is releases/{first.release}\\)"
    ):
        rollback(local.remote, local.host, echo=lambda s: None)


def test_current_that_is_not_a_symlink_is_not_touched(local: Target, src: Path) -> None:
    (local.workdir / "current").mkdir(parents=True)
    (local.workdir / "current" / "mine.txt").write_text("keep")
    with pytest.raises(DeployError, match=r"current is not a symlink; move it away"):
        deploy(local.remote, local.host, source=str(src), echo=lambda s: None)
    assert (local.workdir / "current" / "mine.txt").read_text() == "keep"


def test_progress_is_one_updating_line_on_a_tty_and_silent_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(2_000_000, stream)
        bar(1_000_000)
        bar(2_000_000)
        bar.done()
    assert pipe.getvalue() == ""
    text = tty.getvalue()
    assert "\n" not in text and text.count("\r") == 3
    assert "uploading 2.0 MB of 2.0 MB (100%) at " in text and "/s" in text


# --------------------------------------------------------------------------------------------
# The real CLI


def test_cli_deploy_on_the_local_host(tmp_path: Path, src: Path) -> None:
    host = local_host(tmp_path)
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(
        '[hosts.local]\ntransport = "local"\n'
        f'workdir = {json.dumps(host.workdir)}\nrun_dir = {json.dumps(host.run_dir)}\npython = {json.dumps(sys.executable)}\ncommand = "true"\n'
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "DFLASHCTL_HOSTS"}
        return subprocess.run(
            [sys.executable, "-m", "ops.cli", "--hosts", str(hosts), "deploy", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )

    r = cli("--source", str(src))
    bundle = build_bundle(src)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith(f"deployed {bundle.id} to local: 9 files added, ")
    assert r.stderr == ""  # not a TTY: no progress line
    r = cli("--source", str(src))
    assert (
        r.returncode == 0
        and r.stdout.strip()
        == f"{bundle.id} is already deployed to local: nothing uploaded (0 B sent); current -> releases/{bundle.id}"
    )
    r = cli("--rollback")
    assert r.returncode == 1 and "dflashctl: local: no previous release to roll back to" in r.stderr
    r = cli("--rollback", "--install")
    assert r.returncode == 2 and "--rollback takes no --install" in r.stderr


def test_cli_deploy_dry_run_and_rollback_over_ssh(pve_hosts: t.Any, src: Path) -> None:
    r = pve_hosts.cli("deploy", "--source", str(src))
    first = build_bundle(src).id
    assert r.exit_code == 0, r.stderr
    distinct = {f.sha256: f.size for f in build_bundle(src).files}
    assert (
        r.stdout.splitlines()[0]
        == f"uploading 7 files ({deploy_mod.human_bytes(sum(distinct.values()))}) to pve (ct 200)"
    )
    assert len(r.stdout.splitlines()) == 2 and r.stderr == ""
    assert r.stdout.splitlines()[-1].startswith(f"deployed {first} to pve (ct 200): 9 files added, ")
    assert r.stdout.splitlines()[-1].endswith(f"; current -> releases/{first}")

    (src / "ops" / "agent.py").write_text("def main():\n    return 2\n")
    second = build_bundle(src).id
    r = pve_hosts.cli("deploy", "--source", str(src), "--dry-run")
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == "~ ops/agent.py"
    assert os.readlink(pve_hosts.workdir / "current") == f"releases/{first}"
    r = pve_hosts.cli("deploy", "--source", str(src))
    assert r.exit_code == 0 and "1 file changed" in r.stdout
    r = pve_hosts.cli("deploy", "--rollback")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"rolled back pve (ct 200): current releases/{second} -> releases/{first}"
    assert os.readlink(pve_hosts.workdir / "current") == f"releases/{first}"


@pytest.mark.parametrize("how", ["stopped", "missing"])
def test_deploy_to_a_container_that_is_down_exits_9(pve_hosts: t.Any, src: Path, how: str) -> None:
    if how == "stopped":
        pve_hosts.pve.stop(200)
    else:
        pve_hosts.pve.destroy(200)
    r = pve_hosts.cli("deploy", "--source", str(src))
    assert r.exit_code == 9, r.stderr
    expected = (
        "container 200 is stopped (pct: container '200' not running!)"
        if how == "stopped"
        else "container 200 does not exist on this host"
    )
    assert expected in r.stderr
    assert not (pve_hosts.workdir / "current").exists()


def test_after_deploying_this_checkout_the_agent_runs_from_current(pve_hosts: t.Any) -> None:
    before = pve_hosts.cli("status", "--json")
    assert json.loads(before.stdout)["mode"] == "fallback", before.stdout  # nothing deployed: raw tmux only
    r = pve_hosts.cli("deploy")
    assert r.exit_code == 0, r.stderr
    summary = r.stdout.splitlines()[-1]
    assert summary.startswith("deployed ") and " to pve (ct 200): " in summary
    release = summary.split()[1]
    assert os.readlink(pve_hosts.workdir / "current") == f"releases/{release}"
    assert (pve_hosts.workdir / "current" / "ops" / "far" / "agent.py").is_file()
    after = pve_hosts.cli("status", "--json")
    assert json.loads(after.stdout)["mode"] == "agent", after.stdout  # the agent now runs from current


def test_the_plan_compares_paths_and_sends_each_missing_content_once(tmp_path: Path) -> None:
    bundle = build_bundle(write_source(tmp_path / "src"))
    by = bundle.by_path()
    current = [r.row() for r in bundle.files if r.path != "dflash/train.py"]  # train.py: added
    current.append(["old/gone.py", "0" * 64, 1, 0o644])  # removed
    current = [[p, "1" * 64 if p == "ops/agent.py" else h, s, m] for p, h, s, m in current]  # agent.py: changed
    current = [[p, h, s, 0o755 if p == "README.md" else m] for p, h, s, m in current]  # README: mode only
    plan = deploy_mod.make_plan(
        bundle, current, "cafe", have_hashes=[r[1] for r in current] + [by["dflash/train.py"].sha256]
    )
    assert plan.added == ("dflash/train.py",)
    assert plan.changed == ("README.md", "ops/agent.py")
    assert plan.removed == ("old/gone.py",)
    # train.py's content is kept in some release, README's too: only agent.py travels.
    assert [f.path for f in plan.send] == ["ops/agent.py"] and plan.send_bytes == by["ops/agent.py"].size
    assert plan.describe() == "1 file added, 2 changed, 1 removed"
    fresh = deploy_mod.make_plan(bundle, None, None, have_hashes=[])
    assert len(fresh.send) == len({f.sha256 for f in bundle.files}) and fresh.describe() == "9 files added"
    assert deploy_mod.make_plan(bundle, [r.row() for r in bundle.files], bundle.id, []).describe() == "no file changed"


def test_cli_names_missing_modules_and_a_missing_python_in_the_container(pve_hosts: t.Any, src: Path) -> None:
    bare = pve_hosts.pve.fs / "bare-python"  # visible inside the container at the same path
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    pve_hosts.write(python=str(bare))
    r = pve_hosts.cli("deploy", "--source", str(src))
    assert r.exit_code == 1
    assert (
        "pve (ct 200): " in r.stderr
        and "cannot import torch, transformers, safetensors, accelerate, numpy, click" in r.stderr
    )
    assert "dflashctl deploy --install" in r.stderr
    pve_hosts.write(python="/nonexistent/python3")
    r = pve_hosts.cli("deploy", "--source", str(src))
    assert r.exit_code == 1 and "pve (ct 200): cannot run '/nonexistent/python3' there" in r.stderr, r.stderr
    assert "uploading" not in r.stdout  # nothing was uploaded: the far side never started
    assert not (pve_hosts.workdir / "current").exists()


def test_a_command_that_outlived_its_runner_still_blocks(
    local: Target, src: Path, live_process: subprocess.Popen[bytes]
) -> None:
    # The runner was SIGKILLed (its pid is gone) but its keeper and the training command go on: still a live run.
    from ops.far.runner import proc_stat

    gone = subprocess.Popen(["true"])
    gone.wait()
    ticks = proc_stat(live_process.pid)[1]
    write_run(local, gone.pid, keeper_pid=gone.pid, child_pid=live_process.pid, child_start=ticks)
    with pytest.raises(RunActive, match="a run is live"):
        deploy(local.remote, local.host, source=str(src), echo=lambda s: None)


# --------------------------------------------------------------------------------------------
# One round trip: the operator's cache plans the upload, the far side checks it first


class Calls:
    """Every far-side call a Remote makes: (verb, bytes of stdin sent)."""

    def __init__(self, remote: Remote) -> None:
        self.seen: list[tuple[str, int | None]] = []
        run = remote.run

        def counting(argv: t.Sequence[str], **kw: t.Any) -> CommandResult:
            stdin = kw.get("stdin")
            res = run(argv, **kw)
            verb = next((a for a in argv if a in ("inspect", "install", "rollback")), "other")
            sent = stdin.sent if hasattr(stdin, "sent") else None if stdin is None else len(stdin)
            self.seen.append((verb, sent))
            return res

        remote.run = counting  # type: ignore[method-assign]

    def take(self) -> list[tuple[str, int | None]]:
        seen, self.seen = self.seen, []
        return seen


def test_a_deploy_is_one_far_side_call_when_the_cache_is_right(target: Target, src: Path) -> None:
    calls = Calls(target.remote)
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert first.action == "deployed" and [v for v, _ in calls.take()] == ["install"]
    verify_release(target.workdir / "releases" / first.release, src)

    same = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert same.action == "unchanged" and same.bytes_sent == 0
    assert calls.take() == [("install", None)]  # not even the manifest travels

    (src / "dflash" / "train.py").write_text("STEPS = 3\n")
    out, echo = lines()
    one = deploy(target.remote, target.host, source=str(src), echo=echo)
    assert [v for v, _ in calls.take()] == ["install"]
    assert one.summary.startswith(f"deployed {one.release} to {target.host.label}: 1 file changed, ")
    assert out[0] == f"uploading 1 file (10 B) to {target.host.label}"
    verify_release(target.workdir / "releases" / one.release, src)


def test_a_stale_cache_costs_a_second_call_and_nothing_else(target: Target, src: Path, tmp_path: Path) -> None:
    """Another machine deployed meanwhile (or the workdir was wiped): the far side answers with its
    facts before reading the upload, and the deploy goes on from them, as a two-call deploy did."""
    first = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    (src / "dflash" / "train.py").write_text("STEPS = 3\n")
    other = deploy(target.remote, target.host, source=str(src), echo=lambda s: None, state_dir=tmp_path / "elsewhere")
    (src / "dflash" / "train.py").write_text("STEPS = 4\n")
    calls = Calls(target.remote)
    out, echo = lines()
    third = deploy(target.remote, target.host, source=str(src), echo=echo)  # its cache still says `first`
    assert [v for v, _ in calls.take()] == ["install", "install"]
    assert third.previous == other.release and third.summary.startswith(
        f"deployed {third.release} to {target.host.label}: 1 file changed, "
    )
    assert out == [f"uploading 1 file (10 B) to {target.host.label}"]  # said once, for the upload that counted
    assert sorted(target.releases()) == sorted([first.release, other.release, third.release])

    for name in ("current", "previous"):
        (target.workdir / name).unlink()
    import shutil

    shutil.rmtree(target.workdir / "releases")
    again = deploy(target.remote, target.host, source=str(src), echo=lambda s: None)
    assert [v for v, _ in calls.take()] == ["install", "install"]
    assert again.summary.startswith(
        f"deployed {third.release} to {target.host.label}: {len(build_bundle(src).files)} files added, "
    )
    verify_release(target.workdir / "releases" / third.release, src)
