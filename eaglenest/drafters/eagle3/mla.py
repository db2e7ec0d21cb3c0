"""The MLA draft shape: the EAGLE-3 decoder layer's attention as DeepSeek multi-head latent attention.

The function is the one SGLang 0.5.14's ``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``) computes with
``DeepseekV2AttentionMLA`` over the layer's 2H input ``x = [input_layernorm(embed); hidden_norm(hidden)]``::

    q_lat, latent = split(x @ [q_a_proj; kv_a_proj_with_mqa]^T, [q_lora_rank, kv_lora_rank + qk_rope_head_dim])
    q             = q_b_proj(q_a_layernorm(q_lat))            -> per head [qk_nope | qk_rope]
    kv_a, k_pe    = split(latent, [kv_lora_rank, qk_rope_head_dim])      (k_pe: one RoPE key shared by all heads)
    k_nope, v     = split(kv_b_proj(kv_a_layernorm(kv_a)))  -> per head [qk_nope | v_head_dim]
    q_pe, k_pe    = rope(q_pe), rope(k_pe)                    (interleaved pairs: DeepSeek's ``rope_interleave``)
    o             = o_proj(softmax(q . [k_nope | k_pe] * qk_head_dim ** -0.5) @ v)

SGLang keeps the latent in its KV cache and absorbs ``kv_b_proj`` into q and o at decode; that is the same function
written in another order. Here keys and values are expanded per head (``DrafterKVCache`` holds them), so the drafter
plugs into the TTT objective and the reference decoder exactly where the Llama-shaped attention does: the same
``qkv(x, position_ids) -> q, k, v`` (``[B, heads, S, width]``) and ``out(o)``; only the value width differs from the
query/key width, and ``num_kv_heads == num_heads``. Parameter names are the checkpoint names SGLang's loader maps
(``q_a_proj`` and ``kv_a_proj_with_mqa`` it fuses into ``fused_qkv_a_proj_with_mqa`` itself).
"""

from __future__ import annotations

import torch
from torch import nn

from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.norm import RMSNorm


class InterleavedRotary(nn.Module):
    """RoPE over interleaved pairs ``(x[2i], x[2i+1])`` (SGLang ``is_neox_style=False``, DeepSeek's default)."""

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        # a plain attribute, not a buffer: ``module.to(bfloat16)`` must not round the frequencies
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, S]`` -> cos, sin ``[B, 1, S, dim / 2]`` (angles in fp32)."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = (position_ids.float()[..., None] * self.inv_freq)[:, None]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[2i], x[2i+1])`` of ``x [..., dim]`` by angle ``i`` (``cos/sin [..., dim / 2]``)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    """DeepSeek MLA over the 2H EAGLE-3 attention input; same interface as ``model.Eagle3Attention``."""

    def __init__(self, cfg: DrafterModelConfig) -> None:
        super().__init__()
        if not cfg.is_mla:
            raise ValueError(f"MLAAttention needs an MLA drafter config (draft_shape {cfg.draft_shape!r})")
        h = cfg.hidden_size
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
        self.nope, self.rope = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        self.v_head_dim = int(cfg.v_head_dim)
        self.head_dim = self.nope + self.rope
        """query/key width per head (what the softmax scale is computed from)"""
        self.softmax_scale = self.head_dim ** -0.5
        self.q_a_proj = nn.Linear(2 * h, self.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=False)
        self.rotary = InterleavedRotary(self.rope, cfg.rope_theta)

    def qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, S, 2H]`` -> q, k ``[B, heads, S, nope + rope]``, v ``[B, heads, S, v_head_dim]`` (RoPE applied)."""
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, self.num_heads, self.head_dim)
        q = q.transpose(1, 2)
        latent = self.kv_a_proj_with_mqa(x)
        kv_a, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a)).view(b, s, self.num_heads, self.nope + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_head_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(position_ids, q.dtype)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_interleaved_rope(q_pe, cos, sin)], dim=-1)
        k_pe = apply_interleaved_rope(k_pe[:, None], cos, sin).to(k_nope.dtype)
        k = torch.cat([k_nope, k_pe.expand(b, self.num_heads, s, self.rope)], dim=-1)
        return q, k, v.contiguous()

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """``o [B, heads, S, v_head_dim]`` -> ``[B, S, H]``."""
        b, _, s, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.num_heads * self.v_head_dim))


def mla_attention_flops(cfg: DrafterModelConfig) -> tuple[float, float]:
    """(projection MACs into q/k/v, o_proj MACs) per token of an MLA drafter."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qa, kva = int(cfg.q_lora_rank or 0), int(cfg.kv_lora_rank or 0)
    nope, rope, v = int(cfg.qk_nope_head_dim or 0), int(cfg.qk_rope_head_dim or 0), int(cfg.v_head_dim or 0)
    proj = 2 * h * (qa + kva + rope) + qa * heads * (nope + rope) + kva * heads * (nope + v)
    return float(proj), float(heads * v * h)
