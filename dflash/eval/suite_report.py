"""``dflash eval --suite``: tau on the published tables' suites, side by side with the published figure.

Each suite (``dflash.eval.suites``) is rendered with the target's chat template and the configured template
kwargs (thinking on or off as the run trained), decoded by ``dflash.eval.evaluate.evaluate`` (up to
``max_new_tokens``, stop at EOS, greedy or seeded sampling, either counting rule), and reported with the
published tau of the same target, block size and temperature where one is known (``dflash.eval.published``),
with what else differs from how it was measured. A multi-turn suite (mt-bench) decodes every turn: turn 2
is rendered after the target's own answer to turn 1 (its text, special tokens dropped, as z-lab's
benchmark appends it); every turn is one prompt of the suite's tau.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing as t

from dflash.data.chat import BadRecord, Renderer
from dflash.eval import published, suites
from dflash.eval.evaluate import DeferredPrompt, EvalError, EvalReport, Setup, evaluate

__all__ = ["SuiteReport", "SuiteResult", "run_suites", "suite_prompts"]


@dataclasses.dataclass
class SuiteResult:
    name: str
    source: str  # the hub dataset, or the local path it was read from
    conversations: int
    report: EvalReport
    published: dict[str, t.Any] | None  # tau, drafter, source, differences; None: no figure known

    def to_json(self) -> dict[str, t.Any]:
        return {
            "suite": self.name,
            "source": self.source,
            "conversations": self.conversations,
            "prompts": self.report.num_prompts,
            "tau": self.report.tau,
            "published": self.published,
            "report": self.report.to_json(),
        }


@dataclasses.dataclass
class SuiteReport:
    drafter: str
    step: int | None
    target: str
    published_target: str | None  # "Qwen/Qwen3-8B" when the target is one the tables measured
    block_size: int
    max_new_tokens: int
    temperature: float
    seed: int | None
    count: str
    chat_template_kwargs: dict[str, t.Any]
    results: list[SuiteResult]

    @property
    def all_equal(self) -> bool:
        return all(r.report.all_equal for r in self.results)

    def to_json(self) -> dict[str, t.Any]:
        d = dataclasses.asdict(self)
        d["results"] = [r.to_json() for r in self.results]
        d["all_equal"] = self.all_equal
        return d

    def lines(self) -> list[str]:
        decoding = "greedy (T=0)" if not self.temperature else f"sampled at T={self.temperature:g} (seed {self.seed})"
        rule = (
            "z-lab's (accepted + 1 per step of its loop)" if self.count == "zlab" else "dflash's (tokens in the output)"
        )
        who = self.drafter + (f" (step {self.step})" if self.step is not None else "")
        out = [
            f"drafter: {who}",
            f"target:  {self.target}"
            + (f" (published target {self.published_target})" if self.published_target else ""),
            f"decoding: {decoding}, up to {self.max_new_tokens} new tokens (stop at EOS), block size "
            f"{self.block_size}, chat template kwargs {json.dumps(self.chat_template_kwargs, sort_keys=True)}; "
            f"tau counted {rule}",
        ]
        shown = any(r.published for r in self.results)
        head = f"{'suite':<14}{'prompts':>9}{'tau':>7}" + (f"{'published':>11}" if shown else "")
        out.append(head)
        for r in self.results:
            n = (
                f"{r.conversations}"
                if r.report.num_prompts == r.conversations
                else f"{r.conversations}x{r.report.num_prompts // max(r.conversations, 1)}"
            )
            row = f"{r.name:<14}{n:>9}{r.report.tau:>7.2f}"
            if r.published:
                row += f"{r.published['tau']:>11.2f}"
                if r.published["differences"]:
                    row += "   (" + "; ".join(r.published["differences"]) + ")"
            out.append(row)
        sources = {r.published["source"] for r in self.results if r.published}
        drafters = {r.published["drafter"] for r in self.results if r.published}
        if sources:
            out.append(f"published: {', '.join(sorted(drafters))}, {', '.join(sorted(sources))}")
        elif self.published_target is None:
            out.append(
                "published: no published tau for this target (the tables measured Qwen/Qwen3-8B and Qwen/Qwen3-4B)"
            )
        else:
            out.append(
                f"published: none for {self.published_target} at block size {self.block_size} and "
                f"T={self.temperature:g} (the tables: block size 16, T=0 and T=1)"
            )
        bad = [f"{r.name} {r.report.mismatched_prompts}" for r in self.results if not r.report.all_equal]
        plain = "plain greedy decoding" if not self.temperature else "the target's own sampling with the same seed"
        out.append(f"output identical to {plain}: " + ("yes" if not bad else "NO for " + ", ".join(bad)))
        return out


def suite_prompts(
    convs: list[list[str]], renderer: Renderer, vocab_size: int, name: str
) -> list[t.Sequence[int] | DeferredPrompt]:
    """One prompt per turn, in order; turn j > 1 after the target's own answers (the outputs so far)."""

    def ids(messages: list[dict[str, str]]) -> list[int]:
        try:
            out = renderer.prompt_ids(messages)
        except BadRecord as e:
            raise EvalError(f"suite {name}: {e}") from None
        if out and max(out) >= vocab_size:
            raise EvalError(f"suite {name}: token {max(out)} is outside the target vocabulary ({vocab_size})")
        return out

    prompts: list[t.Sequence[int] | DeferredPrompt] = []
    for turns in convs:
        first = len(prompts)
        for j, user in enumerate(turns):
            if j == 0:
                prompts.append(ids([{"role": "user", "content": user}]))
                continue

            def later(
                outputs: t.Sequence[t.Sequence[int]], turns: list[str] = turns, j: int = j, first: int = first
            ) -> list[int]:
                messages: list[dict[str, str]] = []
                for k in range(j):
                    answer = renderer.tokenizer.decode(list(outputs[first + k]), skip_special_tokens=True)
                    messages += [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": answer}]
                return ids([*messages, {"role": "user", "content": turns[j]}])

            prompts.append(later)
    return prompts


def _differences(
    name: str, report: EvalReport, conversations: int, kwargs: t.Mapping[str, t.Any], count: str
) -> list[str]:
    p = report.protocol
    out = []
    if kwargs.get("enable_thinking") is not False:
        out.append("thinking not off (published: enable_thinking=False)")
    if report.max_new_tokens != published.PROTOCOL["max_new_tokens"]:
        out.append(f"max new {report.max_new_tokens} (published: 2048)")
    want = published.SAMPLES.get(name)
    if want is not None and conversations != want:
        out.append(f"{conversations} of {want} samples")
    if count != published.PROTOCOL["count"]:
        out.append("dflash count (published: z-lab's, --count zlab)")
    if not p.get("stop_at_eos"):
        out.append("no stop at EOS")
    return out


def run_suites(
    setup: Setup,
    specs: t.Sequence[tuple[str, str | None]],
    *,
    max_new_tokens: int,
    limit: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    count: str = "dflash",
    ddtree_budget: int | None = None,
    log: t.Callable[[str], None] | None = None,
) -> SuiteReport:
    """Every suite of ``specs`` (``suites.parse_suites``) through ``evaluate``; loads them all first, so a
    missing dataset is said before any decoding."""
    renderer = setup.renderer
    if renderer is None:
        raise EvalError("--suite needs the target's tokenizer and chat template")
    target_path = setup.target_name
    pub_target = published.identify_target(target_path, setup.target.model.config)
    loaded = [(name, path, suites.load(name, path, limit=limit)) for name, path in specs]
    results = []
    for name, path, convs in loaded:
        prompts = suite_prompts(convs, renderer, setup.target.vocab_size, name)
        source = path or suites.SUITES[name].repo
        if log is not None:
            log(f"suite {name}: {len(convs)} conversations, {len(prompts)} prompts from {source}")
        proto = dict(setup.prompt_protocol)
        proto.update(
            prompts_source=f"suite {name}: {source}",
            prompts_sha256=hashlib.sha256(json.dumps(convs).encode()).hexdigest(),
            suite=name,
        )
        report = evaluate(
            setup.target,
            setup.drafter,
            prompts,
            max_new_tokens=max_new_tokens,
            drafter_name=setup.drafter_name,
            untrained=setup.untrained,
            step=setup.step,
            target_name=setup.target_name,
            prompts_name=f"suite {name} ({source})",
            ddtree_budget=ddtree_budget,
            stop_token_ids=setup.stop_token_ids,
            protocol=proto,
            temperature=temperature,
            seed=seed,
            count=count,
        )
        fig = published.figure(pub_target, setup.drafter.block_size, temperature, name)
        pub = None
        if fig is not None:
            tau, row = fig
            pub = {
                "tau": tau,
                "drafter": row.drafter,
                "source": row.source,
                "differences": _differences(name, report, len(convs), renderer.kwargs, count),
            }
        results.append(SuiteResult(name, source, len(convs), report, pub))
    return SuiteReport(
        drafter=setup.drafter_name,
        step=setup.step,
        target=setup.target_name,
        published_target=pub_target,
        block_size=setup.drafter.block_size,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        seed=seed if temperature > 0 else None,
        count=count,
        chat_template_kwargs=dict(renderer.kwargs),
        results=results,
    )
