"""``dflash regen``'s hf backend: the run's target in this process, batched greedy ``generate``.

One replica per distinct device of ``devices.targets``; prompts are the ``Turn``'s ``prompt_ids`` (rendered
by ``dflash.data.regen`` as prepare-data renders them, the record's tools included); left padding; stops at
EOS (the tokenizer's and the model's ``generation_config``'s) or the turn's token limit. Its text holds the
target's tool calls as the target writes them (``<tool_call>`` blocks): regen splits them off.
"""

from __future__ import annotations

import dataclasses
import threading
import typing as t

from dflash.config import ConfigError
from dflash.data.regen import Aborted, Answer, RegenError, Turn


class HFGenerator:
    """Batched greedy generation with a transformers causal LM (left padding, stop at EOS)."""

    def __init__(self, model: t.Any, tokenizer: t.Any, *, batch_size: int, identity: dict[str, t.Any]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.identity = identity
        eos: set[int] = set()
        for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        self.eos = eos
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if isinstance(pad, int) else min(eos) if eos else 0
        self._abort = threading.Event()

    def close(self) -> None:
        """Stop: a ``generate`` in flight ends at its next decoding step (with Aborted)."""
        self._abort.set()

    def generate(self, turns: list[Turn]) -> list[Answer]:
        out: list[Answer | None] = [None] * len(turns)
        order = sorted(range(len(turns)), key=lambda i: len(turns[i].prompt_ids or ()))  # less padding
        for a in range(0, len(order), self.batch_size):
            if self._abort.is_set():
                raise Aborted("regen: stopped")
            idx = order[a : a + self.batch_size]
            for i, ans in zip(idx, self._batch([turns[i] for i in idx])):
                out[i] = ans
        return [a for a in out if a is not None]

    def _batch(self, turns: list[Turn]) -> list[Answer]:
        import torch  # the hf backend only: torch and transformers take seconds to import, openai needs neither
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        abort = self._abort

        class Closed(StoppingCriteria):  # close() ends a generate in flight at its next step
            def __call__(self, input_ids: t.Any, scores: t.Any, **kwargs: t.Any) -> t.Any:
                return torch.full((input_ids.shape[0],), abort.is_set(), dtype=torch.bool, device=input_ids.device)

        prompts = [list(tn.prompt_ids or ()) for tn in turns]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        longest = max(tn.max_new for tn in turns)
        gc = GenerationConfig(
            do_sample=False, max_new_tokens=longest, eos_token_id=sorted(self.eos) or None, pad_token_id=self.pad
        )
        device = self.model.device
        with torch.inference_mode():
            seqs = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gc,
                stopping_criteria=StoppingCriteriaList([Closed()]),
            )
        if abort.is_set():  # stopped midway: these answers are not the target's
            raise Aborted("regen: stopped")
        answers = []
        for r, tn in enumerate(turns):
            new = seqs[r, width : width + tn.max_new].tolist()  # greedy: a shorter limit is a prefix of a longer one
            stop = next((k for k, x in enumerate(new) if x in self.eos), None)
            if stop is not None:
                new = new[:stop]
            answers.append(
                Answer(
                    self.tokenizer.decode(new, skip_special_tokens=True), cut=stop is None and len(new) >= tn.max_new
                )
            )
        return answers


def load_hf(cfg: t.Any, tokenizer: t.Any, *, batch_size: int) -> list[HFGenerator]:
    """One generator per distinct device of ``devices.targets`` (a device named twice gets one replica)."""
    import torch  # the hf backend only (as HFGenerator._batch): seconds to import, openai needs none of these
    from transformers import AutoModelForCausalLM

    from dflash.dtypes import torch_dtype
    from dflash.model.target import TargetModel, tiny_target_config_of

    dtype = torch_dtype(cfg.target.dtype)
    gens = []
    for dev in dict.fromkeys(cfg.devices.targets):
        if dev != "cpu" and not torch.cuda.is_available():
            raise RegenError(f"regen: devices.targets names {dev}, but this torch has no CUDA device")
        if cfg.target.tiny is not None:  # a random-init target from the config (tests)
            tiny = cfg.target.tiny
            tc = tiny_target_config_of(tiny)
            model = TargetModel.from_config(tc, dtype=dtype, device=dev, seed=tiny.seed).model
            identity: dict[str, t.Any] = {"backend": "hf", "tiny": dataclasses.asdict(tiny), "dtype": cfg.target.dtype}
        else:
            placement = {} if dev == "cpu" else {"device_map": {"": dev}}
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    cfg.target.path, dtype=dtype, local_files_only=True, **placement
                )
            except OSError as e:
                raise ConfigError("target.path", f"cannot load a model from {cfg.target.path}: {e}") from e
            model.to(dev)
            identity = {"backend": "hf", "target": str(cfg.target.path), "dtype": cfg.target.dtype}
        model.eval()
        gens.append(HFGenerator(model, tokenizer, batch_size=batch_size, identity=identity))
    return gens


__all__ = ["HFGenerator", "load_hf"]
