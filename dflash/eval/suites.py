"""The prompt suites of the published DFlash tables, worded and sampled exactly as z-lab's benchmark does.

Each suite is a hub dataset read through ``datasets`` (the ``datasets`` extra), either from the hub (its
cache, or a download) or from a local folder, turned into conversations of user turns with z-lab's
wording (z-lab/dflash ``model/utils.py`` at bb48ef9, the commit of the README tables; the five suites
``dflash/benchmark.py`` still lists word them the same way):

- gsm8k, math500, aime24, aime25: the question + "\\nPlease reason step by step, and put your final answer
  within \\boxed{}.";
- humaneval: "Write a solution to the following problem and make sure that it passes the tests:" and the
  prompt in a python fence; mbpp: the sanitized ``prompt``; lbpp: the ``instruction``;
- livecodebench: LiveCodeBench's code-generation prompt (system text, question, starter code or the
  "# YOUR CODE HERE" block, answer footer) in one user turn; swe-bench: "Problem Statement:" + the issue
  + "Please fix the issue described above.";
- mt-bench: every turn of the conversation (turn 2 follows the target's own answer to turn 1);
  alpaca: the instruction, then "\\n\\nInput:\\n" and the input when there is one.

Samples: z-lab's counts (its run_benchmark.sh: gsm8k 128, math500 128, aime24 30, aime25 30, humaneval
164, mbpp 128, livecodebench 128, swe-bench 128, mt-bench 80, alpaca 128; lbpp: all). A suite with more
rows than its count is cut as z-lab cut it: ``Dataset.shuffle(seed=0).select(range(count))``; one with
fewer keeps its order. ``limit`` N < count takes the first N of that selection, which is what z-lab's
``--max-samples N`` selects (the same permutation, cut shorter).

A local folder (``NAME=PATH``, or ``DIR/NAME`` under ``--suite-dir DIR``) is either a ``save_to_disk``
folder (a Dataset, or a DatasetDict from which the suite's split is taken), a folder laid out as the
hub repository is (what ``huggingface-cli download --repo-type dataset REPO --local-dir PATH`` writes:
README.md with its ``configs``, the parquet or JSON files), or one parquet / JSON / JSONL file.

``load(name, source)`` is the plain entry point (``dflash bench serve`` and ``dflash eval --suite`` use it):
a list of conversations, each the list of its user turns.
"""

from __future__ import annotations

import dataclasses
import os
import typing as t
from pathlib import Path

from dflash.errors import InputError

__all__ = ["DATASETS_HINT", "SUITES", "Suite", "SuiteError", "load", "parse_suites"]

DATASETS_HINT = "pip install 'dflash[datasets]'"
HUB = "https://huggingface.co/datasets/"

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
LCB_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests. You will NOT "
    "return anything except for the program"
)
LCB_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")


class SuiteError(InputError, ValueError):
    """A suite that cannot be read as asked (unknown name, missing extra, wrong schema): a user's mistake,
    one line, exit 2."""


def _text(row: t.Mapping[str, t.Any], field: str) -> str:
    v = row[field]
    if not isinstance(v, str):
        raise SuiteError(f"field {field!r}: expected a string, got {type(v).__name__}")
    return v


def _math(field: str) -> t.Callable[[t.Mapping[str, t.Any]], list[str]]:
    return lambda row: [_text(row, field) + MATH_SUFFIX]


def _livecodebench(row: t.Mapping[str, t.Any]) -> list[str]:
    starter = row.get("starter_code")
    if starter:
        fmt, code = "### Format: Use the following code structure:", f"```python\n{starter}\n```"
    else:
        fmt, code = "### Format: Write your code in the following format:", "```python\n# YOUR CODE HERE\n```"
    question = f"### Question:\n{_text(row, 'question_content')}"
    footer = "### Answer: (use the provided format with backticks)"
    return [f"{LCB_SYSTEM}\n\n{question}\n\n{fmt}\n{code}\n\n{footer}"]


