"""`dflash eval`'s command: its options -> the setup -> ``dflash.eval.evaluate.evaluate`` (or the suites of
``dflash.eval.suite_report``) -> the report's lines, --json and --plot. The measuring is ``dflash.eval.evaluate``;
docs/evaluation.md."""

from __future__ import annotations

import dataclasses
import typing as t

import torch

from dflash import outputs
from dflash.errors import Failed, InputError
from dflash.eval import plot as eval_plot
from dflash.eval import suites
from dflash.eval.evaluate import DEFAULT_BUDGET, check_max_new, evaluate, load_setup
from dflash.eval.suite_report import run_suites


class BadOption(InputError, ValueError):
    """An option the others contradict; the command line shows it as click shows its own (exit 2)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option
        self.message = message


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What `dflash eval` was asked, one field per option (docs/evaluation.md)."""

    drafter_path: str | None = None
    untrained: bool = False
    config_path: str | None = None
    target_path: str | None = None
    prompts_path: str | None = None
    chat: bool = False
    template_kwargs: str | None = None
    suite_spec: str | None = None
    suite_dir: str | None = None
    max_new_tokens: int | None = None
    temperature: float = 0.0
    seed: int = 0
    count: str = "dflash"
    ignore_eos: bool = False
    limit: int | None = None
    ddtree_budget: int = DEFAULT_BUDGET
    device: str = "cpu"
    json_path: str | None = None
    strict: bool = False
    plot_path: str | None = None
    compare_path: str | None = None


def run_eval(req: EvalRequest, *, say: t.Callable[[str], None], note: t.Callable[[str], None]) -> None:
    """Run `dflash eval`: the report's lines to ``say`` (stdout), progress to ``note`` (stderr); raises
    ``Failed`` under ``strict`` when an output differs from plain decoding."""
    max_new_tokens = req.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = 2048 if req.suite_spec else 64
    check_max_new(max_new_tokens)  # said before loading anything
    specs = None
    if req.suite_spec is not None:  # said before loading anything
        if req.plot_path:
            raise suites.SuiteError("--plot draws one report: give --prompts, not --suite")
        specs = suites.parse_suites(req.suite_spec, req.suite_dir)
    elif req.suite_dir is not None:
        raise suites.SuiteError("--suite-dir goes with --suite")
    before = None
    if req.compare_path and not req.plot_path:
        raise BadOption("--compare", "needs --plot FILE")
    if req.json_path:  # said before the (long) eval, not after it
        outputs.check_out(req.json_path, what="eval: --json", kind="file")
    if req.plot_path:  # said before the (long) eval, not after it
        eval_plot.check_out(req.plot_path)
        eval_plot.require_matplotlib()
        before = eval_plot.load_report(req.compare_path) if req.compare_path else None

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars are noise in a report

    if req.device != "cpu" and not torch.cuda.is_available():
        raise BadOption("--device", f"{req.device} asked for, but this torch has no CUDA device")
    s = load_setup(
        drafter=req.drafter_path,
        untrained=req.untrained,
        config=req.config_path,
        target=req.target_path,
        prompts=req.prompts_path,
        device=req.device,
        limit=req.limit,
        chat=req.chat,
        template_kwargs=req.template_kwargs,
        max_new_tokens=max_new_tokens,
        ignore_eos=req.ignore_eos,
        suite=specs is not None,
        log=note,  # which checkpoint a folder meant (checkpoints/best)
    )
    decoding: dict[str, t.Any] = {"temperature": req.temperature, "seed": req.seed, "count": req.count}
    if specs is not None:
        suite_report = run_suites(
            s,
            specs,
            max_new_tokens=max_new_tokens,
            limit=req.limit,
            ddtree_budget=req.ddtree_budget or None,
            log=note,
            **decoding,
        )
        for line in suite_report.lines():
            say(line)
        if req.json_path:  # the report is on stdout already: a failure here loses nothing
            outputs.write_json(req.json_path, suite_report.to_json(), command="eval")
        if req.strict and not suite_report.all_equal:
            raise Failed()  # the report above says which outputs differ
        return
    if before is not None:  # said before the (long) eval, not after it
        warning = eval_plot.protocol_warning(before, s.protocol(max_new_tokens, **decoding), req.compare_path or "")
        if warning:
            note(warning)
    report = evaluate(
        s.target,
        s.drafter,
        s.prompts,
        max_new_tokens=max_new_tokens,
        drafter_name=s.drafter_name,
        untrained=s.untrained,
        step=s.step,
        target_name=s.target_name,
        prompts_name=s.prompts_name,
        ddtree_budget=req.ddtree_budget or None,
        stop_token_ids=s.stop_token_ids,
        protocol=s.prompt_protocol,
        tool_call_prompts=s.tool_call_prompts,
        **decoding,
    )
    for line in report.lines():
        say(line)
    if req.json_path:  # the report is on stdout already: a failure here loses nothing
        outputs.write_json(req.json_path, report.to_json(), command="eval")
    if req.plot_path:
        eval_plot.draw(req.plot_path, [before, report.to_json()] if before else [report.to_json()])
        say(f"plot: {req.plot_path}")
    if req.strict and not report.all_equal:
        raise Failed()  # the report above says which outputs differ


__all__ = ["BadOption", "EvalRequest", "run_eval"]
