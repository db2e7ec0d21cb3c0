"""The one layer-numbering convention of eaglenest, and its translations.

Physical ids index transformers' ``hidden_states`` tuple: 0 is the embedding output, ``k`` is the output of decoder
layer ``k-1`` (the residual stream entering layer ``k``). Every shard manifest and checkpoint stores physical ids;
only exporters and engine launchers translate, here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence


class LayerIdError(ValueError):
    """Aux layer ids that cannot be captured from the target."""


FIRST_ID_RULE_ARCHS = frozenset({
    # sglang 0.5.14 models whose set_eagle3_layers_to_capture adds 1 only when the first id is 1 (PR #25454):
    # models/deepseek_v2.py (and subclasses in glm4_moe.py, mistral_large_3.py), glm4_moe_lite.py, kimi_k25.py.
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "Glm4MoeLiteForCausalLM",
})
"""Every other architecture with EAGLE-3 support (llama.py, qwen*.py, ...) always adds 1."""


def uses_first_id_rule(architecture: str) -> bool:
    """Whether SGLang 0.5.14 numbers this target's aux layers with the DeepSeek/Kimi first-id rule."""
    return architecture in FIRST_ID_RULE_ARCHS


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps for an ``num_layers``-layer target: low, middle and high (Kimi-K2.5: 2, 30, 58)."""
    if num_layers < 4:
        raise LayerIdError(f"a target needs at least 4 decoder layers for EAGLE-3 taps, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Check physical ids against the target; capture needs 1..num_layers-1 (0 is the embedding, N the final norm)."""
    ids = [int(i) for i in layer_ids]
    if len(ids) != 3:
        raise LayerIdError(f"EAGLE-3 fuses exactly 3 aux layers, got {len(ids)}: {ids}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise LayerIdError(
            f"aux layer ids {bad} are out of range for a {num_layers}-layer target: physical ids must lie in "
            f"1..{num_layers - 1} (hidden_states index; default {default_aux_layer_ids(num_layers)})"
        )
    if len(set(ids)) != 3:
        raise LayerIdError(f"aux layer ids must be distinct, got {ids}")
    return ids


def to_sglang_ids(physical_ids: Sequence[int]) -> list[int]:
    """SGLang's ``eagle_aux_hidden_state_layer_ids`` (it adds 1 back): physical - 1."""
    return [int(i) - 1 for i in physical_ids]


def to_vllm_ids(physical_ids: Sequence[int]) -> list[int]:
    """vLLM / speculators use the physical ids unchanged."""
    return [int(i) for i in physical_ids]


def sglang_captured_layers(config_ids: Sequence[int] | None, num_layers: int, *, deepseek_family: bool) -> list[int]:
    """Physical layers SGLang 0.5.14 really captures for a drafter config's ids (reference/sglang.md §A.4).

    Llama-style targets always add 1; DeepSeek/Kimi targets add 1 only when the first id is 1 (PR #25454).
    """
    if config_ids is None:
        return default_aux_layer_ids(num_layers)
    ids = [int(i) for i in config_ids]
    if deepseek_family and (not ids or ids[0] != 1):
        return ids
    return [i + 1 for i in ids]


def sglang_config_ids_for(physical_ids: Sequence[int], num_layers: int, *, first_id_rule: bool) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang 0.5.14 capture exactly ``physical_ids``."""
    phys = [int(i) for i in physical_ids]
    for cand in ([i - 1 for i in phys], phys):
        if sglang_captured_layers(cand, num_layers, deepseek_family=first_id_rule) == phys:
            return cand
    raise LayerIdError(
        f"no eagle_aux_hidden_state_layer_ids make SGLang capture physical layers {phys} for this target"
    )
