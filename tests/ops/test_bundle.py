"""The bundle: what deploy ships, its manifest and release id, and the streamed tar."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from ops.bundle import MANIFEST_NAME, TarStream, build_bundle, canonical_manifest, release_id, source_root
from ops.errors import BundleError


def make_source(root: Path) -> Path:
    """A small checkout: the packages, configs, and everything a bundle must leave out."""
    files = {
        "pyproject.toml": '[project]\nname = "dflash"\n',
        "README.md": "# demo\n",
        "ops/__init__.py": "",
        "ops/agent.py": "VERSION = 1\n",
        "dflash/__init__.py": "",
        "dflash/train.py": "def main():\n    return 0\n",
        "configs/tiny-cpu.toml": "steps = 2\n",
        # never shipped:
        "ops/__pycache__/agent.cpython-311.pyc": "x",
        "dflash/stale.pyc": "x",
        "dflash/checkpoints/step-1/model.safetensors": "x",
        "dflash/weights.pt": "x",
        ".venv/lib/site.py": "x",
        ".git/HEAD": "ref",
        ".dflash/runs/log": "x",
        "tests/test_x.py": "x",
        "scripts/demo": "x",
        "dflash.egg-info/PKG-INFO": "x",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "ops" / "run.sh").write_text("#!/bin/sh\n")
    (root / "ops" / "run.sh").chmod(0o755)
    return root


def test_bundle_holds_the_source_and_nothing_else(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    (src / "ops" / "link.py").symlink_to(src / "ops" / "agent.py")
    bundle = build_bundle(src)
    paths = [f.path for f in bundle.files]
    assert paths == sorted(paths)
    assert paths == [
        "README.md",
        "configs/tiny-cpu.toml",
        "dflash/__init__.py",
        "dflash/train.py",
        "ops/__init__.py",
        "ops/agent.py",
        "ops/run.sh",
        "pyproject.toml",
    ]
    entry = bundle.by_path()
    assert entry["ops/run.sh"].mode == 0o755
    assert entry["ops/agent.py"].mode == 0o644
    assert entry["ops/agent.py"].size == len("VERSION = 1\n")
    assert bundle.id == bundle.full_id[:16] and len(bundle.full_id) == 64


def test_release_id_depends_on_content_and_exec_bit_only(tmp_path: Path) -> None:
    a = build_bundle(make_source(tmp_path / "a"))
    b_root = make_source(tmp_path / "b")
    os.utime(b_root / "ops" / "agent.py", (1, 1))
    b = build_bundle(b_root)
    assert a.full_id == b.full_id  # another folder, other mtimes: the same release

    (b_root / "ops" / "agent.py").write_text("VERSION = 2\n")
    assert build_bundle(b_root).full_id != a.full_id
    (b_root / "ops" / "agent.py").write_text("VERSION = 1\n")
    (b_root / "ops" / "agent.py").chmod(0o755)
    assert build_bundle(b_root).full_id != a.full_id


def test_manifest_is_canonical_and_hashes_to_the_id(tmp_path: Path) -> None:
    bundle = build_bundle(make_source(tmp_path / "src"))
    doc = json.loads(bundle.manifest_bytes(source="x"))
    assert doc["id"] == bundle.full_id and doc["format"] == 1 and doc["source"] == "x"
    assert [r[0] for r in doc["files"]] == [f.path for f in bundle.files]
    import hashlib

    assert hashlib.sha256(canonical_manifest(bundle.files)).hexdigest() == release_id(bundle.files) == bundle.full_id
    assert canonical_manifest(reversed(bundle.files)) == canonical_manifest(bundle.files)


def test_not_a_checkout_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="no pyproject.toml"):
        build_bundle(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    with pytest.raises(BundleError, match="no ops/ package"):
        build_bundle(tmp_path)


def test_default_bundle_is_this_checkout() -> None:
    root = source_root()
    assert root is not None and (root / "ops" / "deploy.py").is_file()
    bundle = build_bundle()
    paths = {f.path for f in bundle.files}
    assert {"ops/deploy.py", "ops/bundle.py", "pyproject.toml"} <= paths
    assert not any("__pycache__" in p or p.endswith(".pyc") or p.startswith("tests/") for p in paths)


def test_tar_stream_is_a_tar_of_the_manifest_then_the_files(tmp_path: Path) -> None:
    bundle = build_bundle(make_source(tmp_path / "src"))
    send = [f for f in bundle.files if f.path in ("ops/agent.py", "ops/run.sh")]
    stream = TarStream(bundle, send, bundle.manifest_bytes())
    data = b"".join(stream)
    assert stream.error is None
    assert len(data) == stream.sent == stream.expected_size
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        members = []
        for m in tar:
            members.append((m.name, m.mode, tar.extractfile(m).read()))
    assert [m[0] for m in members] == [MANIFEST_NAME, "ops/agent.py", "ops/run.sh"]
    assert json.loads(members[0][2])["id"] == bundle.full_id
    assert members[1][2] == b"VERSION = 1\n" and members[2][1] == 0o755


def test_tar_stream_stops_short_when_a_file_changes_after_hashing(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    bundle = build_bundle(src)
    (src / "ops" / "agent.py").write_text("VERSION = 2\n")  # same size, other content
    stream = TarStream(bundle, [bundle.by_path()["ops/agent.py"]], bundle.manifest_bytes())
    data = b"".join(stream)  # never raises into the transport's writer
    assert stream.error is not None and "ops/agent.py: changed while deploying" in stream.error
    assert len(data) < stream.expected_size

    shutil.rmtree(src / "dflash")
    stream = TarStream(bundle, [bundle.by_path()["dflash/train.py"]], bundle.manifest_bytes())
    b"".join(stream)
    assert stream.error is not None and "cannot read" in stream.error


def test_the_checkout_bundle_ships_the_far_side_and_no_test_scaffolding() -> None:
    """The GPU box gets the agent, the runner and their modules, never testkit/ (a fake pct, a fake Proxmox)."""
    paths = {f.path for f in build_bundle().files}
    assert {"ops/far/agent.py", "ops/far/runner.py", "ops/far/tmux.py", "ops/far/protocol.py"} <= paths
    assert [p for p in paths if p.startswith(("testkit/", "tests/", "bench/")) or "/testing/" in p] == []


def test_the_wheel_leaves_the_test_scaffolding_out(tmp_path: Path) -> None:
    """A real wheel, built from a copy of the checkout: dflash and ops (the far side too), not testkit."""
    root = source_root()
    assert root is not None
    src = tmp_path / "src"
    for name in ("dflash", "ops", "testkit", "pyproject.toml", "README.md"):
        if not (root / name).exists():
            continue
        if (root / name).is_dir():
            shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(root / name, src / name)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = tmp_path.glob("dflash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"dflash", "ops"}
    assert [n for n in names if "/testing/" in n or "pct.py" in n] == []
    assert "ops/far/agent.py" in names
