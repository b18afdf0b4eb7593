"""scripts/redraw-docs: the pictures in docs/ come from a demo run of today's code (the full run is the demo
itself, minutes long; here its --from form, on a finished demo's folder)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "redraw-docs"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32


def redraw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def demo_folder(tmp_path: Path) -> Path:
    src = tmp_path / "dflash"
    src.mkdir()
    (src / "eval-after.json").write_text("{}\n")
    os.utime(src / "eval-after.json", (1_000_000, 1_000_000))
    for name in ("dashboard.png", "eval.png"):
        (src / name).write_bytes(PNG + name.encode())
    return src


def test_it_says_how_it_is_used() -> None:
    p = redraw("--help")
    assert p.returncode == 0 and "scripts/demo" in p.stdout and "--from DIR" in p.stdout


def test_it_copies_a_finished_demos_pictures_into_docs(tmp_path: Path) -> None:
    src, docs = demo_folder(tmp_path), tmp_path / "docs"
    docs.mkdir()
    p = redraw("--from", str(src), "--docs", str(docs))
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in docs.iterdir()) == ["dashboard.png", "eval.png"]
    assert (docs / "eval.png").read_bytes() == PNG + b"eval.png"


def test_a_stale_or_foreign_picture_is_refused_and_docs_kept(tmp_path: Path) -> None:
    src, docs = demo_folder(tmp_path), tmp_path / "docs"
    docs.mkdir()
    (docs / "eval.png").write_bytes(b"old")
    os.utime(src / "dashboard.png", (10, 10))  # drawn before the run's last report: an earlier run's
    p = redraw("--from", str(src), "--docs", str(docs))
    assert p.returncode == 1 and "dashboard.png is older than the run" in p.stderr
    assert (docs / "eval.png").read_bytes() == b"old"
    os.utime(src / "dashboard.png")  # now: this run's
    (src / "eval.png").write_text("not a picture")
    p = redraw("--from", str(src), "--docs", str(docs))
    assert p.returncode == 1 and "is not a PNG" in p.stderr
    assert redraw("--from", str(tmp_path / "nowhere")).returncode == 2
