"""`dflash eval --suite`: the published tables' suites read through `datasets` from local folders laid out
as the hub repositories are (their files, splits, configs and field names; a save_to_disk copy too), in
z-lab's wording and selection, decoded with the target's chat template (mt-bench's turn 2 after the
target's own turn 1), and set beside the published tau.

The target is test_eval_chat's: a tiny random-init Qwen3 saved as a HF folder with a real BPE tokenizer
and a Qwen3-like chat template; the drafter is the untrained one of a run config, enough here: what is
tested is what gets decoded and how it is reported, and the output must be the target's own whatever
the drafter drafts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import typing as t
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_eval_chat import Tiny, run_cli, served, write_config
from test_prepare_data import QWEN3, make_tokenizer

from dflash.__main__ import main
from dflash.checkpoint.checkpoints import save_checkpoint
from dflash.eval import published, suites
from dflash.eval.evaluate import load_setup
from dflash.eval.spec_decode import target_greedy
from dflash.model.target import TargetModel, tiny_target_config
from testkit.engine_double import EngineDouble

pytestmark = pytest.mark.timeout(300)

MATH = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_ROWS = 130  # more than z-lab's 128: its seeded shuffle decides which and in what order


def parquet(path: Path, rows: list[dict[str, t.Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def readme(path: Path, configs: str | None) -> None:
    """The dataset card: its YAML header names the configs and their data files, as on the hub."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "README.md").write_text(f"---\nlicense: mit\n{configs or ''}---\n# card\n")


