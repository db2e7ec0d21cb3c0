"""The EAGLE-3 drafter network, shared by training (eaglenest.drafter) and the reference decoder: ``fc`` + one
decoder layer over ``[norm(embed); norm(hidden)]`` + ``norm`` + ``lm_head``.

The decoder layer's attention is the config's ``draft_shape``: ``llama`` (q/k/v heads, SGLang's
``LlamaForCausalLMEagle3``) or ``mla`` (DeepSeek multi-head latent attention, SGLang's ``Eagle3DeepseekV2ForCausalLM``;
``eaglenest.drafters.eagle3.mla``). Everything else is shared. Parameter names match the SGLang loader of the shape one
to one (``fc.weight``, ``midlayer.self_attn.q_proj.weight`` or ``midlayer.self_attn.q_a_proj.weight``, ...,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so exporting is a plain ``state_dict`` write and a misnamed
tensor cannot silently leave a module random in the serving engine. EAGLE-3.1's options (``fc_norm``: an RMSNorm per
aux layer before ``fc``; ``norm_output``: the next step reads the post-norm hidden) are the config's flags of the same
names, as SGLang reads them.

Inference API (used by the reference speculative decoder)::

    cache = model.new_cache()
    logits, hidden = model.step(input_ids, hidden, position_ids, cache, attention_mask=None)

``hidden`` is either the target's fused aux states (last dim ``3 * target_hidden_size``, goes through ``fc``) or the
drafter's own previous ``hidden`` output (last dim ``hidden_size``, used as is; pre-norm, or post-norm under
``norm_output``). ``logits`` are over the draft vocab;
map draft ids to target ids with :meth:`Eagle3Drafter.to_target_ids`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.format import DTYPE_NAMES, WEIGHTS, read_export_config, validate_tensors, write_export
from eaglenest.drafters.eagle3.mla import MLAAttention, mla_attention_flops
from eaglenest.drafters.eagle3.norm import RMSNorm

__all__ = ["DrafterKVCache", "DrafterModelConfig", "Eagle3Drafter", "RMSNorm", "flops_per_token", "load_drafter"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    """Neox-style RoPE (transformers Llama / SGLang ``is_neox_style=True``); cos/sin built for the given positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # a plain attribute, not a buffer: ``module.to(bfloat16)`` must not round the frequencies
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, S]`` -> cos, sin ``[B, 1, S, head_dim]`` (angles in fp32)."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2H concatenation; the attention kernel itself is chosen by the caller."""

    def __init__(self, cfg: DrafterModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.rotary = Rotary(d, cfg.rope_theta)
        self.softmax_scale = d ** -0.5

    def qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, S, 2H]`` -> q ``[B, heads, S, d]``, k/v ``[B, kv_heads, S, d]`` with RoPE at ``position_ids``."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(position_ids, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """``o [B, heads, S, d]`` -> ``[B, S, H]``."""
        b, _, s, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_attention(cfg: DrafterModelConfig) -> nn.Module:
    """The decoder layer's attention for ``cfg.draft_shape``: ``qkv(x, position_ids)``, ``out(o)``, ``num_heads``,
    ``num_kv_heads``, ``softmax_scale``."""
    if cfg.is_mla:
        return MLAAttention(cfg)
    return Eagle3Attention(cfg)


class Eagle3DecoderLayer(nn.Module):
    """SGLang's ``midlayer``: residual = incoming hidden; attention input = [input_layernorm(e); hidden_norm(h)]."""

    def __init__(self, cfg: DrafterModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = build_attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[input_layernorm(embeds); hidden_norm(hidden)]`` in the hidden state's dtype (bf16 under autocast)."""
        return torch.cat([self.input_layernorm(embeds).to(hidden.dtype), self.hidden_norm(hidden)], dim=-1)

    def finish(self, residual: torch.Tensor, attn_o: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the MLP block; returns the pre-norm hidden state."""
        h = residual + self.self_attn.out(attn_o)
        return h + self.mlp(self.post_attention_layernorm(h))


class DrafterKVCache:
    """Keys/values of the drafter's single layer, ``[B, kv_heads, L, d]``, with rollback for speculative decoding.

    ``truncate(n)`` keeps the first ``n`` positions (chain drafting rollback); ``keep(index)`` keeps arbitrary
    positions in order (tree drafting: prefix + accepted path).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def __len__(self) -> int:
        return self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions and return all keys/values."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a drafter KV cache of length {self.length} to {length}")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def keep(self, index: torch.Tensor | list[int]) -> None:
        """Keep the positions in ``index`` (1-D, same for the whole batch), in that order."""
        if self.k is None:
            return
        idx = torch.as_tensor(index, dtype=torch.long, device=self.k.device)
        self.k, self.v = self.k.index_select(2, idx), self.v.index_select(2, idx)

    def select_batch(self, index: torch.Tensor | list[int]) -> None:
        """Keep only the batch rows in ``index`` (finished sequences dropped)."""
        if self.k is None:
            return
        idx = torch.as_tensor(index, dtype=torch.long, device=self.k.device)
        self.k, self.v = self.k.index_select(0, idx), self.v.index_select(0, idx)

    def clone(self) -> DrafterKVCache:
        c = DrafterKVCache()
        c.k, c.v = self.k, self.v  # tensors are never modified in place, sharing is safe
        return c


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model; see the module docstring for the inference API."""

    def __init__(self, cfg: DrafterModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
                        if cfg.fc_norm else None)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        ids = torch.arange(cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float = 0.02) -> None:
        """transformers-style init: normal(0, std) linears, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @torch.no_grad()
    def init_from_target(
        self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
    ) -> None:
        """Copy the target's embedding, set the vocab mapping, and start ``lm_head`` from the target's draft rows."""
        self.set_vocab_mapping(d2t, t2d)
        if tuple(embed_weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} != {tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(embed_weight)
        rows = self.draft_target_ids()
        self.lm_head.weight.copy_(lm_head_weight[rows.to(lm_head_weight.device)])

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit this drafter "
                f"(draft vocab {self.config.draft_vocab_size}, target vocab {self.config.vocab_size})"
            )
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_target_ids(self) -> torch.Tensor:
        """Target id of every draft id: ``arange(Vd) + d2t``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab indices (e.g. an argmax over ``step`` logits) to target token ids."""
        return draft_ids + self.d2t[draft_ids]

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter ``[..., Vd]`` logits into the target vocab, ``-inf`` outside the draft vocab (rejection sampling)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        idx = self.draft_target_ids().expand_as(draft_logits)
        return out.scatter(-1, idx, draft_logits)

    # ------------------------------------------------------------------------------------------- building blocks
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def fuse(self, hidden: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """Apply ``fc`` to 3H aux input; H input (the drafter's own hidden) passes through."""
        width = hidden.shape[-1]
        if fused is None:
            if width == 3 * self.config.target_hidden_size:
                fused = True
            elif width == self.config.hidden_size:
                fused = False
            else:
                raise ValueError(
                    f"hidden width {width} is neither 3*target_hidden_size ({3 * self.config.target_hidden_size}, "
                    f"fused aux states) nor hidden_size ({self.config.hidden_size}, the drafter's own hidden)"
                )
        if not fused:
            return hidden
        if self.fc_norm is not None:
            hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, hidden.chunk(3, dim=-1), strict=True)], -1)
        return self.fc(hidden)

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads from this step's pre-norm output: itself, or ``norm(out)`` (norm_output)."""
        return self.norm(out) if self.config.norm_output else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits from a pre-norm hidden state."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self) -> DrafterKVCache:
        return DrafterKVCache()

    # ------------------------------------------------------------------------------------------------ inference
    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: DrafterKVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        fused: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One incremental drafter forward over ``S`` new positions.

        Args:
            input_ids: ``[B, S]`` target-vocab token ids (row ``t`` holds the token *after* the one whose hidden
                state is in row ``t``, as in EAGLE: hidden of position p + token p+1 -> predicts token p+2).
            hidden: ``[B, S, 3*target_hidden]`` fused aux states from the target (goes through ``fc``) or
                ``[B, S, H]`` the drafter's own previous ``hidden`` output (does not); ``fused`` forces either.
            position_ids: ``[B, S]`` RoPE positions (position of the hidden state's token).
            kv_cache: appended to in place; ``None`` runs without history.
            attention_mask: over ``[cached + new]`` keys, shape ``[S, L]``, ``[B, S, L]`` or ``[B, 1, S, L]``;
                bool (True = may attend) or float (additive, ``-inf`` = blocked). ``None`` = causal in append
                order (every new position sees the whole cache and the new positions up to itself).

        Returns:
            ``(logits [B, S, Vd], hidden_out [B, S, H])``: draft-vocab logits and the hidden state to feed to the
            next step (pre-norm; post-norm under ``norm_output``).
        """
        h = self.fuse(hidden, fused)
        layer = self.midlayer
        q, k, v = layer.self_attn.qkv(layer.attn_input(self.embed(input_ids), h), position_ids)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k, v = kv_cache.append(k, v)
        s, total = q.shape[2], k.shape[2]
        if attention_mask is None:
            if s == 1:
                mask = None
            else:
                mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
        else:
            mask = attention_mask
            if mask.shape[-1] != total or mask.shape[-2] != s:
                raise ValueError(f"attention_mask {tuple(mask.shape)} must end in [S={s}, L={total}] (cache + new)")
            if mask.dim() == 3:
                mask = mask[:, None]
            if mask.dtype != torch.bool:
                mask = mask.to(q.dtype)
        attn = layer.self_attn
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.softmax_scale,
                                           enable_gqa=attn.num_heads != attn.num_kv_heads)
        out = layer.finish(h, o)
        return self.head(out), self.next_hidden(out)

    forward = step

    # -------------------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, output_dir: str | Path, *, include_embedding: bool = True, **kwargs: Any) -> Path:
        """Write an export folder SGLang and vLLM load (``eaglenest.drafters.eagle3.format``; kwargs: fmt, dtype)."""
        tensors = {k: v.detach().cpu() for k, v in self.state_dict().items()
                   if include_embedding or k != "embed_tokens.weight"}
        return write_export(tensors, self.config, output_dir, **kwargs)

    @classmethod
    def from_pretrained(cls, export_dir: str | Path, **kwargs: Any) -> Eagle3Drafter:
        """Load an export folder written by :meth:`save_pretrained` (aux ids come back as physical ids)."""
        return load_drafter(export_dir, **kwargs)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def flops_per_token(cfg: DrafterModelConfig, ttt_steps: int) -> dict[str, float]:
    """Matmul FLOPs per token for one TTT training step (forward x3 for fwd+bwd; teacher head forward only)."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.is_mla:
        qkv, o = mla_attention_flops(cfg)
    else:
        qkv = 2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
        o = cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    head = h * cfg.draft_vocab_size
    per_step = 2 * (qkv + o + mlp + head)
    fc = 2 * 3 * cfg.target_hidden_size * h
    teacher = 2 * cfg.target_hidden_size * cfg.vocab_size
    return {
        "drafter_fwd": per_step * ttt_steps + fc,
        "train": 3 * (per_step * ttt_steps + fc),
        "teacher": float(teacher),
        "total": 3 * (per_step * ttt_steps + fc) + teacher,
        "params_per_step_mac": math.fsum([qkv, o, mlp, head]),
    }


def load_drafter(
    export_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    target_embedding: torch.Tensor | None = None,
) -> Eagle3Drafter:
    """Load an export; the model's ``config.aux_layer_ids`` are physical ids whatever the export format.

    Without an embedding in the file, ``target_embedding`` (or the recorded target's) is used.
    """
    from safetensors.torch import load_file

    cfg, _, side = read_export_config(export_dir)
    tensors = load_file(str(Path(export_dir) / WEIGHTS))
    validate_tensors(tensors, cfg)
    if "embed_tokens.weight" not in tensors:
        if target_embedding is None:
            target_embedding, _ = TargetSpec.read(side["target"]).load_embed_and_head()
        tensors["embed_tokens.weight"] = target_embedding
    model = Eagle3Drafter(cfg)
    name = str(side.get("dtype", "float32"))
    load_dtype = dtype or (getattr(torch, name) if name in DTYPE_NAMES else torch.float32)
    model.to(load_dtype)
    model.load_state_dict({k: v.to(load_dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                          strict=True)
    return model.to(device).eval()
