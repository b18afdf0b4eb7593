"""An independent, minimal reference of z-lab's DFlash drafter (``z-lab/dflash`` ``dflash/model.py``).

Written from a reading of that file, for tests only: it keeps z-lab's structure on purpose (a Qwen3
pretrained model whose config class is plain ``Qwen3Config``; attention that takes q from the block,
projects context and block separately with the same k_proj/v_proj and concatenates them; RoPE applied
to the last q_len positions for q and to all keys; transformers' own "sdpa" attention function; no mask
in full layers, a causal + sliding-window mask over key indices in sliding layers; transformers'
``DynamicCache`` cropped back after each draft; the greedy ``dflash_generate`` loop). It shares no code
with ``dflash.model.drafter`` / ``dflash.eval.spec_decode``: if our model drifts from z-lab's, the checkpoint and
parity tests that load our weights into this class fail.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def extract_context_feature(hidden_states, layer_ids):
    # hidden_states[0] is the embedding output, so layer i's output sits at i + 1.
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _dflash_value(config, name, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    n = q.shape[-2]
    q_out = q * cos[..., -n:, :] + rotate_half(q) * sin[..., -n:, :]
    k_out = k * cos + rotate_half(k) * sin
    return q_out, k_out


def _index_mask(q_len, k_len, *, causal, window, device):
    qpos = (k_len - q_len + torch.arange(q_len, device=device))[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
        if not causal:
            allowed &= kpos - qpos < window
    return allowed[None, None]


class RefAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None)
        kind = kinds[layer_idx] if kinds else "full_attention"
        self.is_causal = kind == "sliding_attention"
        self.sliding_window = config.sliding_window if kind == "sliding_attention" else None

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        bsz, q_len = hidden_states.shape[:2]
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        k = self.k_norm(k.view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = _rope(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = _index_mask(
                q_len, k.shape[-2], causal=self.is_causal, window=self.sliding_window, device=q.device
            )
        out, _ = sdpa_attention_forward(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(bsz, q_len, -1))


class RefDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = RefAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        target_hidden=None,
        hidden_states=None,
        attention_mask=None,
        past_key_values=None,
        position_embeddings=None,
    ):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, position_embeddings, attention_mask, past_key_values
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """z-lab's class shape: plain Qwen3Config, the same submodule names."""

    config_class = Qwen3Config
    _can_record_outputs = {}

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList([RefDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.target_layer_ids = _dflash_value(config, "target_layer_ids")
        if self.target_layer_ids is None:
            raise ValueError("Draft config must define dflash_config.target_layer_ids.")
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        self.post_init()

    def forward(
        self,
        position_ids,
        attention_mask=None,
        noise_embedding=None,
        target_hidden=None,
        past_key_values=None,
        use_cache=False,
    ):
        hidden_states = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                target_hidden=target_hidden,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


def _crop_to(cache, length):
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _cache_arg(target, cache):
    # transformers 5.24 renamed the forward's past_key_values (z-lab's name, all 5.23 and older have) to cache
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return {name: cache}


@torch.no_grad()
def reference_generate(model, target, input_ids, max_new_tokens, block_size=None, stop_token_ids=None):
    """z-lab's greedy ``dflash_generate``: (output_ids [1, <= P + max_new], acceptance lengths incl. the bonus).

    With ``stop_token_ids`` its stop rule: after each step, the loop ends once a stop token is anywhere in
    the new tokens (the prefill's one included); the output is cut after the first of them."""
    num_input = input_ids.shape[1]
    max_length = num_input + max_new_tokens
    block_size = model.block_size if block_size is None else block_size
    device = input_ids.device
    output_ids = torch.full((1, max_length + block_size), model.mask_token_id, dtype=torch.long, device=device)
    position_ids = torch.arange(output_ids.shape[1], device=device)[None]
    target_cache, draft_cache = DynamicCache(), DynamicCache()

    out = target(
        input_ids,
        position_ids=position_ids[:, :num_input],
        **_cache_arg(target, target_cache),
        use_cache=True,
        output_hidden_states=True,
    )
    output_ids[:, :num_input] = input_ids
    output_ids[:, num_input] = out.logits[:, -1].argmax(dim=-1)
    target_hidden = extract_context_feature(out.hidden_states, model.target_layer_ids)
    embed = target.get_input_embeddings().weight

    acceptance_lengths = []
    start = num_input
    while start < max_length:
        block_ids = output_ids[:, start : start + block_size].clone()
        draft_hidden = model(
            target_hidden=target_hidden,
            noise_embedding=nn.functional.embedding(block_ids, embed),
            position_ids=position_ids[:, draft_cache.get_seq_length() : start + block_size],
            past_key_values=draft_cache,
            use_cache=True,
        )[:, 1 - block_size :, :]
        _crop_to(draft_cache, start)
        block_ids[:, 1:] = target.lm_head(draft_hidden).argmax(dim=-1)

        out = target(
            block_ids,
            position_ids=position_ids[:, start : start + block_size],
            **_cache_arg(target, target_cache),
            use_cache=True,
            output_hidden_states=True,
        )
        posterior = out.logits.argmax(dim=-1)
        accepted = int((block_ids[:, 1:] == posterior[:, :-1]).long().cumprod(dim=1).sum())
        output_ids[:, start : start + accepted + 1] = block_ids[:, : accepted + 1]
        output_ids[:, start + accepted + 1] = posterior[:, accepted]
        start += accepted + 1
        _crop_to(target_cache, start)
        acceptance_lengths.append(accepted + 1)
        target_hidden = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, : accepted + 1, :]
        if stop_token_ids is not None and any(s in output_ids[:, num_input:] for s in stop_token_ids):
            break
    output_ids = output_ids[:, : min(start + 1, max_length)]
    if stop_token_ids is not None:
        hits = torch.isin(output_ids[0, num_input:], torch.tensor(stop_token_ids)).nonzero(as_tuple=True)[0]
        if hits.numel():
            output_ids = output_ids[:, : num_input + int(hits[0]) + 1]
    return output_ids, acceptance_lengths
