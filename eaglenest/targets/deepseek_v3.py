"""DeepSeek-V3-style targets (DeepseekV2/V3, Kimi-K2.5): MLA attention and MoE layers.

SGLang 0.5.14 (``models/deepseek_v2.py``) numbers aux layers with the first-id rule: ids are physical unless the first
is 1, then every id gets +1 (both [1, 2, 3] and [2, 3, 4] capture physical [2, 3, 4]; measured on the H200). Its
``DeepseekV2DecoderLayer`` is called with 7 positional arguments (positions, hidden, ForwardBatch, residual — None at
layer 0 —, a BumpAllocator, None, None) and returns ``(hidden, residual, topk_indices)``; ``model.norm`` returns
``(normed, residual)``. Kimi-K2.5 wraps the DeepseekV3 text model (``KimiK25ForConditionalGeneration``, its config under
``text_config``; SGLang's ``models/kimi_k25.py`` holds it as ``language_model``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eaglenest.targets.base import LayerCall, TargetArch

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "first_k_dense_replace", "moe_layer_freq")
SGLANG_MOE_KEYS = ("topk_method", "scoring_func", "moe_layer_freq")
"""Read by SGLang's DeepseekV2 model but not defined by transformers' ``DeepseekV3Config``: a config written by
transformers alone lacks them and SGLang fails at load (measured with 0.5.14)."""


def mla_moe_widths(tc: Mapping[str, Any]) -> dict[str, Any]:
    """MLA ranks and head dims, MoE widths, as the text config states them (absent keys are left out)."""
    return {k: tc[k] for k in (*MLA_KEYS, *MOE_KEYS) if tc.get(k) is not None}


_LAYER_CALL = LayerCall(forward_batch_arg=2, output_hidden=0, output_residual=1, output_len=3)

DEEPSEEK_V3 = TargetArch(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM"),
    model_types=("deepseek_v3", "deepseek_v2", "deepseek_v32"),
    sglang_rule="first_id",
    attention="mla",
    layer_call=_LAYER_CALL,
    extra_widths=mla_moe_widths,
    generation_capture=True,  # H200, SGLang 0.5.14, DeepseekV3ForCausalLM: within bf16 tolerance of prefill capture
)

KIMI_K25 = TargetArch(
    name="kimi_k25",
    architectures=("KimiK25ForConditionalGeneration",),
    model_types=("kimi_k25",),
    sglang_rule="first_id",
    attention="mla",
    sglang_layers="language_model.model.layers.{i}",
    sglang_norm="language_model.model.norm",
    layer_call=_LAYER_CALL,
    text_config_key="text_config",
    extra_widths=mla_moe_widths,
    generation_capture=True,  # H200, SGLang 0.5.14, the same text model inside the wrapper: as DeepseekV3
)

FIRST_ID_RULE_OTHERS = ("GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "Glm4MoeLiteForCausalLM")
"""Other SGLang 0.5.14 models that subclass DeepseekV2's numbering (glm4_moe.py, mistral_large_3.py,
glm4_moe_lite.py); served with the first-id rule, nothing else of theirs is modelled."""

DEEPSEEK_FAMILY = TargetArch(
    name="deepseek_family",
    architectures=FIRST_ID_RULE_OTHERS,
    sglang_rule="first_id",
    attention="mla",
    layer_call=_LAYER_CALL,
)
