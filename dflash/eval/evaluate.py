"""How many tokens a drafter saves: ``dflash eval``, exact greedy speculative decoding on held-out prompts.

For every prompt the target decodes ``max_new_tokens`` tokens greedily WITH the drafter
(``dflash.eval.spec_decode``: one target forward verifies a drafted block) and once more WITHOUT it
(one forward per token). Reported, as in z-lab's benchmark:

- ``tau``: mean over prompts of the prompt's mean(accepted + 1): tokens per target forward;
- ``accept_histogram[k]``: target steps that accepted k drafted tokens, k = 0 .. B-1 (a block of B
  carries the last verified token and B-1 drafts, so accepted + 1 runs 1 .. B);
- ``position_acceptance[k-1]``: share of steps whose draft k was accepted, among steps that drafted k;
- ``tool_call_tau``: the same mean over the chat prompts whose reference answer (the record's first
  assistant turn) starts with a tool call (``starts_with_tool_call``): agentic traffic, where drafters
  lose the most, on its own;
- ``target_equal``: prompts whose output is token for token the target's plain greedy output (must be
  all: speculative decoding never changes what the target says); ``outputs`` holds those tokens;
- ``topk_recall[K][k-1]``: share of drafted positions k whose true token (the target's greedy token
  there) is among the drafter's top K at that slot: how much a tree of drafts (DDTree) could win;
- ``ddtree``: the offline acceptance length of a DDTree-style draft tree under a node budget: the tree
  holds the ``budget`` likeliest prefixes under the drafter's per-slot distributions (best first, as
  DDTree builds it); one walk along the target's greedy sequence (teacher forced: it IS what decoding
  produces) accepts the longest prefix of the true continuation that is a path of the tree.

``untrained_drafter`` builds the drafter a run starts from (same config and seed as step 0 of
training), so "before" is measured the same way as "after".

The protocol (``EvalReport.protocol``) says how the figures were made, so that two reports, or a report
and a published number, are compared only when they were made the same way: raw token prompts or chat
prompts rendered with the target's chat template (its sha256 and ``chat_template_kwargs``: thinking on or
off changes acceptance a lot), the prompts file and its sha256, how many prompts, up to how many new tokens
and whether decoding stops at EOS (both the reference and the speculative decode stop at the first stop
token, which is kept), greedy (temperature 0), the block size and the dtypes.

A chat prompt is the conversation up to (not including) its first assistant turn, rendered with the
generation prompt as serving renders it: for a multi-turn record that is the system and first user turn,
as SpecForge's and z-lab's benchmarks take the first user turn. A step that reaches a stop token counts the
tokens it committed (up to and including the stop token), not drafts accepted beyond it: tau is new tokens
per target forward (z-lab's ``dflash_generate`` counts the whole accepted block of that last step).

Two counting rules (``count``; ``dflash.eval.spec_decode.step_credits``; docs/evaluation.md):

- ``"dflash"`` (the default): the decode never drafts past ``max_new_tokens`` and each step is credited
  with the tokens it put into the output (up to the budget and the first stop token);
- ``"zlab"``: z-lab's loop and count: full blocks even past the budget, one more step when only the
  anchor is left, each step credited with accepted + 1 whole (past the budget or the stop token too).
  The output is the same; tau is what z-lab's benchmark prints for it.

``temperature`` > 0 samples the target's tokens (seeded per prompt and position, ``spec_decode.Sampler``)
and keeps the drafts greedy, as z-lab's benchmark does for its T = 1 rows; ``target_equal`` then checks
the output against the target's own sampled decode with the same seed. A prompt may be deferred: a
function of the outputs so far that returns its token ids (a second turn after the target's own first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
import os
import time
import typing as t
from pathlib import Path

import torch

from dflash import inputs
from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.manifest import STATE_FILE, CheckpointError
from dflash.config import ConfigError, RunConfig, load_config, parse_config
from dflash.data.chat import Renderer, load_tokenizer, template_hash, tokenizer_hash
from dflash.dtypes import torch_dtype
from dflash.errors import DataError
from dflash.eval.prompts import (
    EvalError,
    load_prompts,
    prompt_messages,
    read_records,
    starts_with_tool_call,
    token_prompt,
)
from dflash.eval.spec_decode import (
    COUNT_RULES,
    Sampler,
    draft_tokens,
    speculative_generate,
    step_credits,
    target_greedy,
    target_sample,
)
from dflash.model import config_keys
from dflash.model.contract import ContractError
from dflash.model.drafter import DFlashDraftConfig, DFlashDraftModel
from dflash.model.target import TargetHead, TargetModel
from dflash.models import DrafterSpec, drafter_spec, initial_drafter, load_target

__all__ = [
    "MAX_NEW_TOKENS",
    "EvalError",
    "DeferredPrompt",
    "EvalReport",
    "Setup",
    "check_max_new",
    "eos_ids",
    "ddtree_accept",
    "evaluate",
    "load_prompts",
    "load_setup",
    "prompt_messages",
    "read_records",
    "starts_with_tool_call",
    "resolve_checkpoint",
    "teacher_forced_walk",
    "token_prompt",
    "untrained_drafter",
]

TOPK = (1, 2, 4, 8)
DEFAULT_BUDGET = 32
MAX_NEW_TOKENS = 2048  # the longest answers published DFlash figures decode
# a prompt made once earlier outputs are known: outputs so far (new tokens per prompt) -> token ids
DeferredPrompt = t.Callable[[t.Sequence[t.Sequence[int]]], t.Sequence[int]]


def check_max_new(n: int) -> None:
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise EvalError(f"--max-new: expected 1 to {MAX_NEW_TOKENS} new tokens, got {n}")


def resolve_checkpoint(path: str | os.PathLike[str], *, log: t.Callable[[str], None] | None = None) -> Path:
    """A checkpoint dir (``step-N``, or any folder with config.json), or under a checkpoints root or a run
    dir that holds ``checkpoints/`` the ``best`` one (held-out tau during training) when there is one, else
    the latest complete one (``checkpoint.choose``); ``log`` gets the line that says which."""
    p = Path(path).expanduser()
    chosen, note = ckpt.choose(p)
    if (chosen / "config.json").is_file():
        if note is not None and log is not None:
            log(f"--drafter: {note}")
        return chosen
    if not p.exists():
        raise EvalError(f"--drafter: {p} does not exist")
    raise EvalError(
        f"--drafter: no drafter in {p} (expected a checkpoint dir with config.json, or a folder of step-* checkpoints)"
    )


def untrained_drafter(
    config: DFlashDraftConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    init: DFlashDraftModel | None = None,
) -> DFlashDraftModel:
    """The drafter a run with this config and seed (and warm start ``init``) starts from, frozen for decoding
    (``dflash.models.initial_drafter``: training builds it the same way)."""
    model = initial_drafter(config, seed=seed, init=init)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


# --------------------------------------------------------------------------------------------
# DDTree offline


def ddtree_accept(log_probs: torch.Tensor, truth: t.Sequence[int], budget: int) -> int:
    """Accepted drafts of a best-first tree of ``budget`` nodes over per-slot ``log_probs`` [D, V]:
    the longest prefix of ``truth`` (the D true tokens after the block's first) that is a tree path.

    Nodes are prefixes scored by the sum of their slots' log-probabilities; they come out of the heap
    in decreasing score, each bringing its first child and its next sibling (so the tree is exactly
    the ``budget`` likeliest prefixes).
    """
    depth = min(log_probs.shape[0], len(truth))
    if depth == 0 or budget <= 0:
        return 0
    width = min(log_probs.shape[1], budget)
    top_lp, top_ids = log_probs[:depth].float().topk(width, dim=-1)
    lp, ids = top_lp.tolist(), top_ids.tolist()
    tree: set[tuple[int, ...]] = set()
    # heap items: (-score, prefix ranks); a prefix of ranks names the tokens ids[d][rank]
    heap: list[tuple[float, tuple[int, ...]]] = [(-lp[0][0], (0,))]
    while heap and len(tree) < budget:
        neg, ranks = heapq.heappop(heap)
        d = len(ranks) - 1
        tree.add(tuple(ids[i][r] for i, r in enumerate(ranks)))
        if d + 1 < depth:
            heapq.heappush(heap, (neg - lp[d + 1][0], (*ranks, 0)))
        if ranks[-1] + 1 < width:
            sibling = (*ranks[:-1], ranks[-1] + 1)
            heapq.heappush(heap, (neg + lp[d][ranks[-1]] - lp[d][ranks[-1] + 1], sibling))
    accepted = 0
    while accepted < depth and tuple(truth[: accepted + 1]) in tree:
        accepted += 1
    return accepted


@torch.no_grad()
def teacher_forced_walk(
    target: TargetModel,
    drafter: DFlashDraftModel,
    head: TargetHead,
    tokens: torch.Tensor,
    num_prompt: int,
    *,
    budget: int | None = None,
) -> list[int]:
    """Accepted drafts per step when decoding ``tokens`` [1, P+T] (the target's greedy output) again:
    chain drafts (``budget`` None: exactly what speculative decoding accepts) or a DDTree tree."""
    feats = t.cast(torch.Tensor, target.features(tokens.to(target.device)))
    seq = tokens[0].tolist()
    block = drafter.block_size
    device = target.device
    start = num_prompt  # the first new token is the block's given token (the prefill made it)
    out: list[int] = []
    while start + 1 < len(seq):
        verify = min(block, len(seq) - start - 1)
        drafted = verify - 1
        truth = seq[start + 1 : start + 1 + drafted]
        if drafted == 0:
            accepted = 0
        else:
            block_ids = torch.full((1, verify), drafter.mask_token_id, dtype=torch.long, device=device)
            block_ids[0, 0] = seq[start]
            hidden = drafter(
                position_ids=torch.arange(start + verify, device=device)[None],
                noise_embedding=head.embed(block_ids),
                target_hidden=feats[:, :start],
            )
            logits = drafter.engine_logits(hidden[:, 1:], head.lm_head)[0].float()
            if budget is None:
                best = draft_tokens(drafter, hidden[:, 1:], logits[None], block_ids[:, 0])[0].tolist()
                accepted = 0
                while accepted < drafted and best[accepted] == truth[accepted]:
                    accepted += 1
            else:
                accepted = ddtree_accept(torch.log_softmax(logits, dim=-1), truth, budget)
        out.append(accepted)
        start += accepted + 1
    return out


# --------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass
class EvalReport:
    drafter: str
    untrained: bool
    step: int | None
    target: str
    prompts: str
    num_prompts: int
    max_new_tokens: int
    block_size: int
    tau: float
    steps: int
    new_tokens: int
    accept_histogram: list[int]
    position_acceptance: list[float]
    target_equal: int
    mismatched_prompts: list[int]
    topk_recall: dict[str, list[float]]
    ddtree: dict[str, float] | None
    per_prompt_tau: list[float]
    outputs: list[list[int]]  # per prompt, the new tokens speculative decoding produced
    seconds: float
    protocol: dict[str, t.Any] = dataclasses.field(default_factory=dict)  # how it was measured (module doc)
    count: str = "dflash"  # the counting rule of tau and the histogram (module doc)
    # the prompts whose reference answer starts with a tool call (``starts_with_tool_call``), and their tau
    tool_call_prompts: list[int] = dataclasses.field(default_factory=list)
    tool_call_tau: float | None = None

    @property
    def all_equal(self) -> bool:
        return self.target_equal == self.num_prompts

    def to_json(self) -> dict[str, t.Any]:
        d = dataclasses.asdict(self)
        d["all_equal"] = self.all_equal
        d["num_tool_call_prompts"] = len(self.tool_call_prompts)
        return d

    def lines(self) -> list[str]:
        if self.untrained:
            name = f"untrained (step 0 of the run: the config and seed of {self.drafter})"
        else:
            name = self.drafter + (f" (step {self.step})" if self.step is not None else "")
        p = self.protocol
        each = (
            f"up to {self.max_new_tokens} new tokens each (stop at EOS)"
            if p.get("stop_at_eos")
            else f"{self.max_new_tokens} new tokens each"
        )
        out = [
            f"drafter: {name}",
            f"target:  {self.target}",
            f"prompts: {self.num_prompts} from {self.prompts}, {each}, block size {self.block_size}",
            f"tau {self.tau:.2f}  ("
            + (
                "z-lab's count: accepted + 1 per step of its loop"
                if self.count == "zlab"
                else "tokens per target forward"
            )
            + f"; {self.new_tokens} tokens in {self.steps} verify steps)",
            *(
                [
                    f"tau on tool-call prompts {self.tool_call_tau:.2f}  ({len(self.tool_call_prompts)} of "
                    f"{self.num_prompts} prompts whose reference answer starts with a tool call)"
                ]
                if self.tool_call_tau is not None
                else []
            ),
            "accepted drafts per step (0..B-1): " + " ".join(f"{k}:{n}" for k, n in enumerate(self.accept_histogram)),
            "acceptance by position (1..B-1):   " + " ".join(f"{a:.2f}" for a in self.position_acceptance),
        ]
        if p.get("prompt_format") == "chat":
            out.insert(
                3,
                f"chat template: sha256 {str(p.get('chat_template_sha256'))[:12]}, "
                f"kwargs {json.dumps(p.get('chat_template_kwargs') or {}, sort_keys=True)}",
            )
        for k, rec in self.topk_recall.items():
            out.append(f"top-{k} recall by slot:             " + " ".join(f"{r:.2f}" for r in rec))
        if self.ddtree:
            out.append(f"DDTree offline tau at {int(self.ddtree['budget'])} nodes: {self.ddtree['tau']:.2f}")
        verdict = "yes" if self.all_equal else f"NO for prompts {self.mismatched_prompts}"
        plain = (
            "plain greedy decoding"
            if not p.get("temperature")
            else f"the target's own sampling at T={p['temperature']:g} (seed {p.get('seed')})"
        )
        out.append(f"output identical to {plain}: {verdict} ({self.target_equal}/{self.num_prompts} prompts)")
        return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def protocol_of(
    base: t.Mapping[str, t.Any] | None,
    *,
    target: TargetModel,
    drafter: DFlashDraftModel,
    num_prompts: int,
    max_new_tokens: int,
    stop_token_ids: t.Sequence[int],
    temperature: float = 0.0,
    seed: int = 0,
    count: str = "dflash",
) -> dict[str, t.Any]:
    """The full protocol: the prompts' part (``base``: format, template, source; Setup makes it) and
    the decoding's."""
    out: dict[str, t.Any] = {
        "prompt_format": "raw",
        "chat_template_sha256": None,
        "chat_template_kwargs": None,
        "tokenizer_sha256": None,
        "prompts_source": None,
        "prompts_sha256": None,
    }
    out.update(base or {})
    out.update(
        {
            "num_prompts": num_prompts,
            "max_new_tokens": max_new_tokens,
            "stop_at_eos": bool(stop_token_ids),
            "stop_token_ids": sorted(set(stop_token_ids)),
            "decoding": "sampled" if temperature > 0 else "greedy",
            "temperature": float(temperature),
            "seed": seed if temperature > 0 else None,
            "count": count,
            "block_size": drafter.block_size,
            "target_dtype": _dtype_name(target.dtype),
            "drafter_dtype": _dtype_name(next(drafter.parameters()).dtype),
        }
    )
    return out


def evaluate(
    target: TargetModel,
    drafter: DFlashDraftModel,
    prompts: t.Sequence[t.Sequence[int] | DeferredPrompt],
    *,
    max_new_tokens: int = 64,
    drafter_name: str = "",
    untrained: bool = False,
    step: int | None = None,
    target_name: str = "",
    prompts_name: str = "",
    ddtree_budget: int | None = DEFAULT_BUDGET,
    progress: t.Callable[[int, int], None] | None = None,
    stop_token_ids: t.Sequence[int] = (),
    protocol: t.Mapping[str, t.Any] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    count: str = "dflash",
    tool_call_prompts: t.Sequence[int] = (),
) -> EvalReport:
    """Speculative decoding of every prompt, checked against the target alone (greedy, or sampled with
    the same seed at ``temperature`` > 0); both stop after the first of ``stop_token_ids`` (EOS).
    ``count``: the counting rule (module doc). ``tool_call_prompts``: indices of the prompts whose reference
    answer starts with a tool call; their mean tau is reported beside the overall one."""
    check_max_new(max_new_tokens)
    if count not in COUNT_RULES:
        raise EvalError(f"--count: expected one of {', '.join(COUNT_RULES)}, got {count!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EvalError(f"--temperature: expected a number >= 0, got {temperature}")
    tool_calls = sorted(set(tool_call_prompts))
    if any(not 0 <= i < len(prompts) for i in tool_calls):
        raise EvalError(f"tool-call prompts {tool_calls}: expected indices of the {len(prompts)} prompts")
    stops = list(stop_token_ids) or None
    t0 = time.monotonic()
    block = drafter.block_size
    head = target.head()
    hist = [0] * block
    drafted_at = [0] * (block - 1)
    accepted_at = [0] * (block - 1)
    recall_hits = {k: [0] * (block - 1) for k in TOPK}
    recall_seen = [0] * (block - 1)
    taus: list[float] = []
    mismatched: list[int] = []
    outputs: list[list[int]] = []
    tree_steps: list[int] = []
    steps = new_tokens = 0
    overrun = count == "zlab"  # z-lab's count needs z-lab's loop (full blocks past the budget)
    max_pos = getattr(target.model.config, "max_position_embeddings", None)
    for i, item in enumerate(prompts):
        prompt = list(item(outputs) if callable(item) else item)
        room = max_new_tokens + (block - 1 if overrun else 0)
        if isinstance(max_pos, int) and len(prompt) + room > max_pos:
            raise EvalError(
                f"prompt {i}: {len(prompt)} tokens + {room} to decode pass the target's max_position_embeddings ({max_pos})"
            )
        ids = torch.tensor([prompt], dtype=torch.long)
        sampler = Sampler(temperature, seed, stream=i) if temperature > 0 else None
        res = speculative_generate(
            target,
            drafter,
            ids,
            max_new_tokens=max_new_tokens,
            head=head,
            keep_draft_logits=True,
            stop_token_ids=stops,
            sampler=sampler,
            overrun=overrun,
        )
        if sampler is None:
            plain = target_greedy(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        else:
            plain = target_sample(target, ids, max_new_tokens=max_new_tokens, sampler=sampler, stop_token_ids=stops)
        if not torch.equal(res.tokens.cpu(), plain.cpu()):
            mismatched.append(i)
        seq = res.tokens[0].tolist()
        new = seq[res.num_prompt_tokens :]
        outputs.append(new)
        stop_at = len(new) - 1 if stops and new and new[-1] in stops else None
        credits = step_credits(res.accept_lengths, max_new=max_new_tokens, stop_at=stop_at, rule=count)
        assert len(credits) == len(res.accept_lengths), (credits, res.accept_lengths)  # the rule fits its loop
        taus.append(sum(credits) / len(credits) if credits else 0.0)
        steps += len(credits)
        new_tokens += len(new)
        for j, (start, c) in enumerate(zip(res.block_starts, credits)):
            hist[c - 1] += 1
            # acceptance by position counts inside the output, whatever the rule
            acc = min(res.accept_lengths[j], len(seq) - start - 2)
            drafted = min(block, len(seq) - start - 1) - 1 if start + 1 < len(seq) else 0
            for k in range(1, drafted + 1):
                drafted_at[k - 1] += 1
                accepted_at[k - 1] += int(acc >= k)
            if drafted <= 0:
                continue
            # every step that drafted kept its logits (a last step of one verified token drafts none)
            logits = res.draft_logits[j] if res.draft_logits is not None and j < len(res.draft_logits) else None
            if logits is None:
                continue
            for k in range(1, min(logits.shape[0], len(seq) - start - 1) + 1):
                truth = seq[start + k]
                recall_seen[k - 1] += 1
                order = logits[k - 1].topk(max(TOPK)).indices.tolist()
                for K in TOPK:
                    recall_hits[K][k - 1] += int(truth in order[:K])
        if ddtree_budget:
            tree_steps.extend(
                teacher_forced_walk(target, drafter, head, res.tokens, res.num_prompt_tokens, budget=ddtree_budget)
            )
        if progress is not None:
            progress(i + 1, len(prompts))
    ddtree = None
    if ddtree_budget and tree_steps:
        ddtree = {"budget": float(ddtree_budget), "tau": sum(a + 1 for a in tree_steps) / len(tree_steps)}
    return EvalReport(
        drafter=drafter_name,
        untrained=untrained,
        step=step,
        target=target_name,
        prompts=prompts_name,
        num_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        block_size=block,
        tau=sum(taus) / len(taus) if taus else math.nan,
        steps=steps,
        new_tokens=new_tokens,
        accept_histogram=hist,
        position_acceptance=[a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
        target_equal=len(prompts) - len(mismatched),
        mismatched_prompts=mismatched,
        topk_recall={str(K): [h / s if s else 0.0 for h, s in zip(recall_hits[K], recall_seen)] for K in TOPK},
        ddtree=ddtree,
        per_prompt_tau=[round(x, 4) for x in taus],
        outputs=outputs,
        seconds=round(time.monotonic() - t0, 2),
        protocol=protocol_of(
            protocol if protocol is not None else {"prompts_source": prompts_name or None},
            target=target,
            drafter=drafter,
            num_prompts=len(prompts),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops or [],
            temperature=temperature,
            seed=seed,
            count=count,
        ),
        count=count,
        tool_call_prompts=tool_calls,
        tool_call_tau=sum(taus[i] for i in tool_calls) / len(tool_calls) if tool_calls else None,
    )


# --------------------------------------------------------------------------------------------
# Finding what to evaluate (``dflash eval``)


@dataclasses.dataclass
class Setup:
    target: TargetModel
    drafter: DFlashDraftModel
    prompts: list[list[int]]
    drafter_name: str
    target_name: str
    prompts_name: str
    step: int | None
    untrained: bool
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_protocol: dict[str, t.Any] = dataclasses.field(default_factory=dict)  # the prompts' part
    renderer: Renderer | None = None  # --chat / --suite: the target's tokenizer and chat template
    tool_call_prompts: list[int] = dataclasses.field(default_factory=list)  # answers that start with a call

    def protocol(self, max_new_tokens: int, **decoding: t.Any) -> dict[str, t.Any]:
        """The protocol the report of this setup will carry (known before decoding); ``decoding``:
        ``temperature``, ``seed``, ``count`` as ``evaluate`` takes them."""
        return protocol_of(
            self.prompt_protocol,
            target=self.target,
            drafter=self.drafter,
            num_prompts=len(self.prompts),
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            **decoding,
        )


def eos_ids(*sources: t.Any) -> list[int]:
    """Stop tokens as serving stops: the tokenizer's EOS and the model's (generation) config eos_token_id
    (an int or a list: Qwen3 names <|im_end|> and <|endoftext|>)."""
    out: set[int] = set()
    for src in sources:
        ids = getattr(src, "eos_token_id", None)
        for i in ids if isinstance(ids, (list, tuple)) else [ids]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0:
                out.add(i)
    return sorted(out)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_setup(
    *,
    drafter: str | None,
    untrained: bool = False,
    config: str | None = None,
    target: str | None = None,
    prompts: str | None = None,
    device: str = "cpu",
    limit: int | None = None,
    chat: bool = False,
    template_kwargs: str | None = None,
    max_new_tokens: int | None = None,
    ignore_eos: bool = False,
    suite: bool = False,
    log: t.Callable[[str], None] | None = None,
) -> Setup:
    """Resolve the CLI's choices: the drafter (a checkpoint, or the untrained one of a run config), the
    target (``--target``, else the one the run trained against), the prompts (``--prompts``, else the
    ``eval.jsonl`` that make-tiny wrote next to the training data). With ``chat`` the prompts are
    rendered with the chat template of the run's tokenizer (``data.tokenizer``, else the target's) and
    ``template_kwargs`` (JSON; default: the run's ``data.chat_template_kwargs``). Decoding stops at EOS
    unless ``ignore_eos``. With ``suite`` the prompts come from suites (``dflash.eval.suite_report``): no
    prompt file is read, and the chat renderer is made as with ``chat``."""
    if max_new_tokens is not None:
        check_max_new(max_new_tokens)
    if suite and prompts is not None:
        raise EvalError("--suite and --prompts: give one of them")
    chat = chat or suite
    if template_kwargs is not None and not chat:
        raise EvalError("--template-kwargs goes with --chat or --suite")
    if drafter is None and not (untrained and config):
        raise EvalError("give --drafter CHECKPOINT, or --untrained with --config RUN.toml")
    run: RunConfig | None = load_config(config) if config else None
    ckpt_dir = resolve_checkpoint(drafter, log=log) if drafter else None
    step = None
    if ckpt_dir is not None:
        try:
            state = torch.load(ckpt_dir / STATE_FILE, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            state = None  # a published drafter folder: weights and config only
        except Exception as e:  # torch raises several unpickling errors
            raise EvalError(f"--drafter: cannot read {ckpt_dir / STATE_FILE}: {e}") from e
        if state is not None:
            step = int(state.get("step", 0))
            saved = (state.get("trainer_state") or {}).get("config")
            if run is None and saved is not None:  # the run's config, parsed as the run parsed it
                try:
                    run = parse_config(saved)
                except ConfigError as e:
                    raise EvalError(f"--drafter: the run config saved in {ckpt_dir / STATE_FILE}: {e}") from None

    draft_cfg: DFlashDraftConfig | None = None
    if ckpt_dir is not None:
        try:  # a published folder's config.json is a user's file: bounded JSON, every field checked
            config_keys.check_folder(ckpt_dir)  # a key we do not compute as the engines do: refused, not ignored
            draft_cfg = ckpt.read_config(ckpt_dir)
        except ContractError as e:
            raise EvalError(f"--drafter: {ckpt_dir}: {e}") from None
        except CheckpointError as e:
            raise EvalError(f"--drafter: {e}") from None

    # the target: the run's (dflash.models, as training builds it), reading the layers the drafter reads
    layer_ids = draft_cfg.target_layer_ids if draft_cfg is not None else None
    path = target or (run.target.path if run is not None else None)
    try:
        if path is not None and not Path(path).is_dir():
            where = "--target" if target else "the run's target.path"
            raise EvalError(
                f"{where}: {path} is not a folder (a local checkpoint: config.json + weights); give --target PATH"
            )
        if run is not None:
            tm = load_target(run, device, path=target, layer_ids=layer_ids)
        elif path is not None:  # a published drafter folder: no run config
            dtype = torch.float32 if device == "cpu" else torch.bfloat16
            tm = TargetModel.from_pretrained(path, dtype=dtype, device=device, layer_ids=layer_ids)
        else:
            raise EvalError("no target: give --target PATH (the run config names none)")
    except (OSError, ValueError) as e:
        if isinstance(e, EvalError):
            raise
        raise EvalError(f"--target: cannot load a model from {path}: {e}") from e
    if path is not None:
        target_name = path
    else:
        assert run is not None and run.target.tiny is not None
        target_name = f"tiny random-init Qwen3 (seed {run.target.tiny.seed})"

    # the drafter
    spec: DrafterSpec | None = None
    if draft_cfg is None:
        assert run is not None
        spec = drafter_spec(run, tm)  # the MASK id and drafter config of the run's step 0 (dflash.models)
        draft_cfg = spec.config
    if untrained:
        ddtype = torch_dtype(run.drafter.dtype) if run is not None else torch.float32
        seed = run.seed if run is not None else 0
        init = spec.init if spec is not None else None
        model = untrained_drafter(draft_cfg, seed=seed, dtype=ddtype, device=device, init=init)
        if init is None and model.lm_head is not None:
            raise EvalError(
                "--untrained: drafter.draft_vocab_size: the draft vocabulary is counted over the training data "
                "when the run starts; evaluate one of its checkpoints"
            )
        drafter_name = str(ckpt_dir or config)
    else:
        assert ckpt_dir is not None
        try:
            model = ckpt.load_drafter(ckpt_dir, device=device)
        except CheckpointError as e:
            raise EvalError(f"--drafter: {e}") from e
        drafter_name = str(ckpt_dir)
    if list(model.target_layer_ids) != list(tm.layer_ids) or model.config.vocab_size != tm.vocab_size:
        raise EvalError(
            f"--drafter: it reads target layers {model.target_layer_ids} of a {model.config.vocab_size}-token "
            f"vocabulary; this target has layers {tm.layer_ids} and {tm.vocab_size} tokens"
        )
    target_hidden = int(tm.model.config.hidden_size)
    if model.config.hidden_size != target_hidden or model.fc.in_features != len(tm.layer_ids) * target_hidden:
        # caught here, before decoding, instead of a size-mismatch traceback in the first forward
        raise EvalError(
            f"--drafter: its hidden size is {model.config.hidden_size} (fc reads {model.fc.in_features} "
            f"features); this target's is {target_hidden} ({len(tm.layer_ids)} layers x {target_hidden}): "
            "a drafter trained for another target"
        )

    # the prompts
    if prompts is None and not suite:
        data_path = run.data.path if run is not None else None
        if not data_path:
            raise EvalError("give --prompts FILE (no run config to find eval.jsonl next to the training data)")
        prompts = str(Path(data_path).parent / "eval.jsonl")
        if not Path(prompts).is_file():
            raise EvalError(f"give --prompts FILE: there is no {prompts} next to the training data")
    renderer = None
    proto: dict[str, t.Any] = {"prompt_format": "chat" if chat else "raw"}
    sources: list[t.Any] = [tm.model.config, getattr(tm.model, "generation_config", None)]
    if chat:
        renderer = _renderer(run, path, template_kwargs)
        proto.update(_chat_protocol(renderer))
        sources.append(renderer.tokenizer)
    if prompts is None:  # --suite: its prompts are rendered as it runs (dflash.eval.suite_report)
        stops = [] if ignore_eos else eos_ids(*sources)
        return Setup(tm, model, [], drafter_name, target_name, "", step, untrained, stops, proto, renderer)
    tool_call_at: list[int] = []
    loaded = load_prompts(prompts, limit=limit, vocab_size=tm.vocab_size, renderer=renderer, tool_call_at=tool_call_at)
    proto.update(prompts_source=str(Path(prompts).resolve()), prompts_sha256=_sha256_file(prompts))
    stops = [] if ignore_eos else eos_ids(*sources)
    if max_new_tokens is not None:  # said now, not as a RoPE/cache error (or silent nonsense) mid-decode
        longest = max(len(p) for p in loaded)
        limit_pos = getattr(tm.model.config, "max_position_embeddings", None)
        if isinstance(limit_pos, int) and longest + max_new_tokens > limit_pos:
            raise EvalError(
                f"--max-new: the longest prompt has {longest} tokens; {longest} + {max_new_tokens} passes "
                f"the target's max_position_embeddings ({limit_pos})"
            )
    return Setup(
        tm,
        model,
        loaded,
        drafter_name,
        target_name,
        str(prompts),
        step,
        untrained,
        stops,
        proto,
        renderer,
        tool_call_at,
    )


def _renderer(run: RunConfig | None, target_path: str | None, template_kwargs: str | None) -> Renderer:
    """``--chat``: the run's tokenizer and chat template with the serving kwargs (one line when missing)."""
    where = (run.data.tokenizer if run is not None else None) or target_path
    if not where:
        raise EvalError("--chat: no tokenizer: the target is not a folder; set data.tokenizer in the run config")
    try:
        tok = load_tokenizer(str(where))
    except DataError as e:
        raise EvalError(f"--chat: {e}") from None
    if not getattr(tok, "chat_template", None):
        raise EvalError(f"--chat: the tokenizer in {where} has no chat template")
    if template_kwargs is None:
        kwargs = dict(run.data.chat_template_kwargs if run is not None else {})
    else:
        try:
            kwargs = inputs.loads(template_kwargs)
        except inputs.JsonProblem as e:
            raise EvalError(f"--template-kwargs: {e}") from None
        if not isinstance(kwargs, dict):
            raise EvalError("--template-kwargs: expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    return Renderer(tok, kwargs)


def _chat_protocol(renderer: Renderer) -> dict[str, t.Any]:
    return {
        "chat_template_sha256": template_hash(renderer.tokenizer),
        "chat_template_kwargs": renderer.kwargs,
        "tokenizer_sha256": tokenizer_hash(renderer.tokenizer),
    }
