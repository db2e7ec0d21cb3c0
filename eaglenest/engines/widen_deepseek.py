"""Function-preserving expansion of a small DeepseekV3 (MLA + MoE) to Kimi-K2.5's interface widths.

The Llama rules (``engines.widen``) carried over to DeepSeek's layer, with what MLA and MoE add. Each rule is exact
in real arithmetic; with the default stand-in shapes (every width grows 4x) every rescale is a power of two, so
exact in bf16 too.

- **Normed widths.** Every RMSNorm whose width grows from d to D (the residual stream's ``input_layernorm``,
  ``post_attention_layernorm`` and ``model.norm``; MLA's ``q_a_layernorm`` over the q rank and ``kv_a_layernorm``
  over the kv rank) sees the small vector scaled by c = sqrt(D / d) with zeros after it: its RMS over D equals the
  small RMS over d, so eps is unchanged, and the norm's weight is divided by c. The scale is put into what writes
  the normed vector: the residual stream is scaled by c (``embed_tokens``, ``o_proj``, the dense MLP's and every
  expert's ``down_proj``), the q/kv latents by their own c (``q_a_proj`` rows, the kv rows of
  ``kv_a_proj_with_mqa``). eps stays as it was, which matters: transformers' MLA norms use a fixed eps of 1e-6 while
  SGLang's use ``rms_norm_eps``, so both agree only when the config's eps is 1e-6 and nothing rescales it.
- **MLA heads.** Small head h becomes wide head h * NH // nh; its no-RoPE query/key part and value part keep their
  first channels (the rest zero, so q.k and the value are unchanged), the RoPE part (qk_rope_head_dim, shared key)
  is copied as it is (the rotary frequencies depend on its width, which must not change). Other heads have zero
  query, key, value and ``o_proj`` columns: they write nothing.
- **Softmax scale.** DeepSeek scales scores by (qk_nope + qk_rope)^-0.5, times mscale^2 with YaRN: a wider no-RoPE
  part changes it, so the query (``q_b_proj`` rows) is multiplied by scale_small / scale_wide.
- **MoE.** The router (sigmoid scores + ``e_score_correction_bias`` for the choice, the chosen scores normalised,
  times ``routed_scaling_factor``) chooses ``num_experts_per_tok`` experts, the same number in both shapes. Small
  expert e becomes wide expert e * N // E; every added expert has zero router weights, zero weights, and a
  correction bias of ``NEVER_ROUTED_BIAS`` (sigmoid scores lie in (0, 1), so the k chosen are always the small
  model's) -- never chosen, and writing nothing if it were. A different ``routed_scaling_factor`` is compensated in
  the experts' ``down_proj``. The shared expert grows like a dense MLP.
- **Depth.** Small layer j goes to wide layer floor(j * L_wide / L_small) (dense layers onto dense ones, MoE onto
  MoE); other wide layers are all zeros, an exact identity (attention and MLP write zero).
- **Vocabulary.** Rows past the small vocabulary are zero in ``embed_tokens`` (never looked up: the tokenizer cannot
  produce them) and in ``lm_head``, so their logits are exactly 0. That alone does not keep them from being sampled
  (a zero logit can beat every real one); the stand-in's pre-training therefore trains the small model as the
  wide-vocabulary model it will be served as (``engines.standin_deepseek.padded_vocab_loss``), so the zero-logit ids
  carry the probability that model learned to give ids it never saw.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from eaglenest.engines.widen import WidenError, layer_positions
from eaglenest.targets.deepseek_v3 import SGLANG_MOE_KEYS

NEVER_ROUTED_BIAS = -1.0e4
"""``e_score_correction_bias`` of an added expert: below every real choice score (sigmoid + a small model's bias)"""


@dataclass(frozen=True)
class DeepseekWideShape:
    """The shape to grow into; the defaults are Kimi-K2.5's text model with ``n_routed_experts`` experts."""

    hidden_size: int = 7168
    num_layers: int = 61
    num_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 8
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    vocab_size: int = 163840
    routed_scaling_factor: float = 2.827


KIMI_K25_ROUTED_EXPERTS = 384


def softmax_scale(cfg: dict) -> float:
    """DeepSeek's attention score scale: (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 with YaRN."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = _rope(cfg)
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _rope(cfg: dict) -> dict:
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def _is_moe(cfg: dict, i: int) -> bool:
    return cfg.get("n_routed_experts") is not None and i >= cfg["first_k_dense_replace"] and \
        i % cfg.get("moe_layer_freq", 1) == 0


def check_deepseek_shapes(small: dict, wide: DeepseekWideShape) -> None:
    """Refuse shapes the rules in the module docstring cannot map exactly."""
    problems = []
    for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
              "moe_intermediate_size", "n_routed_experts", "vocab_size"):
        if small.get(k) is None:
            problems.append(f"the small model needs {k}")
        elif getattr(wide, k) < small[k]:
            problems.append(f"wide {k} {getattr(wide, k)} is narrower than the small model's {small[k]}")
    if problems:
        raise WidenError("cannot widen function-preservingly: " + "; ".join(problems))
    if wide.qk_rope_head_dim != small["qk_rope_head_dim"]:
        problems.append(f"qk_rope_head_dim must stay {small['qk_rope_head_dim']} (the rotary frequencies depend on it)")
    if wide.num_heads < small["num_attention_heads"]:
        problems.append("the wide model must not have fewer heads")
    if wide.num_layers < small["num_hidden_layers"]:
        problems.append("the wide stack must not have fewer layers than the small model")
    if wide.num_experts_per_tok != small["num_experts_per_tok"]:
        problems.append(f"num_experts_per_tok must stay {small['num_experts_per_tok']} (the chosen scores are "
                        "normalised over the chosen experts: a different count changes every weight)")
    shared = small.get("n_shared_experts") or 0
    if bool(shared) != bool(wide.n_shared_experts) or \
            shared * small["moe_intermediate_size"] > wide.n_shared_experts * wide.moe_intermediate_size:
        problems.append("the shared expert must exist in both models or in neither, and not narrow")
    if (small.get("n_group") or 1) != 1 or (small.get("topk_group") or 1) != 1:
        problems.append("group-limited routing is not mapped (n_group and topk_group must be 1, as Kimi's)")
    if small.get("q_lora_rank") is None:
        problems.append("the small model must use a q LoRA rank (q_a_proj / q_b_proj), as Kimi does")
    if small.get("tie_word_embeddings"):
        problems.append("tied embeddings are not supported")
    if small.get("moe_layer_freq", 1) != 1:
        problems.append("moe_layer_freq must be 1")
    wcfg = {"first_k_dense_replace": wide.first_k_dense_replace, "n_routed_experts": wide.n_routed_experts}
    for j, i in enumerate(layer_positions(small["num_hidden_layers"], wide.num_layers)):
        if _is_moe(small, j) != _is_moe(wcfg, i):
            problems.append(f"small layer {j} ({'MoE' if _is_moe(small, j) else 'dense'}) would land on wide layer "
                            f"{i} of the other kind")
            break
    if problems:
        raise WidenError("cannot widen function-preservingly: " + "; ".join(problems))


def widen_deepseek_config(small: dict, wide: DeepseekWideShape) -> dict:
    """The wide model's config.json: the small config with the wide widths and every key SGLang's DeepseekV2 reads."""
    check_deepseek_shapes(small, wide)
    cfg = {k: v for k, v in small.items() if k not in ("qk_head_dim", "head_dim", "_name_or_path", "dtype")}
    cfg.update(asdict(wide))
    cfg.pop("num_layers")
    cfg.pop("num_heads")
    rope = _rope(small)
    cfg.update(num_hidden_layers=wide.num_layers, num_attention_heads=wide.num_heads,
               num_key_value_heads=wide.num_heads, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, n_group=1, topk_group=1,
               norm_topk_prob=True, num_nextn_predict_layers=0, rope_interleave=small.get("rope_interleave", True),
               rope_theta=float(rope.get("rope_theta", small.get("rope_theta", 10000.0))),
               rope_scaling=None if rope.get("rope_type", "default") == "default" else
               {k: v for k, v in rope.items() if k != "rope_theta"}, ep_size=1)
    missing = [k for k in SGLANG_MOE_KEYS if k not in cfg]
    assert not missing, missing
    return cfg


def widen_deepseek_layers(small_sd: dict[str, torch.Tensor], small: dict, wide: DeepseekWideShape, *,
                          dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
                          ) -> Iterator[tuple[str | int, dict[str, torch.Tensor]]]:
    """The wide weights in SGLang's / DeepSeek's checkpoint names, one group at a time: ``("embed", ...)``, then
    ``(i, layer i's tensors)`` for every wide layer, then ``("head", ...)`` -- so a caller can write each group to
    disk before the next is built (the whole wide model never sits in memory)."""
    check_deepseek_shapes(small, wide)
    hs, H = small["hidden_size"], wide.hidden_size
    c = math.sqrt(H / hs)
    cq = math.sqrt(wide.q_lora_rank / small["q_lora_rank"])
    ckv = math.sqrt(wide.kv_lora_rank / small["kv_lora_rank"])
    wcfg = widen_deepseek_config(small, wide)
    fq = softmax_scale(small) / softmax_scale(wcfg)
    f_routed = small["routed_scaling_factor"] / wide.routed_scaling_factor

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    def src(name: str) -> torch.Tensor:
        return small_sd[name].to(device=device, dtype=torch.float32)

    def norm(name: str | None, width: int, small_width: int, scale: float) -> torch.Tensor:
        w = torch.full((width,), 1.0 / scale, dtype=torch.float32, device=device)
        if name is not None:
            w[:small_width] = src(name) / scale
        return w.to(dtype)

    def mlp(prefix: str, gate: torch.Tensor | None, up: torch.Tensor | None, down: torch.Tensor | None,
            inter: int, down_scale: float) -> dict[str, torch.Tensor]:
        g, u, d = z(inter, H), z(inter, H), z(H, inter)
        if gate is not None:
            fi = gate.shape[0]
            g[:fi, :hs], u[:fi, :hs] = gate.to(dtype), up.to(dtype)
            d[:hs, :fi] = (down * down_scale).to(dtype)
        return {prefix + "gate_proj.weight": g, prefix + "up_proj.weight": u, prefix + "down_proj.weight": d}

    vocab = small_sd["model.embed_tokens.weight"].shape[0]
    emb = z(wide.vocab_size, H)
    emb[:vocab, :hs] = (src("model.embed_tokens.weight") * c).to(dtype)
    yield "embed", {"model.embed_tokens.weight": emb}

    nh = small["num_attention_heads"]
    dn, dr, dv = small["qk_nope_head_dim"], small["qk_rope_head_dim"], small["v_head_dim"]
    DN, DV, NH = wide.qk_nope_head_dim, wide.v_head_dim, wide.num_heads
    rq, rkv, RQ, RKV = small["q_lora_rank"], small["kv_lora_rank"], wide.q_lora_rank, wide.kv_lora_rank
    E, N = small["n_routed_experts"], wide.n_routed_experts
    experts_at = layer_positions(E, N)
    mapped = dict(zip(layer_positions(small["num_hidden_layers"], wide.num_layers),
                      range(small["num_hidden_layers"]), strict=True))
    for i in range(wide.num_layers):
        p = f"model.layers.{i}."
        j = mapped.get(i)
        s = None if j is None else f"model.layers.{j}."
        out: dict[str, torch.Tensor] = {}
        q_a, q_b = z(RQ, H), z(NH * (DN + dr), RQ)
        kv_a, kv_b, o = z(RKV + dr, H), z(NH * (DN + DV), RKV), z(H, NH * DV)
        if s is not None:
            sa = s + "self_attn."
            q_a[:rq, :hs] = (src(sa + "q_a_proj.weight") * cq).to(dtype)
            skv = src(sa + "kv_a_proj_with_mqa.weight")
            kv_a[:rkv, :hs] = (skv[:rkv] * ckv).to(dtype)
            kv_a[RKV:, :hs] = skv[rkv:].to(dtype)  # the shared RoPE key: not normed, unscaled
            sqb, skvb, so = src(sa + "q_b_proj.weight") * fq, src(sa + "kv_b_proj.weight"), src(sa + "o_proj.weight")
            for h in range(nh):
                w = h * NH // nh
                sq0, wq0 = h * (dn + dr), w * (DN + dr)
                q_b[wq0:wq0 + dn, :rq] = sqb[sq0:sq0 + dn].to(dtype)
                q_b[wq0 + DN:wq0 + DN + dr, :rq] = sqb[sq0 + dn:sq0 + dn + dr].to(dtype)
                sk0, wk0 = h * (dn + dv), w * (DN + DV)
                kv_b[wk0:wk0 + dn, :rkv] = skvb[sk0:sk0 + dn].to(dtype)
                kv_b[wk0 + DN:wk0 + DN + dv, :rkv] = skvb[sk0 + dn:sk0 + dn + dv].to(dtype)
                o[:hs, w * DV:w * DV + dv] = (so[:, h * dv:(h + 1) * dv] * c).to(dtype)
        a = p + "self_attn."
        out[a + "q_a_proj.weight"], out[a + "q_b_proj.weight"] = q_a, q_b
        out[a + "kv_a_proj_with_mqa.weight"], out[a + "kv_b_proj.weight"], out[a + "o_proj.weight"] = kv_a, kv_b, o
        out[a + "q_a_layernorm.weight"] = norm(s and s + "self_attn.q_a_layernorm.weight", RQ, rq, cq)
        out[a + "kv_a_layernorm.weight"] = norm(s and s + "self_attn.kv_a_layernorm.weight", RKV, rkv, ckv)
        out[p + "input_layernorm.weight"] = norm(s and s + "input_layernorm.weight", H, hs, c)
        out[p + "post_attention_layernorm.weight"] = norm(s and s + "post_attention_layernorm.weight", H, hs, c)
        if not _is_moe(wcfg, i):
            got = (src(s + "mlp.gate_proj.weight"), src(s + "mlp.up_proj.weight"),
                   src(s + "mlp.down_proj.weight")) if s else (None, None, None)
            out.update(mlp(p + "mlp.", *got, wide.intermediate_size, c))
        else:
            gate = z(N, H)
            bias = torch.full((N,), NEVER_ROUTED_BIAS, dtype=torch.float32, device=device)
            bias[experts_at] = 0.0
            if s is not None:
                gate[experts_at, :hs] = src(s + "mlp.gate.weight").to(dtype)
                sb = small_sd.get(s + "mlp.gate.e_score_correction_bias")
                if sb is not None:
                    bias[experts_at] = sb.to(device=device, dtype=torch.float32)
            out[p + "mlp.gate.weight"], out[p + "mlp.gate.e_score_correction_bias"] = gate, bias
            small_expert = {e: _small_expert(small_sd, s, e, src) for e in range(E)} if s else {}
            for e_wide in range(N):
                e = experts_at.index(e_wide) if e_wide in experts_at else None
                got = small_expert[e] if e is not None and s else (None, None, None)
                out.update(mlp(p + f"mlp.experts.{e_wide}.", *got, wide.moe_intermediate_size, c * f_routed))
            if wide.n_shared_experts:
                got = tuple(src(s + f"mlp.shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")) \
                    if s else (None, None, None)
                out.update(mlp(p + "mlp.shared_experts.", *got, wide.moe_intermediate_size * wide.n_shared_experts,
                               c))
        yield i, out

    head = z(wide.vocab_size, H)
    head[:vocab, :hs] = src("lm_head.weight").to(dtype)
    yield "head", {"model.norm.weight": norm("model.norm.weight", H, hs, c), "lm_head.weight": head}


def _small_expert(sd: dict[str, torch.Tensor], s: str, e: int, src) -> tuple[torch.Tensor, ...]:
    """Small expert e's (gate, up, down), from transformers' fused tensors or per-expert checkpoint names."""
    fused = s + "mlp.experts.gate_up_proj"
    if fused in sd:
        gate_up, down = src(fused)[e], src(s + "mlp.experts.down_proj")[e]
        inter = gate_up.shape[0] // 2
        return gate_up[:inter], gate_up[inter:], down
    return tuple(src(s + f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))


def widen_deepseek_state_dict(small_sd: dict[str, torch.Tensor], small: dict, wide: DeepseekWideShape,
                              **kw) -> dict[str, torch.Tensor]:
    """Every group of :func:`widen_deepseek_layers` in one dict (small shapes and tests)."""
    out: dict[str, torch.Tensor] = {}
    for _, group in widen_deepseek_layers(small_sd, small, wide, **kw):
        out.update(group)
    return out


def deepseek_parameters(cfg: dict) -> dict[str, int]:
    """Parameter counts of a DeepseekV3 config without building it: ``total``, ``routed`` (all routed experts),
    ``active_per_token`` (what one token's forward multiplies: attention, dense MLPs, the shared and the
    ``num_experts_per_tok`` chosen experts of each MoE layer, the router, ``lm_head``; the embedding row is a lookup)
    and ``bytes`` (bf16 weights, fp32 correction biases)."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, dr = cfg["num_attention_heads"], cfg["qk_rope_head_dim"]
    rq, rkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    qk = cfg["qk_nope_head_dim"] + dr
    attn = (H * rq + rq + rq * nh * qk + H * (rkv + dr) + rkv + rkv * nh * (cfg["qk_nope_head_dim"]
            + cfg["v_head_dim"]) + nh * cfg["v_head_dim"] * H)
    expert = 3 * H * cfg["moe_intermediate_size"]
    dense_mlp = 3 * H * cfg["intermediate_size"]
    n_moe = sum(_is_moe(cfg, i) for i in range(L))
    n_dense = L - n_moe
    E, k, shared = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg.get("n_shared_experts") or 0
    router = E * H + E
    per_layer = attn + 2 * H
    total = 2 * V * H + H + L * per_layer + n_dense * dense_mlp + n_moe * (router + (E + shared) * expert)
    active = V * H + H + L * per_layer + n_dense * dense_mlp + n_moe * (E * H + (k + shared) * expert)
    return {"total": total, "routed": n_moe * E * expert, "active_per_token": active,
            "bytes": 2 * (total - n_moe * E) + 4 * n_moe * E}