def build(root: Path) -> dict[str, Path]:
    """One folder (or file) per suite, in the layout `huggingface-cli download --repo-type dataset` gives."""
    import datasets

    out = {}
    # openai/gsm8k: two configs, each with train and test parquet files; ours is main/test
    d = out["gsm8k"] = root / "gsm8k"
    readme(
        d,
        "configs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n  - split: test\n"
        "    path: main/test-*\n- config_name: socratic\n  data_files:\n  - split: train\n    path: socratic/train-*\n"
        "  - split: test\n    path: socratic/test-*\n",
    )
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            rows = [{"question": f"{config} {split} question {i}", "answer": f"#### {i}"} for i in range(GSM8K_ROWS)]
            parquet(d / config / f"{split}-00000-of-00001.parquet", rows)
    # HuggingFaceH4/MATH-500: one test.jsonl at the top
    d = out["math500"] = root / "math500"
    d.mkdir()
    (d / "test.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "problem": f"problem {i}",
                    "solution": "s",
                    "answer": "1",
                    "subject": "Algebra",
                    "level": 2,
                    "unique_id": f"test/{i}.json",
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    # HuggingFaceH4/aime_2024, as a user saved it: save_to_disk of the train split
    d = out["aime24"] = root / "aime24-saved"
    rows = [
        {"id": i, "problem": f"aime problem {i}", "solution": "s", "answer": "7", "url": "u", "year": "2024"}
        for i in range(2)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(d))
    # MathArena/aime_2025: data/train-*.parquet
    d = out["aime25"] = root / "aime25"
    readme(d, "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n")
    parquet(
        d / "data" / "train-00000-of-00001.parquet",
        [{"problem_idx": 1, "problem": "aime25 problem", "answer": 3, "problem_type": ["Algebra"]}],
    )
    # openai/openai_humaneval: config openai_humaneval (the default), split test
    d = out["humaneval"] = root / "humaneval"
    readme(
        d,
        "configs:\n- config_name: openai_humaneval\n  data_files:\n  - split: test\n    path: openai_humaneval/test-*\n  default: true\n",
    )
    parquet(
        d / "openai_humaneval" / "test-00000-of-00001.parquet",
        [
            {
                "task_id": "HumanEval/0",
                "prompt": 'def add(a, b):\n    """sum"""\n',
                "canonical_solution": "    return a + b\n",
                "test": "",
                "entry_point": "add",
            }
        ],
    )
    # google-research-datasets/mbpp: configs full and sanitized, four splits each; saved as a DatasetDict
    d = out["mbpp"] = root / "mbpp-saved"
    split_rows = {
        s: [
            {
                "source_file": "f",
                "task_id": i,
                "prompt": f"mbpp {s} {i}",
                "code": "",
                "test_imports": [],
                "test_list": [],
            }
            for i in range(2)
        ]
        for s in ("train", "test", "validation", "prompt")
    }
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in split_rows.items()}).save_to_disk(str(d))
    # livecodebench/code_generation_lite: test.jsonl .. test6.jsonl beside the repository's loading script
    d = out["livecodebench"] = root / "livecodebench"
    d.mkdir()
    (d / "code_generation_lite.py").write_text("# the repository's loading script: never run\n")
    lcb = {
        "question_title": "t",
        "platform": "leetcode",
        "question_id": "1",
        "contest_id": "c",
        "contest_date": "2024-01-01T00:00:00",
        "difficulty": "easy",
        "public_test_cases": "[]",
        "private_test_cases": "",
        "metadata": "{}",
    }
    (d / "test.jsonl").write_text(
        json.dumps({**lcb, "question_content": "add two numbers", "starter_code": "class Solution:\n    pass"}) + "\n"
    )
    (d / "test2.jsonl").write_text(json.dumps({**lcb, "question_content": "read n", "starter_code": ""}) + "\n")
    # princeton-nlp/SWE-bench_Lite: data/dev-* and data/test-*
    d = out["swe-bench"] = root / "swe-bench"
    readme(
        d,
        "configs:\n- config_name: default\n  data_files:\n  - split: dev\n    path: data/dev-*\n  - split: test\n    path: data/test-*\n",
    )
    swe = {
        k: "x"
        for k in (
            "repo",
            "instance_id",
            "base_commit",
            "patch",
            "test_patch",
            "hints_text",
            "created_at",
            "version",
            "FAIL_TO_PASS",
            "PASS_TO_PASS",
            "environment_setup_commit",
        )
    }
    parquet(d / "data" / "dev-00000-of-00001.parquet", [{**swe, "problem_statement": "dev issue"}])
    parquet(d / "data" / "test-00000-of-00001.parquet", [{**swe, "problem_statement": "the test issue"}])
    # HuggingFaceH4/mt_bench_prompts: data/train-*.parquet (prompt: both turns) and raw/question.jsonl
    d = out["mt-bench"] = root / "mt-bench"
    readme(d, None)
    parquet(
        d / "data" / "train-00000-of-00001-67c6c9fef07685a3.parquet",
        [
            {"prompt": [f"first turn {i}", f"second turn {i}"], "prompt_id": i, "category": "writing", "reference": []}
            for i in range(3)
        ],
    )
    (d / "raw").mkdir()
    (d / "raw" / "question.jsonl").write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"]}) + "\n"
    )
    # tatsu-lab/alpaca: data/train-*.parquet and alpaca_data.json
    d = out["alpaca"] = root / "alpaca"
    readme(d, None)
    parquet(
        d / "data" / "train-00000-of-00001-a09b74b3ef9c3b56.parquet",
        [
            {"instruction": "name a color", "input": "", "output": "red", "text": "t"},
            {"instruction": "sum these", "input": "1 2", "output": "3", "text": "t"},
        ],
    )
    (d / "alpaca_data.json").write_text(json.dumps([{"instruction": "other", "input": "", "output": ""}]))
    # CohereLabs/lbpp: python/test.parquet (z-lab reads that file)
    d = out["lbpp"] = root / "lbpp"
    parquet(
        d / "python" / "test.parquet",
        [
            {
                "task_id": "lbpp/0",
                "language": "python",
                "title": "t",
                "instruction": "write lbpp",
                "completion": "",
                "test_file": "",
                "test_list": [],
                "signature": "",
                "categories": [],
                "test_setup": "",
            }
        ],
    )
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """test_eval_chat's target: random init, a BPE tokenizer, a Qwen3-like template (thinking off)."""
    root = tmp_path_factory.mktemp("suitetarget")
    tok = make_tokenizer(QWEN3, "<|im_end|>")
    cfg = tiny_target_config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=0.5,
    )
    TargetModel.from_config(cfg, dtype=torch.float32, seed=3, num_draft_layers=1).model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return Tiny(root, root / "target", write_config(root / "run.toml", root / "target"), tok)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("suites"))