def _alpaca(row: t.Mapping[str, t.Any]) -> list[str]:
    extra = row.get("input")
    return [f"{_text(row, 'instruction')}\n\nInput:\n{extra}" if extra else _text(row, "instruction")]


def _turns(row: t.Mapping[str, t.Any]) -> list[str]:
    turns = row["prompt"]
    if not isinstance(turns, list) or not turns or not all(isinstance(x, str) for x in turns):
        raise SuiteError("field 'prompt': expected a non-empty list of strings (the turns)")
    return list(turns)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    repo: str  # the hub dataset
    config: str | None
    split: str
    samples: int | None  # z-lab's count (None: every row)
    fields: tuple[str, ...]  # what the wording reads: a folder without them is not this dataset
    turns: t.Callable[[t.Mapping[str, t.Any]], list[str]]
    files: tuple[str, ...] = ()  # read as plain files (z-lab loads these by URL, not by the repo's loader)

    @property
    def multi_turn(self) -> bool:
        return self.name == "mt-bench"


# z-lab's table order, then lbpp (listed by its benchmark, in no table)
SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite("gsm8k", "openai/gsm8k", "main", "test", 128, ("question",), _math("question")),
        Suite("math500", "HuggingFaceH4/MATH-500", None, "test", 128, ("problem",), _math("problem")),
        Suite("aime24", "HuggingFaceH4/aime_2024", None, "train", 30, ("problem",), _math("problem")),
        Suite("aime25", "MathArena/aime_2025", None, "train", 30, ("problem",), _math("problem")),
        Suite(
            "humaneval",
            "openai/openai_humaneval",
            None,
            "test",
            164,
            ("prompt",),
            lambda row: [HUMANEVAL.format(_text(row, "prompt"))],
        ),
        Suite(
            "mbpp",
            "google-research-datasets/mbpp",
            "sanitized",
            "test",
            128,
            ("prompt",),
            lambda row: [_text(row, "prompt")],
        ),
        Suite(
            "livecodebench",
            "livecodebench/code_generation_lite",
            None,
            "test",
            128,
            ("question_content",),
            _livecodebench,
            files=LCB_FILES,
        ),
        Suite(
            "swe-bench",
            "princeton-nlp/SWE-bench_Lite",
            None,
            "test",
            128,
            ("problem_statement",),
            lambda row: [
                f"Problem Statement:\n{_text(row, 'problem_statement')}\nPlease fix the issue described above."
            ],
        ),
        Suite("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", 80, ("prompt",), _turns),
        Suite("alpaca", "tatsu-lab/alpaca", None, "train", 128, ("instruction", "input"), _alpaca),
        Suite(
            "lbpp",
            "CohereLabs/lbpp",
            None,
            "test",
            None,
            ("instruction",),
            lambda row: [_text(row, "instruction")],
            files=("python/test.parquet",),
        ),
    )
}


