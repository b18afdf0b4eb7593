"""`dflash eval --plot FILE [--compare BEFORE.json]` on a real tiny target and drafter."""

from __future__ import annotations

import importlib.abc
import io
import json
import sys
from pathlib import Path

import pytest

from dflash.__main__ import main
from dflash.config import load_config
from dflash.data.tiny import TinySpec, make_tiny
from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[2]
# a drawing needs a checkpoint and two reports, not a drafter that drafts well: a few steps of everything
SMALL = TinySpec(
    target_steps=4, target_batch=8, train_samples=12, conversations=4, eval_prompts=3, response_len=12, threads=1
)

plt = pytest.importorskip("matplotlib.pyplot")  # the [plot] extra is in [test]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter trained for 6 steps on make-tiny's data (its checkpoints)."""
    root = tmp_path_factory.mktemp("evalplot")
    tiny, _ = make_tiny(root / "tiny", SMALL)
    cfg = load_config(
        REPO / "configs" / "tiny-cpu.toml",
        [
            f"target.path={tiny / 'target'}",
            f"data.path={tiny / 'train.jsonl'}",
            f"output_dir={root / 'run'}",
            f"checkpoint.dir={root / 'ckpt'}",
            "max_steps=6",
            "log_every=3",
            "checkpoint.interval=0",
            "optim.lr=5e-3",
        ],
    )
    assert Run(cfg, environ={}, stream=io.StringIO()).train() == 0
    return root / "ckpt"


def test_eval_plot_draws_one_report_and_before_after_side_by_side(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash.eval.plot import series

    common = ["eval", "--drafter", str(ckpt), "--max-new-tokens", "12", "--ddtree-budget", "0"]
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    assert main([*common, "--untrained", "--json", str(before), "--plot", str(one)]) == 0
    assert main([*common, "--json", str(after), "--plot", str(two), "--compare", str(before)]) == 0
    assert f"plot: {two}" in capsys.readouterr().out

    for png in (one, two):
        img = plt.imread(str(png))
        assert img.shape[:2] == (360, 960), img.shape
        assert float(img[..., :3].std()) > 0.05  # not blank
    assert one.read_bytes() != two.read_bytes()

    # what is drawn: acceptance by position as the report has it, the histogram as shares of verify steps
    reps = [json.loads(before.read_text()), json.loads(after.read_text())]
    drawn = series(reps)
    assert [d[0] for d in drawn] == [f"untrained: tau {reps[0]['tau']:.2f}", f"step 6: tau {reps[1]['tau']:.2f}"]
    for (_, acc, share), rep in zip(drawn, reps):
        assert acc == rep["position_acceptance"] and len(acc) == rep["block_size"] - 1
        total = sum(rep["accept_histogram"])
        assert total == rep["steps"] and share == [n / total for n in rep["accept_histogram"]]


def test_eval_plot_errors_are_one_line_and_come_before_the_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No matplotlib (an import blocker on sys.meta_path, matplotlib's loaded modules out of sys.modules until
    the test ends): exit 1, one line naming the extra, and no model loaded (no --drafter is given: the eval
    would fail with another message)."""

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(sys, "meta_path", [Block(), *sys.meta_path])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    capsys.readouterr()
    assert main(["eval", "--plot", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == (
        "dflash: drawing needs matplotlib, which is not installed: pip install 'dflash[plot]'\n"
    )
    monkeypatch.undo()  # matplotlib back: the other errors

    assert main(["eval", "--plot", str(tmp_path / "x.gif")]) == 1
    (tmp_path / "junk.json").write_text("{}")
    assert main(["eval", "--plot", str(tmp_path / "x.png"), "--compare", str(tmp_path / "junk.json")]) == 1
    assert main(["eval", "--compare", str(tmp_path / "junk.json")]) == 2  # --compare without --plot: usage
