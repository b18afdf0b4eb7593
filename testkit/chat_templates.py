"""Chat templates and a pre-tokenizer shaped like real ones, shared by the prepare-data and regen tests."""

QWEN3 = (  # shaped like Qwen3's (think blocks, history stripping, enable_thinking); text in string literals,
    # so that {%- never eats a newline
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'user' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set content = content.split('</think>')[-1].strip() %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

SPLIT = (  # Qwen2/3's and Llama-3's pre-tokenizer regex
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)

WORDS = "hello there how are you fine thanks and bye ok what is the plan today let me think about it sure".split()


def random_conversations(
    n: int, seed: int = 0, turns: tuple[int, int] = (1, 3), reply: tuple[int, int] | None = None
) -> list[dict[str, object]]:
    """``n`` multi-turn chats of WORDS (the benches' corpora): a system line, ``turns`` user/assistant pairs;
    replies of ``reply`` words, or "old" (a placeholder that regen replaces) when None."""
    import random

    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out: list[dict[str, object]] = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text(3, 8)}]
        for _ in range(rng.randint(*turns)):
            msgs += [
                {"role": "user", "content": text(5, 30)},
                {"role": "assistant", "content": text(*reply) if reply else "old"},
            ]
        out.append({"messages": msgs})
    return out
