"""dflash's exit codes are decided in one place, ``dflash.__main__.main`` (README: 0 done, 1 failed,
2 bad config or arguments; train's 128 + signal comes from the run)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import dflash.__main__ as entry
from dflash.__main__ import main


def test_no_command_exits_by_itself() -> None:
    """Commands raise BadInput/Failed or return; only main turns that into a code, and only entry ends the
    process with it (no SystemExit, sys.exit or os._exit elsewhere in the module)."""
    tree = ast.parse(inspect.getsource(entry))
    ends = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("main", "entry")]
    assert len(ends) == 2
    allowed = {id(n) for fn in ends for n in ast.walk(fn)}
    allowed |= {id(n) for n in tree.body if isinstance(n, ast.If) for n in ast.walk(n)}  # if __name__ == "__main__"
    exits = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
            exits.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit", "exit", "quit"):
            exits.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert exits == []


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["prepare-data", "--in", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "store")])
    assert rc == 2
    assert capsys.readouterr().err == "prepare-data: give exactly one of --config RUN.toml or --tokenizer PATH\n"


def test_usage_errors_and_help_keep_clicks_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train"]) == 2  # missing --config: click's usage error
    assert "Missing option '--config'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "Train DFlash drafters" in capsys.readouterr().out


def test_entry_exits_the_normal_way_with_mains_code() -> None:
    """The console script's end is Python's own (no private atexit call, no os._exit): a worker thread's last
    line, an atexit callback and stdout still in its buffer all come out, and the code is main's."""
    source = inspect.getsource(entry.entry)
    assert "_run_exitfuncs" not in source and "os._exit" not in source
    child = """
import atexit, sys, threading, time
import dflash.__main__ as m

def command():
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread's last line"))).start()
    atexit.register(lambda: print("atexit ran"))
    sys.stdout.write("buffered ")
    return 3

m.main = command
m.entry()
"""
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (3, ""), p.stderr
    assert p.stdout.split("\n")[:3] == ["buffered thread's last line", "atexit ran", ""], p.stdout
