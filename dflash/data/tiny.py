"""A tiny chat target with something to say, and a chat corpus for it to rewrite: ``dflash make-tiny``.

A random-init transformer's greedy output is noise that no small drafter can predict, so the demo's
target first learns a small synthetic language, in a chat template, as a real chat model would:

1. the language: ``phrases`` fixed phrases of 3..7 words over a pool of ``words`` words (a word sits in
   several phrases, so the context, not only the last token, says what comes next); after a phrase
   comes one of four others, with probabilities .40/.25/.20/.15 (the likeliest ones chain all phrases
   into one long cycle, so greedy text does not loop after a few words). Every ``terminal_every``-th
   phrase of that cycle is terminal: an assistant turn ends (EOS) right after the first terminal
   phrase it completes, so a greedy answer is up to ``terminal_every`` phrases long;
2. the tokenizer: one token per word (``w0`` .. ``w199``, ids 0..199: token ids ARE the words), then
   the chat tokens ``<|im_start|>`` ``<|im_end|>`` (end of turn = EOS) ``<|pad|>`` ``<unk>`` ``user``
   ``assistant`` ``system`` and the tool tags ``<tools>`` ``<tool_call>`` ``<tool_response>`` (and their
   closing ones); a ChatML-like Jinja template (``add_generation_prompt`` supported; tools in Qwen3's
   shape, ``CHAT_TEMPLATE``), saved with the target so ``AutoTokenizer.from_pretrained(target)`` loads it;
3. the target: a Qwen3 of 6 layers and width 64, trained for ``target_steps`` steps on conversations
   in the template (a user turn is running text of the language; the assistant continues it until
   a terminal phrase, then EOS); with ``tool_share`` > 0 that share of them lists a tool, and each user
   turn is answered with a call of it (``Language.tool_turn``), the tool's result, then the answer;
4. the data: ``chat.jsonl``, a raw multi-turn corpus (OpenAI ``messages``) whose assistant turns are
   what a person wrote, not what the target says: ``dflash regen`` has the target rewrite them, and
   ``dflash prepare-data`` renders them into a token store (the real recipe's way); ``train.jsonl``,
   one-turn conversations already rendered with the target's own greedy answers (the short path, for
   ``dflash train`` straight from a checkout); held-out eval prompts (none of them is a user turn of
   either), rendered (``eval.jsonl``) and as chat messages (``eval-chat.jsonl``). With ``tool_share``
   the same share of each lists a tool; an eval record of one holds its reference answer, the call, so
   that ``dflash eval --chat`` reports tau on tool-call prompts on their own.

Rows ``words + 13 .. vocab_size - 1`` of the target's vocabulary are never used (like the padded rows
of a real vocabulary); the last one is the drafter's MASK.

Layout of the output directory (written to a temp dir, then renamed; same seed -> same bytes)::

    target/          config.json, generation_config.json, model.safetensors, tokenizer.json,
                     tokenizer_config.json, chat_template.jinja (from_pretrained, local)
    chat.jsonl       {"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}  to regenerate
    train.jsonl      {"input_ids": [...], "loss_mask": [0, ..., 1, ...]}   the target's own answers
    eval.jsonl       {"input_ids": [...]}     held-out prompts, rendered with the generation prompt
    eval-chat.jsonl  {"messages": [{"role": "user", "content": "..."}]}   the same prompts as chat
    language.json    the phrases, what follows each, the terminal phrases (to read, or to check)
    tiny.json        the manifest, written last: spec, the target's final loss, sha256 of every file
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import typing as t
from pathlib import Path

import torch

from dflash import inputs
from dflash.errors import InputError

# transformers and tokenizers (and dflash.model.target, which imports transformers) are imported inside the functions
# that use them: seconds to import, which a make-tiny whose output is already there does not pay.

__all__ = [
    "ChatTokens",
    "Language",
    "TinyError",
    "TinySpec",
    "greedy_batch",
    "load_manifest",
    "make_tiny",
    "save_tokenizer",
]

MANIFEST = "tiny.json"
FORMAT = "dflash-tiny/2"
SUCCESSOR_PROBS = (0.40, 0.25, 0.20, 0.15)
# the chat tokens, after the words, in this order (ids words, words + 1, ...); the tool tags come last, so
# the ids of the others are those of a target made before them
CHAT_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<unk>",
    "user",
    "assistant",
    "system",
    "<tools>",
    "</tools>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# ChatML-like, with tools in Qwen3's shape: the record's tools in a system turn between <tools> tags, a call
# as <tool_call> NAME ARGUMENT-VALUES </tool_call> (words: the tokenizer has no JSON punctuation), tool
# results as a user turn of <tool_response> blocks. Without tools and tool turns it writes what plain ChatML
# writes. The newlines are for the eye (the tokenizer splits on whitespace, so they are no tokens).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}<tools>{% for tool in tools %} {{ tool['function']['name'] }}{% if tool['function']['description'] %}"
    " {{ tool['function']['description'] }}{% endif %}{% endfor %} </tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response> {{ message['content'] }} </tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}{% if message['content'] or not loop.first %}\n{% endif %}"
    "<tool_call> {{ call['function']['name'] }}"
    "{% for value in call['function']['arguments'].values() %} {{ value }}{% endfor %} </tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_ARGUMENT = "text"  # a tool's one parameter: the words it is called with


class TinyError(InputError, ValueError):
    """make-tiny cannot do what it was asked (a bad spec value, an output dir that is not ours)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinySpec:
    """Everything that decides the output; the manifest records it, so a rerun can tell it is done."""

    seed: int = 0
    vocab_size: int = 256  # embedding rows; the last is the drafter's MASK
    words: int = 200  # the language uses ids 0..words-1; the chat tokens follow
    phrases: int = 64
    # every n-th phrase of the greedy cycle ends an assistant turn: answers average ~80 tokens, long enough
    # that the short last block before EOS does not decide tau (at 24: ~45 tokens, tau 5.5 instead of 6.4)
    terminal_every: int = 32
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    target_steps: int = 300  # at 150 the target ended only 2 of 3 answers with EOS; drafting it was harder
    target_batch: int = 32
    target_seq: int = 96
    target_lr: float = 3e-3
    train_samples: int = 512  # train.jsonl: one-turn conversations with the target's greedy answers
    conversations: int = 768  # chat.jsonl: raw conversations of 1..max_turns turns
    max_turns: int = 2
    eval_prompts: int = 32
    prompt_min: int = 8  # words in a user turn
    prompt_max: int = 24
    response_len: int = 176  # tokens of a greedy answer at most (it ends at EOS before, normally)
    gen_batch: int = 128
    threads: int = 2  # torch threads while building: fixed, so the same seed gives the same bytes
    # share of conversations (the target's training text, chat.jsonl, train.jsonl, the eval prompts) that list
    # a tool: each user turn is answered with a call, then the tool's result, then the answer (Language.tool_turn)
    tool_share: float = 0.0

    def check(self) -> None:
        def at_least(name: str, low: int) -> None:
            value = getattr(self, name)
            if value < low:
                raise TinyError(f"{name}: must be >= {low}, got {value}")

        for name in (
            "phrases",
            "target_batch",
            "train_samples",
            "conversations",
            "max_turns",
            "eval_prompts",
            "gen_batch",
            "threads",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "terminal_every",
        ):
            at_least(name, 1)
        at_least("target_steps", 0)
        at_least("words", 8)
        at_least("num_layers", 4)  # DFlash features come from layers 1..L-3
        at_least("prompt_min", 2)
        at_least("response_len", 2)
        at_least("target_seq", 8)
        used = self.words + len(CHAT_TOKENS)
        if self.vocab_size <= used:
            raise TinyError(
                f"vocab_size: must exceed words + {len(CHAT_TOKENS)} chat tokens ({used}) so that "
                f"unused rows (and MASK) exist, got {self.vocab_size}"
            )
        if self.prompt_max < self.prompt_min:
            raise TinyError(f"prompt_max: must be >= prompt_min ({self.prompt_min}), got {self.prompt_max}")
        if self.num_heads % self.num_kv_heads:
            raise TinyError(f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.target_lr <= 0:
            raise TinyError(f"target_lr: must be > 0, got {self.target_lr}")
        if not 0.0 <= self.tool_share <= 1.0:
            raise TinyError(f"tool_share: must be between 0 and 1, got {self.tool_share}")

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def chat(self) -> ChatTokens:
        return ChatTokens(self.words)

    def to_dict(self) -> dict[str, t.Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ChatTokens:
    """The ids of the chat tokens, which follow the words."""

    words: int

    @property
    def im_start(self) -> int:
        return self.words

    @property
    def eos(self) -> int:  # <|im_end|>: the end of a turn
        return self.words + 1

    @property
    def pad(self) -> int:
        return self.words + 2

    @property
    def role(self) -> dict[str, int]:
        return {"user": self.words + 4, "assistant": self.words + 5, "system": self.words + 6}

    def turn(self, role: str, content: t.Sequence[int]) -> list[int]:
        """One rendered turn: what the template writes for it, as token ids."""
        return [self.im_start, self.role[role], *content, self.eos]

    def prompt(self, user: t.Sequence[int]) -> list[int]:
        """A user turn and the generation prompt (``add_generation_prompt=True``)."""
        return [*self.turn("user", user), self.im_start, self.role["assistant"]]

    def tag(self, name: str) -> int:
        """A tool tag's id (``<tools>``, ``</tool_call>``, ...)."""
        return self.words + CHAT_TOKENS.index(name)

    def tools(self, tool: Tool) -> list[int]:
        """The system turn the template writes for a record's one tool."""
        head = [self.im_start, self.role["system"], self.tag("<tools>"), tool.name]
        return [*head, *tool.description, self.tag("</tools>"), self.eos]

    def call(self, tool: Tool, args: t.Sequence[int]) -> list[int]:
        """An assistant answer that is a tool call, with its end of turn."""
        return [self.tag("<tool_call>"), tool.name, *args, self.tag("</tool_call>"), self.eos]

    def response(self, result: t.Sequence[int]) -> list[int]:
        """A tool result (a user turn of one <tool_response> block) and the generation prompt."""
        block = [self.tag("<tool_response>"), *result, self.tag("</tool_response>")]
        return [*self.turn("user", block), self.im_start, self.role["assistant"]]


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool of the language: a word for its name, running text for its description."""

    name: int
    description: tuple[int, ...]

    def to_json(self) -> dict[str, t.Any]:
        """As a record lists it (OpenAI's shape)."""
        params = {"type": "object", "properties": {TOOL_ARGUMENT: {"type": "string"}}, "required": [TOOL_ARGUMENT]}
        return {
            "type": "function",
            "function": {"name": f"w{self.name}", "description": text(self.description), "parameters": params},
        }

    def call_json(self, args: t.Sequence[int], call_id: str) -> dict[str, t.Any]:
        """A call of it, as an assistant turn's ``tool_calls`` holds one (arguments as JSON text, OpenAI's wire form)."""
        fn = {"name": f"w{self.name}", "arguments": json.dumps({TOOL_ARGUMENT: text(args)})}
        return {"id": call_id, "type": "function", "function": fn}


def text(ids: t.Iterable[int]) -> str:
    """Words as the text the tokenizer reads back into the same ids."""
    return " ".join(f"w{i}" for i in ids)


def save_tokenizer(spec: TinySpec, path: Path) -> None:
    """The tokenizer of the language (WordLevel: one token per word, split on whitespace) + the template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(spec.words)}
    vocab.update({name: spec.words + k for k, name in enumerate(CHAT_TOKENS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(path)


# --------------------------------------------------------------------------------------------
# The language


@dataclasses.dataclass(frozen=True)
class Language:
    """Phrases of word ids, the four phrases that may follow each one (most likely first), and the
    terminal phrases (an assistant turn ends after the first one it completes)."""

    phrases: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]
    terminals: frozenset[int] = frozenset()

    @classmethod
    def generate(cls, spec: TinySpec) -> Language:
        rng = random.Random(f"language:{spec.seed}")
        phrases = tuple(tuple(rng.randrange(spec.words) for _ in range(rng.randint(3, 7))) for _ in range(spec.phrases))
        # The likeliest successors form ONE cycle through every phrase, so the target's greedy text
        # does not fall into a short loop: a drafter has to learn all of it.
        order = list(range(spec.phrases))
        rng.shuffle(order)
        first = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
        successors = tuple(
            (first[i], *(rng.randrange(spec.phrases) for _ in SUCCESSOR_PROBS[1:])) for i in range(spec.phrases)
        )
        return cls(phrases, successors, frozenset(order[:: spec.terminal_every]))

    def walk(self, rng: random.Random) -> t.Iterator[tuple[int, bool, bool]]:
        """Running text from anywhere inside a random phrase: (word, does a phrase end here, does a terminal
        phrase end here)."""
        i = rng.randrange(len(self.phrases))
        start = rng.randrange(len(self.phrases[i]))
        while True:
            p = self.phrases[i]
            for k in range(start, len(p)):
                end = k == len(p) - 1
                yield p[k], end, end and i in self.terminals
            start = 0
            i = rng.choices(self.successors[i], weights=SUCCESSOR_PROBS)[0]

    def stream(self, rng: random.Random) -> t.Iterator[tuple[int, bool]]:
        """Running text from anywhere inside a random phrase: (word, does a terminal phrase end here)."""
        for word, _end, last in self.walk(rng):
            yield word, last

    def tool(self, rng: random.Random, spec: TinySpec) -> Tool:
        """A tool: a random word names it, 3..6 words of running text describe it."""
        return Tool(rng.randrange(spec.words), tuple(self.sample(rng, rng.randint(3, 6))))

    def tool_turn(self, rng: random.Random, spec: TinySpec) -> tuple[list[int], list[int], list[int], list[int]]:
        """One user turn of a conversation that lists a tool: (user, call arguments, tool result, answer).
        The call's arguments continue the user's text to the end of its phrase (a whole phrase when the user's
        text ends one); the result is running text from elsewhere (the environment's); the answer continues the
        result as a plain answer continues a user turn: up to the end of a terminal phrase."""
        walk = self.walk(rng)
        user = [next(walk)[0] for _ in range(rng.randint(spec.prompt_min, spec.prompt_max))]
        args: list[int] = []
        while True:
            word, end, _last = next(walk)
            args.append(word)
            if end:
                break
        result_walk = self.stream(rng)
        result = [next(result_walk)[0] for _ in range(rng.randint(spec.prompt_min, spec.prompt_max))]
        answer: list[int] = []
        while True:
            word, last = next(result_walk)
            answer.append(word)
            if last or len(answer) >= spec.response_len:
                break
        return user, args, result, answer

    def sample(self, rng: random.Random, length: int) -> list[int]:
        """``length`` words of running text, starting anywhere inside a random phrase."""
        s = self.stream(rng)
        return [next(s)[0] for _ in range(length)]

    def conversation(self, rng: random.Random, spec: TinySpec, length: int) -> list[int]:
        """``length`` tokens of a rendered conversation: a user turn is running text, the assistant
        continues it up to the end of a terminal phrase, then EOS; more turns until ``length``."""
        chat = spec.chat
        ids: list[int] = []
        # a share of them lists a tool (no draw at all without one: the same seed, the same text as before)
        if spec.tool_share > 0 and rng.random() < spec.tool_share:
            tool = self.tool(rng, spec)
            ids += chat.tools(tool)
            while len(ids) < length:
                user, args, result, answer = self.tool_turn(rng, spec)
                ids += [*chat.prompt(user), *chat.call(tool, args), *chat.response(result), *answer, chat.eos]
            return ids[:length]
        while len(ids) < length:
            s = self.stream(rng)
            user = [next(s)[0] for _ in range(rng.randint(spec.prompt_min, spec.prompt_max))]
            ids += chat.prompt(user)
            while len(ids) < length:
                word, last = next(s)
                ids.append(word)
                if last:
                    ids.append(chat.eos)
                    break
        return ids[:length]

    def to_dict(self) -> dict[str, t.Any]:
        return {
            "phrases": [list(p) for p in self.phrases],
            "successors": [list(s) for s in self.successors],
            "successor_probs": list(SUCCESSOR_PROBS),
            "terminals": sorted(self.terminals),
        }


# --------------------------------------------------------------------------------------------
# The target


def _target_config(spec: TinySpec) -> t.Any:
    from dflash.model.target import tiny_target_config

    return tiny_target_config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=512,
        eos_token_id=spec.chat.eos,
        bos_token_id=None,
        pad_token_id=spec.chat.pad,
    )


def train_target(
    spec: TinySpec, language: Language, *, log: t.Callable[[str], None] | None = None
) -> tuple[t.Any, float]:
    """A Qwen3 trained on conversations in the language (AdamW, warmup then cosine). Returns (model in eval mode, final loss)."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(_target_config(spec))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.target_lr, weight_decay=0.0)
    rng = random.Random(f"target-data:{spec.seed}")
    warmup = max(1, spec.target_steps // 8)
    loss_value = math.nan
    for step in range(spec.target_steps):
        batch = torch.tensor([language.conversation(rng, spec, spec.target_seq) for _ in range(spec.target_batch)])
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.target_steps))
        for group in opt.param_groups:
            group["lr"] = spec.target_lr * scale
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if log is not None and (step + 1) % 50 == 0:
            log(f"target step {step + 1}/{spec.target_steps}: loss {loss_value:.3f}")
    model.eval()
    model.requires_grad_(False)
    return model, loss_value


@torch.no_grad()
def greedy_batch(model: t.Any, prompts: torch.Tensor, new_tokens: int, *, stop_id: int | None = None) -> torch.Tensor:
    """The greedy continuation ``[N, new_tokens]`` of N prompts of the same length, one cached forward per
    token; with ``stop_id``, it stops early once every row has said it (what follows it is not defined)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in _forward_params(model) else "past_key_values"
    step_ids = prompts
    position = 0
    out = []
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    for _ in range(new_tokens):
        positions = torch.arange(position, position + step_ids.shape[1]).expand(step_ids.shape[0], -1)
        logits = model(input_ids=step_ids, position_ids=positions, use_cache=True, **{kwarg: cache}).logits
        position += step_ids.shape[1]
        step_ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        out.append(step_ids)
        if stop_id is not None:
            done |= step_ids[:, 0] == stop_id
            if bool(done.all()):
                break
    return torch.cat(out, dim=1)


def _save_quietly(model: t.Any, path: Path) -> None:
    """save_pretrained without its progress bar (it would land in the demo's output)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _forward_params(model: t.Any) -> t.Mapping[str, t.Any]:
    return inspect.signature(model.forward).parameters


def _dumps(obj: t.Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _answer(spec: TinySpec, row: list[int]) -> tuple[list[int], bool]:
    """A greedy row cut after its EOS (kept): (answer, ended at EOS). Anything but words (and the tags of a tool
    call) before it is an error."""
    eos = spec.chat.eos
    answer = row[: row.index(eos) + 1] if eos in row else row
    call = {spec.chat.tag("<tool_call>"), spec.chat.tag("</tool_call>")}  # a tool call is words between these
    bad = [tok for tok in answer[:-1] if tok >= spec.words and tok not in call] + [
        tok for tok in answer[-1:] if tok >= spec.words and tok != eos and tok not in call
    ]
    if bad:  # a target that learned the language says only words, then EOS; say so instead of hiding it
        raise TinyError(
            f"the target answered with token {bad[0]} (not a word) before its end of turn; "
            "train it longer (target_steps)"
        )
    return answer, eos in answer


def write_data(spec: TinySpec, language: Language, model: t.Any, out: Path) -> dict[str, int]:
    """train.jsonl (prompts + the target's greedy answers), chat.jsonl (raw conversations), eval prompts."""
    seen: set[tuple[int, ...]] = set()  # user turns written so far: the held-out prompts are none of them
    counts = _write_train(spec, language, model, out, seen)
    counts.update(_write_chat(spec, language, out, seen))
    counts.update(_write_eval(spec, language, out, seen))
    if spec.tool_share <= 0:  # the manifest of a build without tools reads as it did before them
        counts = {k: v for k, v in counts.items() if not k.startswith("tool_")}
    return counts


def _write_train(
    spec: TinySpec, language: Language, model: t.Any, out: Path, seen: set[tuple[int, ...]]
) -> dict[str, int]:
    """train.jsonl: prompts of the language (a share listing a tool) and the target's greedy answers."""
    chat = spec.chat
    rng = random.Random(f"prompts:{spec.seed}")
    lines: list[str] = []
    capped = 0
    tool_prompts = 0
    while len(lines) < spec.train_samples:
        n = min(spec.gen_batch, spec.train_samples - len(lines))
        length = rng.randint(spec.prompt_min, spec.prompt_max)  # one length per batch: no padding
        users = [language.sample(rng, length) for _ in range(n)]
        prompts = [chat.prompt(u) for u in users]
        if spec.tool_share > 0:  # a share lists a tool of one description length (the same prompt length)
            described = rng.randint(3, 6)
            for k in range(n):
                if rng.random() < spec.tool_share:
                    tool = Tool(rng.randrange(spec.words), tuple(language.sample(rng, described)))
                    prompts[k] = chat.tools(tool) + prompts[k]
                    tool_prompts += 1
        rows: list[list[int]] = [[] for _ in prompts]
        for size in sorted({len(p) for p in prompts}):
            at = [k for k, p in enumerate(prompts) if len(p) == size]
            batch = torch.tensor([prompts[k] for k in at])
            for k, row in zip(at, greedy_batch(model, batch, spec.response_len, stop_id=chat.eos).tolist()):
                rows[k] = row
        for user, prompt, row in zip(users, prompts, rows):
            answer, ended = _answer(spec, row)
            capped += not ended
            seen.add(tuple(user))
            lines.append(_dumps({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}))
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")

    return {"train_samples": len(lines), "answers_capped": capped, "tool_train_prompts": tool_prompts}


def _write_chat(spec: TinySpec, language: Language, out: Path, seen: set[tuple[int, ...]]) -> dict[str, int]:
    """chat.jsonl: the raw multi-turn corpus regen starts from."""
    # the raw corpus: user turns of the language; assistant turns are what "a person" wrote (running
    # text from elsewhere), which regen replaces with what the target says
    raw = random.Random(f"chat:{spec.seed}")
    convs = []
    turns = 0
    tool_convs = 0
    for _ in range(spec.conversations):
        messages: list[dict[str, t.Any]] = []
        if spec.tool_share > 0 and raw.random() < spec.tool_share:
            tool = language.tool(raw, spec)
            for _turn in range(raw.randint(1, spec.max_turns)):
                # the call, the result and the answer are the language's: regen has the target redo the calls
                # and answers (a call that is not the record's ends the conversation there)
                user, args, result, answer = language.tool_turn(raw, spec)
                seen.add(tuple(user))
                call_id = f"call{turns}"
                messages += [
                    {"role": "user", "content": text(user)},
                    {"role": "assistant", "content": "", "tool_calls": [tool.call_json(args, call_id)]},
                    {"role": "tool", "tool_call_id": call_id, "name": f"w{tool.name}", "content": text(result)},
                    {"role": "assistant", "content": text(answer)},
                ]
                turns += 2
            convs.append(_dumps({"tools": [tool.to_json()], "messages": messages}))
            tool_convs += 1
            continue
        for _turn in range(raw.randint(1, spec.max_turns)):
            user = language.sample(raw, raw.randint(spec.prompt_min, spec.prompt_max))
            seen.add(tuple(user))
            human = language.sample(raw, raw.randint(spec.prompt_min, spec.prompt_max))
            messages += [{"role": "user", "content": text(user)}, {"role": "assistant", "content": text(human)}]
            turns += 1
        convs.append(_dumps({"messages": messages}))
    (out / "chat.jsonl").write_text("\n".join(convs) + "\n")

    return {"conversations": len(convs), "assistant_turns": turns, "tool_conversations": tool_convs}


def _write_eval(spec: TinySpec, language: Language, out: Path, seen: set[tuple[int, ...]]) -> dict[str, int]:
    """eval.jsonl (rendered prompts) and eval-chat.jsonl (the same as chat records), none seen in training."""
    chat = spec.chat
    held = random.Random(f"eval:{spec.seed}")
    rendered: list[str] = []
    as_chat: list[str] = []
    tool_evals = 0
    while len(rendered) < spec.eval_prompts:
        if spec.tool_share > 0 and held.random() < spec.tool_share:
            # a tool-call prompt: its record holds the reference answer (the language's call), so that
            # `dflash eval --chat` reports tau on these prompts on their own
            tool = language.tool(held, spec)
            user, args, _res, _ans = language.tool_turn(held, spec)
            if tuple(user) in seen:
                continue
            seen.add(tuple(user))
            rendered.append(_dumps({"input_ids": chat.tools(tool) + chat.prompt(user)}))
            call = {"role": "assistant", "content": "", "tool_calls": [tool.call_json(args, "call0")]}
            as_chat.append(
                _dumps({"tools": [tool.to_json()], "messages": [{"role": "user", "content": text(user)}, call]})
            )
            tool_evals += 1
            continue
        user = language.sample(held, held.randint(spec.prompt_min, spec.prompt_max))
        if tuple(user) in seen:
            continue
        seen.add(tuple(user))
        rendered.append(_dumps({"input_ids": chat.prompt(user)}))
        as_chat.append(_dumps({"messages": [{"role": "user", "content": text(user)}]}))
    (out / "eval.jsonl").write_text("\n".join(rendered) + "\n")
    (out / "eval-chat.jsonl").write_text("\n".join(as_chat) + "\n")
    return {"eval_prompts": len(rendered), "tool_eval_prompts": tool_evals}


# --------------------------------------------------------------------------------------------
# The whole thing


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(out: str | os.PathLike[str]) -> dict[str, t.Any] | None:
    """The manifest of a complete make-tiny output at ``out``, or None (absent, partial or not ours)."""
    if not (Path(out) / MANIFEST).exists():
        return None
    try:  # bounded: a tiny.json of 100,000 levels is not ours, not a RecursionError
        manifest = inputs.read_json(Path(out) / MANIFEST, MANIFEST)
    except inputs.InputFileError:
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None
    for name, digest in files.items():
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts or not isinstance(digest, str):
            return None  # names a file outside the output: not one we wrote
        path = Path(out) / name
        if not path.is_file() or _sha256(path) != digest:
            return None
    return manifest


def make_tiny(
    out: str | os.PathLike[str],
    spec: TinySpec | None = None,
    *,
    force: bool = False,
    log: t.Callable[[str], None] | None = None,
) -> tuple[Path, bool]:
    """Build the target and its data into ``out``. Returns (out, built): ``built`` is False when a
    complete output of the same spec was already there (nothing is rewritten; ``force`` rebuilds)."""
    spec = spec or TinySpec()
    spec.check()
    out = Path(out)
    existing = load_manifest(out)
    if existing is not None and existing.get("spec") == spec.to_dict() and not force:
        return out, False
    if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise TinyError(f"{out}: exists and is not a make-tiny output (no {MANIFEST}); give another --out")
    say = log or (lambda _msg: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        language = Language.generate(spec)
        (tmp / "language.json").write_text(_dumps(language.to_dict()) + "\n")
        say(
            f"training the tiny target ({spec.num_layers} layers, width {spec.hidden_size}) for {spec.target_steps} "
            "steps on conversations in its chat template"
        )
        model, loss = train_target(spec, language, log=say)
        _save_quietly(model, tmp / "target")
        save_tokenizer(spec, tmp / "target")
        say(
            f"the target answers {spec.train_samples} prompts (greedy, up to its end of turn); "
            f"chat.jsonl: {spec.conversations} raw conversations for dflash regen"
        )
        counts = write_data(spec, language, model, tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT,
            "spec": spec.to_dict(),
            "target_loss": round(loss, 4),
            "mask_token_id": spec.mask_token_id,
            "eos_token_id": spec.chat.eos,
            **counts,
            "files": {name: _sha256(tmp / name) for name in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out.exists():
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out, True