def parse_suites(spec: str, suite_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, str | None]]:
    """``--suite gsm8k,math500=/data/math500`` (with ``--suite-dir DIR``: ``DIR/NAME`` for names given
    without a path) -> ``[(name, local path or None: the hub)]``, in the order given."""
    out: list[tuple[str, str | None]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, path = part.partition("=")
        name = name.strip()
        if name not in SUITES:
            raise SuiteError(f"--suite: unknown suite {name!r} (known: {', '.join(SUITES)})")
        if any(n == name for n, _ in out):
            raise SuiteError(f"--suite: {name} is named twice")
        if not path and suite_dir is not None:
            path = str(Path(suite_dir) / name)
            if not Path(path).exists():
                raise SuiteError(f"--suite-dir: there is no {path} for suite {name} (give {name}=PATH)")
        out.append((name, path.strip() or None))
    if not out:
        raise SuiteError(f"--suite: no suite named (known: {', '.join(SUITES)})")
    return out


def _datasets() -> t.Any:
    try:
        import datasets  # the optional extra: only suites need it
    except ImportError:
        raise SuiteError(f"--suite reads its datasets with the datasets extra: {DATASETS_HINT}") from None
    # "Generating test split" bars on a first read: noise in stderr beside the report and our one-line errors
    datasets.disable_progress_bars()
    return datasets


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _open(suite: Suite, source: str | None) -> t.Any:
    """The suite's split as a ``datasets.Dataset``."""
    ds = _datasets()
    where = suite.repo if source is None else source
    try:
        if source is None:
            if suite.files:  # z-lab reads these repositories' files by URL
                urls = [f"{HUB}{suite.repo}/resolve/main/{f}" for f in suite.files]
                kind = "parquet" if suite.files[0].endswith(".parquet") else "json"
                return ds.load_dataset(kind, data_files={suite.split: urls}, split=suite.split)
            return ds.load_dataset(suite.repo, suite.config, split=suite.split)
        path = Path(source)
        if path.is_file():
            kind = "parquet" if path.suffix == ".parquet" else "json"
            return ds.load_dataset(kind, data_files={suite.split: str(path)}, split=suite.split)
        if not path.is_dir():
            raise SuiteError(f"suite {suite.name}: {source} does not exist")
        if (path / "dataset_dict.json").is_file():
            saved = ds.load_from_disk(str(path))
            if suite.split not in saved:
                raise SuiteError(
                    f"suite {suite.name}: {source} has no split {suite.split!r} (it has {', '.join(saved)})"
                )
            return saved[suite.split]
        if (path / "state.json").is_file():
            return ds.load_from_disk(str(path))
        if suite.files:
            found = [str(path / f) for f in suite.files if (path / f).is_file()]
            if not found:
                raise SuiteError(f"suite {suite.name}: {source} holds none of {', '.join(suite.files)}")
            kind = "parquet" if found[0].endswith(".parquet") else "json"
            return ds.load_dataset(kind, data_files={suite.split: found}, split=suite.split)
        return ds.load_dataset(str(path), suite.config, split=suite.split)
    except SuiteError:
        raise
    except Exception as e:  # datasets and the hub raise many kinds; one line, never a traceback
        what = f"{where} (config {suite.config}, split {suite.split})" if suite.config else f"{where} ({suite.split})"
        raise SuiteError(f"suite {suite.name}: cannot read {what}: {_one_line(e)}") from None


def load(name: str, source: str | os.PathLike[str] | None = None, *, limit: int | None = None) -> list[list[str]]:
    """Suite ``name``'s conversations, each the list of its user turns, worded and chosen as z-lab's
    benchmark does (module doc); ``source``: a local folder or file (None: the hub); ``limit``: at most
    that many conversations (the first of z-lab's selection)."""
    suite = SUITES.get(name)
    if suite is None:
        raise SuiteError(f"unknown suite {name!r} (known: {', '.join(SUITES)})")
    data = _open(suite, None if source is None else str(source))
    missing = [f for f in suite.fields if f not in data.column_names]
    if missing:
        raise SuiteError(
            f"suite {name}: {source or suite.repo} has no field {', '.join(map(repr, missing))} "
            f"(it has {', '.join(data.column_names)}): not the {suite.repo} schema"
        )
    if suite.samples is not None and len(data) > suite.samples:
        # z-lab's selection (bb48ef9): the same call, so the same permutation; in memory: nothing written
        data = data.shuffle(seed=0, keep_in_memory=True).select(range(suite.samples), keep_in_memory=True)
    n = len(data) if limit is None else min(limit, len(data))
    out: list[list[str]] = []
    for i in range(n):
        try:
            out.append(suite.turns(data[i]))
        except SuiteError as e:
            raise SuiteError(f"suite {name}: row {i}: {e}") from None
    if not out:
        raise SuiteError(f"suite {name}: {source or suite.repo} has no rows")
    return out
