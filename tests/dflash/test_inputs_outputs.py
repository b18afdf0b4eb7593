"""What a user hands dflash and where dflash writes: the one reader of user JSON and user
files (dflash.inputs), the one output check and lock (dflash.outputs), each tried as a hostile user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import typing as t
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def finishes(fn: t.Callable[[], t.Any], seconds: float = 60) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it raised (None if none). A guard against a read that blocks
    forever (the old behaviour on a FIFO), not a timing: the thread must end at all."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # what the caller checks
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "blocked"
    return out[0]


def test_a_fifo_is_refused_by_every_reader_of_a_users_file(tmp_path: Path) -> None:
    """Smaller: a FIFO as --config hung (and as --prompts, data.path, --eval, a drafter's config.json); with no
    writer it blocks in open(2) forever."""
    from dflash import inputs
    from dflash.config import ConfigError, load_config
    from dflash.data.samples import DataError, JsonlDataset
    from dflash.eval.evaluate import EvalError, load_prompts

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases: list[tuple[t.Callable[[], t.Any], type[BaseException], str]] = [
        (lambda: load_config(fifo), ConfigError, f"--config: {fifo} is a FIFO; expected a file"),
        (lambda: load_prompts(fifo), EvalError, f"--prompts: {fifo} is a FIFO; expected a file"),
        (lambda: JsonlDataset(fifo), DataError, f"data.path: {fifo} is a FIFO; expected a file"),
        (lambda: inputs.read_json(fifo, "--eval"), inputs.InputFileError, f"--eval: {fifo} is a FIFO; expected a file"),
    ]
    for fn, kind, line in cases:
        e = finishes(fn)
        assert isinstance(e, kind) and str(e) == line, (line, e)


def test_loads_refuses_what_is_no_json_or_no_text() -> None:
    from dflash.inputs import MAX_DEPTH, JsonProblem, loads

    assert loads('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}, "an escaped pair is one character"
    assert loads(b'{"input_ids": [1, 2, 3]}') == {"input_ids": [1, 2, 3]}
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(nested) is not None
    cases = [
        ('{"a": NaN}', "bad-json", "not valid JSON: NaN is not a number JSON allows"),
        ('{"a": -Infinity}', "bad-json", "not valid JSON: -Infinity is not a number JSON allows"),
        ('{"a": 1e999}', "bad-json", "not valid JSON: 1e999 is out of range"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "bad-json", f"not valid JSON: nested too deeply (over {MAX_DEPTH} levels)"),
        ("[" * 100_000 + "]" * 100_000, "bad-json", "not valid JSON: nested too deeply"),
        ('{"m": [{"c": "x\\udfff"}]}', "bad-text", "not text: a lone surrogate ('\\udfff') at character 1 in m[0].c"),
        ('{"\\ud800": 1}', "bad-text", "not text: a lone surrogate ('\\ud800') at character 0 in a key of the value"),
        ('"\\ud800"', "bad-text", "not text: a lone surrogate ('\\ud800') at character 0 in the value"),
        (b"\xff", "bad-json", "not valid JSON: not UTF-8 (byte 0)"),
    ]  # fmt: skip
    for text, reason, message in cases:
        with pytest.raises(JsonProblem) as e:
            loads(text)
        assert (e.value.reason, str(e.value)) == (reason, message), text


def test_a_busy_output_names_the_holder_that_writes_its_pid_late_and_never_a_question_mark(tmp_path: Path) -> None:
    """The holder writes its pid just after taking the lock: a loser looking in between said "(pid ?)". It
    now waits for the pid (two seconds at most); a holder that never writes one is named by no pid."""
    import fcntl
    import threading

    from dflash.outputs import OutputBusy, OutputLock

    out = tmp_path / "store"
    fd = os.open(str(out) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        late = threading.Timer(0.3, lambda: os.pwrite(fd, b"4242\n", 0))
        late.start()
        with pytest.raises(OutputBusy) as e, OutputLock(out, command="regen"):
            pass
        late.join()
        assert str(e.value).startswith(f"regen: another regen (pid 4242) is writing {out};")
        os.ftruncate(fd, 0)
        with pytest.raises(OutputBusy) as e, OutputLock(out, command="regen"):
            pass
        assert str(e.value).startswith(f"regen: another regen is writing {out};"), str(e.value)
    finally:
        os.close(fd)


def test_an_output_lock_is_one_writer_and_a_dead_holders_lock_is_free(tmp_path: Path) -> None:
    from dflash.outputs import OutputBusy, OutputLock

    out = tmp_path / "store"
    with OutputLock(out, command="prepare-data"):
        with pytest.raises(OutputBusy) as e, OutputLock(out, command="prepare-data"):
            pass
        assert str(e.value).startswith(f"prepare-data: another prepare-data (pid {os.getpid()}) is writing {out}")
    assert not Path(str(out) + ".lock").exists()
    # a holder killed with SIGKILL leaves its file; the lock itself died with it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom dflash.outputs import OutputLock\n"
         "with OutputLock(sys.argv[1], command='regen'):\n    print('held', flush=True)\n    time.sleep(600)\n",
         str(out)],
        stdout=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(OutputBusy, match=f"another regen \\(pid {holder.pid}\\)"), OutputLock(out, command="regen"):
            pass
    finally:
        holder.kill()
        holder.wait()
    assert Path(str(out) + ".lock").exists()
    with OutputLock(out, command="regen"):
        assert Path(str(out) + ".lock").read_text() == f"{os.getpid()}\n"


def test_check_out_sees_through_links_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.outputs import OutputError, check_out

    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "link").symlink_to(work)
    (work / "data.jsonl").write_text("{}\n")
    monkeypatch.chdir(work)
    cases = [
        (tmp_path / "link", [], f"x: --out {tmp_path / 'link'} is the working directory"),
        (Path(".."), [], "x: --out .. is a folder above the working directory"),
        (Path("sub/.."), [], "x: --out sub/.. is the working directory"),
        (tmp_path / "other", [tmp_path / "link" / "data.jsonl"], None),
        (tmp_path / "link" / "data.jsonl", ["data.jsonl"], f"x: --out {tmp_path / 'link' / 'data.jsonl'} is the input"),
    ]
    for out, sources, line in cases:
        if line is None:
            assert check_out(out, what="x: --out", kind="dir", sources=sources) == out
            continue
        with pytest.raises(OutputError) as e:
            check_out(out, what="x: --out", kind="file", sources=sources)
        assert str(e.value).startswith(line), (out, e.value)
    assert json.loads((work / "data.jsonl").read_text()) == {}


DEEP = "[" * 100_000 + "]" * 100_000


def test_the_other_readers_of_a_users_json_are_bounded_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Smaller, the class not the case: a store's meta.json (data.path) and bench serve's --template-kwargs
    nested 100000 deep were a RecursionError traceback (json.loads raises it, not a ValueError)."""
    from dflash.__main__ import main
    from dflash.data.store import StoreError, TokenStore

    store = tmp_path / "store"
    store.mkdir()
    (store / "meta.json").write_text(DEEP)
    with pytest.raises(StoreError) as e:
        TokenStore(store)
    assert str(e.value) == (
        f"data.path: {store} is not a token store (meta.json: {store / 'meta.json'} is not JSON (nested too deeply))"
    )
    (store / "meta.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match=r"meta.json: not a JSON object\)$"):
        TokenStore(store)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    capsys.readouterr()
    rc = main(
        ["bench", "serve", "--server", "http://127.0.0.1:9", "--prompts", str(prompts), "--template-kwargs", DEEP]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err == "bench serve: --template-kwargs: not valid JSON: nested too deeply\n", err


def test_a_bom_at_a_files_start_is_its_encoding_mark_for_every_reader(tmp_path: Path) -> None:
    """One answer for the same bytes: json.loads took a BOM before bytes and refused it before text, so
    JSON lines after one were read by prepare-data and refused by eval; the run config's TOML refused it."""
    from dflash import inputs
    from dflash.config import load_config

    bom = b"\xef\xbb\xbf"
    for data in (bom + b'[{"a": 1}]', (bom + b'[{"a": 1}]').decode("utf-8")):
        assert inputs.loads(data) == [{"a": 1}]
    p = tmp_path / "x.json"
    p.write_bytes(bom + b'\n  {"a": 1}')
    assert inputs.read_json(p, "x") == {"a": 1}
    assert inputs.read_text(p, "x") == '\n  {"a": 1}'
    assert inputs.head(p) == b'{"a": 1}'
    toml = (REPO / "configs" / "tiny-random.toml").read_bytes()
    (tmp_path / "bom.toml").write_bytes(bom + toml)
    (tmp_path / "plain.toml").write_bytes(toml)
    assert load_config(tmp_path / "bom.toml") == load_config(tmp_path / "plain.toml")