def test_a_first_read_of_a_suite_prints_no_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A folder datasets has not cached yet: no "Generating test split" bar reaches stderr (it did before
    whenever no earlier read in the process had cached the folder: the one-line error tests saw it or not
    by test order)."""
    import datasets

    datasets.enable_progress_bars()
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "one"}) + "\n")
    assert suites.load("gsm8k", tmp_path / "test.jsonl") == [[f"one{MATH}"]]
    assert capfd.readouterr().err == ""


def test_every_suite_reads_its_hub_layout_with_zlabs_wording(folders: dict[str, Path]) -> None:
    got = {name: suites.load(name, path) for name, path in folders.items()}
    assert set(got) == set(suites.SUITES)
    assert got["math500"] == [[f"problem {i}{MATH}"] for i in range(3)]  # fewer rows than 128: in order
    assert got["aime24"] == [[f"aime problem {i}{MATH}"] for i in range(2)]
    assert got["aime25"] == [[f"aime25 problem{MATH}"]]
    assert got["humaneval"] == [
        [
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            '```python\ndef add(a, b):\n    """sum"""\n\n```'
        ]
    ]
    assert got["mbpp"] == [["mbpp test 0"], ["mbpp test 1"]]  # the test split of the saved DatasetDict
    system = (
        "You are an expert Python programmer. You will be given a question (problem specification) and will "
        "generate a correct Python program that matches the specification and passes all tests. You will NOT "
        "return anything except for the program"
    )
    assert got["livecodebench"] == [
        [
            f"{system}\n\n### Question:\nadd two numbers\n\n### Format: Use the following code structure:\n"
            "```python\nclass Solution:\n    pass\n```\n\n### Answer: (use the provided format with backticks)"
        ],
        [
            f"{system}\n\n### Question:\nread n\n\n### Format: Write your code in the following format:\n"
            "```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)"
        ],
    ]
    assert got["swe-bench"] == [["Problem Statement:\nthe test issue\nPlease fix the issue described above."]]
    assert got["mt-bench"] == [[f"first turn {i}", f"second turn {i}"] for i in range(3)]
    assert got["alpaca"] == [["name a color"], ["sum these\n\nInput:\n1 2"]]
    assert got["lbpp"] == [["write lbpp"]]


def test_a_suite_larger_than_zlabs_count_is_its_seeded_selection(folders: dict[str, Path]) -> None:
    got = suites.load("gsm8k", folders["gsm8k"])
    # z-lab: dataset.shuffle(seed=0).select(range(128)); datasets' shuffle is numpy's default_rng(seed)
    order = np.random.default_rng(0).permutation(GSM8K_ROWS)[:128]
    assert got == [[f"main test question {i}{MATH}"] for i in order]  # config main, split test
    assert suites.load("gsm8k", folders["gsm8k"], limit=5) == got[:5]  # z-lab's --max-samples 5 selects these


def test_suite_arguments(folders: dict[str, Path], tmp_path: Path) -> None:
    root = folders["gsm8k"].parent
    assert suites.parse_suites("gsm8k, mt-bench=/x/mt") == [("gsm8k", None), ("mt-bench", "/x/mt")]
    assert suites.parse_suites("gsm8k,alpaca=/y", root) == [("gsm8k", str(root / "gsm8k")), ("alpaca", "/y")]
    for spec, where, message in [
        (
            "gsm9k",
            None,
            "--suite: unknown suite 'gsm9k' (known: gsm8k, math500, aime24, aime25, humaneval, mbpp, livecodebench, swe-bench, mt-bench, alpaca, lbpp)",
        ),
        ("gsm8k,gsm8k", None, "--suite: gsm8k is named twice"),
        (",", None, "--suite: no suite named"),
        ("math500", tmp_path, f"--suite-dir: there is no {tmp_path / 'math500'} for suite math500 (give math500=PATH)"),
    ]:
        with pytest.raises(suites.SuiteError) as e:
            suites.parse_suites(spec, where)
        assert str(e.value).startswith(message), str(e.value)


def test_published_figures_need_the_same_target_block_size_and_temperature() -> None:
    from transformers import Qwen3Config

    q8 = Qwen3Config(num_hidden_layers=36, hidden_size=4096, vocab_size=151936)
    q4 = Qwen3Config(num_hidden_layers=36, hidden_size=2560, vocab_size=151936)
    snap = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/b968826d9c46dd6066d109eabc6255188de91218"
    assert published.identify_target(snap, q8) == "Qwen/Qwen3-8B"
    assert published.identify_target("/models/qwen3-8b", q8) == "Qwen/Qwen3-8B"
    assert published.identify_target("/models/Qwen3-4B/", q4) == "Qwen/Qwen3-4B"
    assert published.identify_target("/models/Qwen3-8B", q4) is None  # named after a model it is not
    assert published.identify_target("/models/Qwen3-8B-Base", q8) is None  # another target of that shape
    assert published.identify_target("/models/mine", q8) is None
    fig = published.figure("Qwen/Qwen3-8B", 16, 0.0, "gsm8k")
    assert fig is not None and fig[0] == 6.55 and fig[1].drafter == "z-lab/Qwen3-8B-DFlash-b16"
    assert [
        published.figure("Qwen/Qwen3-8B", 16, 1.0, s)[0] for s in ("gsm8k", "math500", "humaneval", "mt-bench")
    ] == [6.04, 6.57, 5.40, 3.74]  # type: ignore[index]
    assert published.figure("Qwen/Qwen3-8B", 8, 0.0, "gsm8k") is None
    assert published.figure("Qwen/Qwen3-8B", 16, 0.7, "gsm8k") is None
    assert published.figure("Qwen/Qwen3-8B", 16, 0.0, "lbpp") is None
    assert published.figure(None, 16, 0.0, "gsm8k") is None


def test_cli_decodes_every_turn_with_the_chat_template_and_reports_per_suite(
    tiny: Tiny, folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "suites.json"
    spec = f"gsm8k={folders['gsm8k']},mt-bench={folders['mt-bench']}"
    rc, stdout, err = run_cli(
        capsys,
        "--untrained",
        "--config",
        str(tiny.config),
        "--suite",
        spec,
        "--max-new",
        "12",
        "--limit",
        "2",
        "--json",
        str(out),
        "--strict",
    )
    assert rc == 0, err
    lines = stdout.splitlines()
    assert "suite gsm8k: 2 conversations, 2 prompts" in err and "suite mt-bench: 2 conversations, 4 prompts" in err
    table = lines[lines.index(next(x for x in lines if x.startswith("suite "))) :]
    assert table[1].split()[:2] == ["gsm8k", "2"] and table[2].split()[:2] == ["mt-bench", "2x2"]
    assert "published: no published tau for this target" in stdout and "published target" not in stdout
    assert lines[-1] == "output identical to plain greedy decoding: yes"
    rep = json.loads(out.read_text())
    assert (rep["temperature"], rep["count"], rep["max_new_tokens"], rep["chat_template_kwargs"]) == (
        0.0,
        "dflash",
        12,
        {"enable_thinking": False},
    )
    gsm, mt = rep["results"]
    assert (
        gsm["published"] is None and gsm["report"]["protocol"]["prompts_source"] == f"suite gsm8k: {folders['gsm8k']}"
    )
    tm = TargetModel.from_pretrained(str(tiny.target), dtype=torch.float32, num_draft_layers=1)
    tok = tiny.tokenizer
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]

    def greedy(ids: list[int]) -> list[int]:
        return target_greedy(tm, torch.tensor([ids]), max_new_tokens=12, stop_token_ids=eos)[0, len(ids) :].tolist()

    # turn 1 is z-lab's wording in the target's template (thinking off, as the run config says)
    first = suites.load("gsm8k", folders["gsm8k"], limit=1)[0][0]
    assert gsm["report"]["outputs"][0] == greedy(
        served(tok, [{"role": "user", "content": first}], enable_thinking=False)
    )
    # mt-bench: turn 2 follows the target's own answer to turn 1, as text
    outputs = mt["report"]["outputs"]
    answer = tok.decode(outputs[0], skip_special_tokens=True)
    turn2 = [
        {"role": "user", "content": "first turn 0"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "second turn 0"},
    ]
    assert outputs[1] == greedy(served(tok, turn2, enable_thinking=False))
    assert mt["report"]["num_prompts"] == 4 and mt["conversations"] == 2


def test_a_suite_report_that_cannot_be_written_is_one_line_after_the_report(
    tiny: Tiny, folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--json on a full disk: the table is on stdout already, the failed write is one line, exit 1."""
    args = ["--untrained", "--config", str(tiny.config), "--suite", f"gsm8k={folders['gsm8k']}"]
    rc, stdout, err = run_cli(capsys, *args, "--max-new", "4", "--limit", "1", "--json", "/dev/full")
    assert rc == 1
    assert "output identical to plain greedy decoding" in stdout
    assert err.strip().splitlines()[-1].startswith("eval: /dev/full: "), err
    assert "Traceback" not in err


