"""What an EAGLE-3 export holds, per draft shape: config.json's architecture and model type, the tensor names the
serving engine's loader maps and their shapes (``eaglenest.drafters.eagle3.format`` writes and checks exports with
them).

``llama``: SGLang's ``LlamaForCausalLMEagle3.load_weights`` (``model.`` prefix optional). ``mla``: SGLang 0.5.14's
``Eagle3DeepseekV2ForCausalLM.load_weights`` (``models/kimi_k25_eagle3.py``): it prefixes every name but ``lm_head.*``
with ``model.`` and renames ``layers.0.`` to ``midlayer.``, stacks ``gate_proj``/``up_proj`` and fuses ``q_a_proj`` +
``kv_a_proj_with_mqa`` (rows in that order) into ``fused_qkv_a_proj_with_mqa``; a name it does not know is dropped
with a warning, a ``model.``-prefixed one included.
"""

from __future__ import annotations

from typing import Any

from eaglenest.drafters.eagle3.config import DrafterModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
ARCHITECTURES = {"llama": ARCHITECTURE, "mla": MLA_ARCHITECTURE}
"""config.json ``architectures[0]`` of each draft shape (``DrafterModelConfig.draft_shape``)."""
MODEL_TYPES = {"llama": "llama", "mla": "deepseek_v3"}

REQUIRED_DRAFT_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.self_attn.q_proj.weight",
                          "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                          "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                          "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
                          "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                          "midlayer.post_attention_layernorm.weight")
"""Names SGLang's LlamaForCausalLMEagle3.load_weights maps (``model.`` prefix optional); unknown names it drops."""
REQUIRED_TENSORS: tuple[str, ...] = (*REQUIRED_DRAFT_WEIGHTS, "t2d")
"""Everything an eaglenest EAGLE-3 export holds (``t2d``: eaglenest's own loader rebuilds the vocab map from it)."""
OPTIONAL_TENSORS = ("embed_tokens.weight",)
"""The frozen target embedding; without it SGLang and vLLM share the target's."""
MLA_ATTENTION_WEIGHTS = tuple(f"midlayer.self_attn.{n}.weight" for n in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
"""The MLA attention's checkpoint names, as SGLang's Eagle3DeepseekV2ForCausalLM.load_weights maps them."""
MLA_REQUIRED_DRAFT_WEIGHTS: tuple[str, ...] = (
    *(k for k in REQUIRED_DRAFT_WEIGHTS if not k.startswith("midlayer.self_attn.")), *MLA_ATTENTION_WEIGHTS)
FC_NORM_WEIGHTS = tuple(f"fc_norm.{i}.weight" for i in range(3))
"""EAGLE-3.1's per-aux-layer norms (config ``fc_norm: true``), loaded by both SGLang drafter classes."""


def required_draft_weights(shape: str = "llama", fc_norm: bool = False) -> tuple[str, ...]:
    """The tensors the serving engine must find for a drafter of this shape (it drops unknown names silently)."""
    base = MLA_REQUIRED_DRAFT_WEIGHTS if shape == "mla" else REQUIRED_DRAFT_WEIGHTS
    return (*base, *FC_NORM_WEIGHTS) if fc_norm else base


def required_tensors(cfg: DrafterModelConfig) -> tuple[str, ...]:
    """Everything an eaglenest export of ``cfg`` holds besides the optional embedding."""
    return (*required_draft_weights(cfg.draft_shape, cfg.fc_norm), "t2d")


def draft_shape_of(architecture: str) -> str | None:
    """``llama`` / ``mla`` for a drafter config.json's ``architectures[0]``; None when it is neither."""
    return next((shape for shape, arch in ARCHITECTURES.items() if arch == architecture), None)


def mla_config(cfg: DrafterModelConfig) -> dict[str, Any]:
    """The keys SGLang's MLA drafter (``DeepseekV2AttentionMLA`` + ``ModelConfig``'s MLA branch) reads, and the ones
    transformers' ``DeepseekV3Config`` would otherwise default to DeepSeek-V3's values."""
    return {
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,  # what DeepseekV3Config sets; SGLang sizes the MLA cache from the ranks
        "num_key_value_heads": cfg.num_attention_heads,
        "rope_interleave": True,
    }


def _attention_shapes(cfg: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    a = "midlayer.self_attn."
    if not cfg.is_mla:
        return {
            f"{a}q_proj.weight": (heads * d, 2 * h),
            f"{a}k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
            f"{a}v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
            f"{a}o_proj.weight": (h, heads * d),
        }
    qa, kva, rope, v = int(cfg.q_lora_rank), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    nope = int(cfg.qk_nope_head_dim)
    return {
        f"{a}q_a_proj.weight": (qa, 2 * h),
        f"{a}q_a_layernorm.weight": (qa,),
        f"{a}q_b_proj.weight": (heads * (nope + rope), qa),
        f"{a}kv_a_proj_with_mqa.weight": (kva + rope, 2 * h),
        f"{a}kv_a_layernorm.weight": (kva,),
        f"{a}kv_b_proj.weight": (heads * (nope + v), kva),
        f"{a}o_proj.weight": (h, heads * v),
    }


def expected_shapes(cfg: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    fc_norm = {k: (cfg.target_hidden_size,) for k in FC_NORM_WEIGHTS} if cfg.fc_norm else {}
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        **fc_norm,
        **_attention_shapes(cfg),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
    }
