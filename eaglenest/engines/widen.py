"""Function-preserving expansion of a Llama checkpoint to a wider and deeper shape.

Why: a GPU benchmark of speculative decoding only means something when the target's step costs what a real model's
does, and no 8B-class model can be downloaded or pre-trained here. So a small model pre-trained on real text is
grown to an 8B-class shape (hidden 4096, 32 layers, GQA) whose outputs are *the same function* as the small model's:
SGLang pays the big model's memory traffic per step while the tokens stay those of a model that learned real text.

How (every rule exact in real arithmetic; the norm rescale is a power of two when the width grows 4x, so it is exact
in bf16 too):
- The residual stream keeps the small model's channels first; new channels start at zero and stay zero because
  every matrix that writes the stream (embeddings, ``o_proj``, ``down_proj``) has zero rows for them.
- RMSNorm over zero-padded channels divides by a smaller RMS: weights are scaled by sqrt(d_small / d_wide) and eps
  by d_small / d_wide, which gives back the small model's normalised values.
- Attention head h of the small model (head_dim unchanged, so RoPE is unchanged) becomes query head h*g of the wide
  model and key/value head h (g = wide query heads per key/value head). The other query heads have zero ``o_proj``
  columns, so they add nothing.
- MLP: the small model's rows/columns first, the rest zero (SiLU(0) * 0 = 0, and ``down_proj``'s new columns are 0).
- Depth: the small model's layer j goes to wide layer floor(j * L_wide / L_small); every other wide layer is all
  zeros, an exact identity on the residual stream (its attention and MLP both write zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WideShape:
    """The shape to grow into (default: Llama-3-8B's, with the small model's vocabulary)."""

    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 14336


class WidenError(ValueError):
    """The small model cannot be grown into the requested shape without changing its function."""


def layer_positions(small_layers: int, wide_layers: int) -> list[int]:
    """Where each small layer lands in the wide stack (spread evenly, first at 0)."""
    return [j * wide_layers // small_layers for j in range(small_layers)]


def check_shapes(small: dict, wide: WideShape) -> None:
    """Refuse shapes the rules above cannot map exactly (``small`` is the small model's config as a dict)."""
    hs, nh = small["hidden_size"], small["num_attention_heads"]
    nkv = small.get("num_key_value_heads") or nh
    head_dim = small.get("head_dim") or hs // nh
    problems = []
    if wide.hidden_size % wide.num_heads or wide.hidden_size // wide.num_heads != head_dim:
        problems.append(f"wide head_dim {wide.hidden_size // wide.num_heads} must equal the small model's {head_dim} "
                        "(RoPE depends on it)")
    if nkv != nh:
        problems.append(f"the small model must use full multi-head attention (num_key_value_heads {nkv} != "
                        f"num_attention_heads {nh}) so each of its heads can own a wide key/value head")
    if wide.num_heads % wide.num_kv_heads or nh > wide.num_kv_heads:
        problems.append(f"wide num_kv_heads {wide.num_kv_heads} must divide {wide.num_heads} and be >= the small "
                        f"model's {nh} heads")
    if wide.hidden_size < hs or wide.intermediate_size < small["intermediate_size"]:
        problems.append("the wide shape must not be narrower than the small model")
    if wide.num_layers < small["num_hidden_layers"]:
        problems.append("the wide stack must not have fewer layers than the small model")
    if small.get("tie_word_embeddings"):
        problems.append("tied embeddings are not supported (the small model is built untied)")
    if problems:
        raise WidenError("cannot widen function-preservingly: " + "; ".join(problems))


def widen_config(small: dict, wide: WideShape) -> dict:
    """The wide model's config.json contents (everything not about shape is kept)."""
    check_shapes(small, wide)
    cfg = dict(small)
    cfg.update(hidden_size=wide.hidden_size, num_hidden_layers=wide.num_layers, num_attention_heads=wide.num_heads,
               num_key_value_heads=wide.num_kv_heads, intermediate_size=wide.intermediate_size,
               head_dim=wide.hidden_size // wide.num_heads,
               rms_norm_eps=small["rms_norm_eps"] * small["hidden_size"] / wide.hidden_size)
    return cfg


def widen_state_dict(small_sd: dict[str, torch.Tensor], small: dict, wide: WideShape, *,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
                     ) -> dict[str, torch.Tensor]:
    """The wide model's weights (transformers Llama names), built from the small model's."""
    check_shapes(small, wide)
    hs, H = small["hidden_size"], wide.hidden_size
    nh, ffn = small["num_attention_heads"], small["intermediate_size"]
    head_dim = hs // nh
    group = wide.num_heads // wide.num_kv_heads
    norm_scale = math.sqrt(hs / H)

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    def src(name: str) -> torch.Tensor:
        return small_sd[name].to(device=device, dtype=torch.float32)

    def norm(name: str | None) -> torch.Tensor:
        w = torch.full((H,), norm_scale, dtype=torch.float32, device=device)
        if name is not None:
            w[:hs] = src(name) * norm_scale
        return w.to(dtype)

    vocab = small_sd["model.embed_tokens.weight"].shape[0]
    out: dict[str, torch.Tensor] = {}
    emb = z(vocab, H)
    emb[:, :hs] = src("model.embed_tokens.weight").to(dtype)
    out["model.embed_tokens.weight"] = emb
    head = z(vocab, H)
    head[:, :hs] = src("lm_head.weight").to(dtype)
    out["lm_head.weight"] = head
    out["model.norm.weight"] = norm("model.norm.weight")

    kv_out = wide.num_kv_heads * head_dim
    mapped = dict(zip(layer_positions(small["num_hidden_layers"], wide.num_layers),
                      range(small["num_hidden_layers"]), strict=True))
    for i in range(wide.num_layers):
        p = f"model.layers.{i}."
        q, k, v, o = z(wide.num_heads * head_dim, H), z(kv_out, H), z(kv_out, H), z(H, wide.num_heads * head_dim)
        gate, up, down = z(wide.intermediate_size, H), z(wide.intermediate_size, H), z(H, wide.intermediate_size)
        j = mapped.get(i)
        if j is not None:
            s = f"model.layers.{j}."
            sq, sk, sv, so = (src(s + f"self_attn.{n}_proj.weight") for n in "qkvo")
            for h in range(nh):
                rows = slice(h * head_dim, (h + 1) * head_dim)
                wq = slice(h * group * head_dim, (h * group + 1) * head_dim)  # query head h*g
                q[wq, :hs] = sq[rows].to(dtype)
                k[rows, :hs] = sk[rows].to(dtype)  # key/value head h
                v[rows, :hs] = sv[rows].to(dtype)
                o[:hs, wq] = so[:, rows].to(dtype)
            gate[:ffn, :hs] = src(s + "mlp.gate_proj.weight").to(dtype)
            up[:ffn, :hs] = src(s + "mlp.up_proj.weight").to(dtype)
            down[:hs, :ffn] = src(s + "mlp.down_proj.weight").to(dtype)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        out[p + "self_attn.v_proj.weight"], out[p + "self_attn.o_proj.weight"] = v, o
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"], out[p + "mlp.down_proj.weight"] = gate, up, down
        out[p + "input_layernorm.weight"] = norm(None if j is None else f"model.layers.{j}.input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = norm(
            None if j is None else f"model.layers.{j}.post_attention_layernorm.weight")
    return out


def count_parameters(cfg: dict) -> int:
    """Parameters of a (untied) Llama config, without building it."""
    H, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]  # noqa: E741
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    attn = H * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    return 2 * cfg["vocab_size"] * H + H + L * (attn + 3 * H * I + 2 * H)