def test_the_published_figure_stands_beside_ours_for_the_same_target(
    tiny: Tiny,
    folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the tiny target in a folder named Qwen3-8B, and (a test double of the table's knowledge) its shape
    # taken for Qwen3-8B's: the matching is what is tested, not an 8B model
    named = tmp_path / "Qwen3-8B"
    shutil.copytree(tiny.target, named)
    conf = json.loads((named / "config.json").read_text())
    monkeypatch.setitem(
        published.TARGET_SHAPES, "Qwen/Qwen3-8B", (conf["num_hidden_layers"], conf["hidden_size"], conf["vocab_size"])
    )
    cfg = write_config(tmp_path / "b16.toml", named)
    cfg.write_text(cfg.read_text().replace("block_size = 4", "block_size = 16"))
    spec = f"gsm8k={folders['gsm8k']},lbpp={folders['lbpp']}"
    base = [
        "--untrained",
        "--config",
        str(cfg),
        "--suite",
        spec,
        "--max-new",
        "8",
        "--limit",
        "1",
        "--ddtree-budget",
        "0",
    ]
    rc, stdout, err = run_cli(capsys, *base, "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert "(published target Qwen/Qwen3-8B)" in stdout
    row = next(x for x in stdout.splitlines() if x.startswith("gsm8k"))
    assert row.split()[3] == "6.55" and "max new 8 (published: 2048); 1 of 128 samples; dflash count" in row
    assert next(x for x in stdout.splitlines() if x.startswith("lbpp")).split()[3:] == []  # no figure: nothing
    assert "published: z-lab/Qwen3-8B-DFlash-b16, z-lab/dflash README @bb48ef9" in stdout
    gsm = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert gsm["published"]["tau"] == 6.55 and gsm["published"]["drafter"] == "z-lab/Qwen3-8B-DFlash-b16"
    # T=1 and z-lab's count: the T=1 row, and the count is no longer a difference
    rc, stdout, err = run_cli(capsys, *base, "--temperature", "1", "--seed", "3", "--count", "zlab")
    assert rc == 0, err
    row = next(x for x in stdout.splitlines() if x.startswith("gsm8k"))
    assert row.split()[3] == "6.04" and "dflash count" not in row
    assert "sampled at T=1 (seed 3)" in stdout and stdout.splitlines()[-1].endswith(": yes")
    # another temperature: no figure, and the report says why
    rc, stdout, _ = run_cli(capsys, *base, "--temperature", "0.6")
    assert rc == 0 and "published: none for Qwen/Qwen3-8B at block size 16 and T=0.6" in stdout


def test_bad_suite_input_is_one_line_and_exit_2(
    tiny: Tiny, folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ["--untrained", "--config", str(tiny.config)]
    cases = [
        (
            ["--suite", "gsm9k"],
            "dflash: --suite: unknown suite 'gsm9k' (known: gsm8k, math500, aime24, aime25, humaneval, mbpp, livecodebench, swe-bench, mt-bench, alpaca, lbpp)",
        ),
        (["--suite", f"math500={tmp_path / 'nope'}"], f"dflash: suite math500: {tmp_path / 'nope'} does not exist"),
        (
            ["--suite", f"humaneval={folders['math500']}"],
            f"dflash: suite humaneval: {folders['math500']} has no field 'prompt' (it has problem, solution, answer, "
            "subject, level, unique_id): not the openai/openai_humaneval schema",
        ),
        (  # two configs and none the suite's default: datasets' own words, in one line
            ["--suite", f"math500={folders['gsm8k']}"],
            f"dflash: suite math500: cannot read {folders['gsm8k']} (test): ValueError: Config name is missing.",
        ),
        (
            ["--suite", f"livecodebench={folders['gsm8k']}"],
            f"dflash: suite livecodebench: {folders['gsm8k']} holds none of test.jsonl, test2.jsonl, test3.jsonl, test4.jsonl, test5.jsonl, test6.jsonl",
        ),
        (
            ["--suite", "gsm8k", "--prompts", str(tmp_path / "p.jsonl")],
            "dflash: --suite and --prompts: give one of them",
        ),
        (["--suite-dir", str(tmp_path)], "dflash: --suite-dir goes with --suite"),
        (
            ["--suite", "gsm8k", "--plot", str(tmp_path / "x.png")],
            "dflash: --plot draws one report: give --prompts, not --suite",
        ),
    ]
    for args, line in cases:
        rc, out, err = run_cli(capsys, *cfg, *args)
        assert (rc, out, err.strip()) == (2, "", line), args
    rc, _, err = run_cli(capsys, *cfg, "--suite", "gsm8k", "--temperature", "-1")  # click's usage error
    assert (
        rc == 2
        and err.strip().splitlines()[-1] == "Error: Invalid value for '--temperature': -1.0 is not in the range x>=0."
    )
    # a local folder that is not a dataset: datasets' error in one line
    (tmp_path / "empty").mkdir()
    rc, out, err = run_cli(capsys, *cfg, "--suite", f"aime25={tmp_path / 'empty'}")
    assert (
        rc == 2
        and err.startswith(f"dflash: suite aime25: cannot read {tmp_path / 'empty'} (train): ")
        and len(err.splitlines()) == 1
    )


def test_without_the_datasets_extra_the_error_names_it(tiny: Tiny, folders: dict[str, Path]) -> None:
    code = (
        "import sys; sys.modules['datasets'] = None  # as if dflash[datasets] were not installed\n"
        "from dflash.__main__ import main\n"
        f"sys.exit(main(['eval', '--untrained', '--config', {str(tiny.config)!r}, '--suite', 'gsm8k={folders['gsm8k']}']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr.strip().splitlines()[-1]
        == "dflash: --suite reads its datasets with the datasets extra: pip install 'dflash[datasets]'"
    )
    assert "Traceback" not in r.stderr


def test_bench_serve_sends_each_conversations_first_turn_beside_evals_tau_of_the_same_selection(
    tiny: Tiny, folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dflash bench serve --suite``: the suites' selection in z-lab's wording as chat requests to a server
    (EngineDouble: the engines' /metrics, no GPU engine), with eval's tau on the same selection beside it."""
    s = load_setup(drafter=None, untrained=True, config=str(tiny.config), suite=True)
    ck = str(save_checkpoint(tmp_path / "ck", step=0, drafter=s.drafter, trainer_state={}))
    both = f"gsm8k={folders['gsm8k']},mt-bench={folders['mt-bench']}"
    gsm = f"gsm8k={folders['gsm8k']}"
    out = tmp_path / "bench.json"
    with EngineDouble("vllm") as engine:
        serve = ["bench", "serve", "--server", engine.url, "--concurrency", "1", "--warmup", "0"]
        assert main([*serve, "--suite", both, "--limit", "2", "--json", str(out)]) == 0
        sent = list(engine.requests)
        # bad input: one line, exit 2, no request
        capsys.readouterr()
        assert main([*serve, "--suite", gsm, "--prompts", str(tmp_path / "p.jsonl")]) == 2
        assert main([*serve, "--prompts", str(tmp_path / "p.jsonl"), "--limit", "2"]) == 2
        assert main([*serve, "--suite", "gsm9k"]) == 2
        assert len(engine.requests) == len(sent)
    assert capsys.readouterr().err.splitlines() == [
        "bench serve: give --prompts FILE or --suite NAMES (one of them)",
        "bench serve: --suite-dir and --limit go with --suite",
        "dflash: --suite: unknown suite 'gsm9k' (known: gsm8k, math500, aime24, aime25, humaneval, mbpp, "
        "livecodebench, swe-bench, mt-bench, alpaca, lbpp)",
    ]
    # each conversation's first user turn, z-lab's wording and selection; the tables' 2048 new tokens
    firsts = [c[0] for c in suites.load("gsm8k", folders["gsm8k"], limit=2)] + ["first turn 0", "first turn 1"]
    assert [b["messages"] for b in sent] == [[{"role": "user", "content": x}] for x in firsts]
    assert all(b["max_tokens"] == 2048 and b["temperature"] == 0 for b in sent)
    got = json.loads(out.read_text())
    assert got["num_prompts"] == 4
    assert got["prompts"] == f"suite gsm8k ({folders['gsm8k']}), suite mt-bench ({folders['mt-bench']})"

    # beside it, eval's tau on the same selection: from its --suite report, or computed here
    rep, b1, b2 = tmp_path / "eval.json", tmp_path / "b1.json", tmp_path / "b2.json"
    common = ["--suite", gsm, "--limit", "2", "--max-new", "8"]
    rc, _, err = run_cli(capsys, "--drafter", ck, "--target", str(tiny.target), *common, "--json", str(rep))
    assert rc == 0, err
    evaluated = json.loads(rep.read_text())["results"][0]
    with EngineDouble("vllm") as engine:
        serve = ["bench", "serve", "--server", engine.url, "--concurrency", "1", "--warmup", "0"]
        assert main([*serve, "--suite", gsm, "--limit", "2", "--eval", str(rep), "--json", str(b1)]) == 0
        assert all(b["max_tokens"] == 8 for b in engine.requests)  # the report's --max-new
        assert main([*serve, *common, "--drafter", ck, "--target", str(tiny.target), "--json", str(b2)]) == 0
    for path in (b1, b2):
        offline = json.loads(path.read_text())["offline"]
        assert offline["same_prompts"] is True and offline["max_new_tokens"] == 8, path
        assert (
            offline["tau"] == evaluated["tau"]
            and offline["position_acceptance"] == (evaluated["report"]["position_acceptance"])
        )
    # a report of two suites is not one figure
    rc, _, err = run_cli(
        capsys,
        "--drafter",
        ck,
        "--target",
        str(tiny.target),
        "--suite",
        both,
        "--limit",
        "1",
        "--max-new",
        "4",
        "--json",
        str(rep),
    )
    assert rc == 0, err
    with EngineDouble("vllm") as engine:
        capsys.readouterr()
        assert main(["bench", "serve", "--server", engine.url, "--suite", gsm, "--eval", str(rep)]) == 2
        assert engine.requests == []
    assert (
        capsys.readouterr().err.strip()
        == f"bench serve: --eval: {rep} is a report of 2 suites: give one of a single suite"
    )
