"""The drafter's shape, derived from the target's facts: the one model-config builder of both training loops.

EAGLE-3's default drafter is one decoder layer shaped like the target's; ``eaglenest train`` lets its
``train.drafter`` config section override the attention and MLP widths, the in-process fitter only the MLP width.
"""

from __future__ import annotations

from collections.abc import Sequence

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.config import DrafterModelConfig


def drafter_model_config(facts: TargetSpec, aux_layer_ids: Sequence[int], draft_vocab_size: int, *,
                         num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                         intermediate_size: int | None = None,
                         max_position_embeddings: int | None = None) -> DrafterModelConfig:
    """A drafter over ``facts``' target; each ``None`` override takes the target's value.

    Changing the head count without giving ``num_kv_heads``/``head_dim`` uses plain multi-head attention over the
    target's hidden size (the target's GQA ratio and head width belong to its own head count).
    """
    heads = num_heads or facts.num_attention_heads
    same_heads = heads == facts.num_attention_heads
    return DrafterModelConfig(
        hidden_size=facts.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=num_kv_heads or (facts.num_key_value_heads if same_heads else heads),
        head_dim=head_dim or (facts.head_dim if same_heads else facts.hidden_size // heads),
        intermediate_size=intermediate_size or facts.intermediate_size,
        vocab_size=facts.vocab_size,
        draft_vocab_size=min(int(draft_vocab_size), facts.vocab_size),
        aux_layer_ids=list(aux_layer_ids),
        target_hidden_size=facts.hidden_size,
        target_num_layers=facts.num_layers,
        rope_theta=facts.rope_theta,
        rms_norm_eps=facts.rms_norm_eps,
        max_position_embeddings=max(max_position_embeddings or 0, facts.max_position_embeddings),
        target=facts.path,
        target_architecture=facts.architecture if facts.architecture != "?" else "",
        bos_token_id=facts.bos_token_id,
        eos_token_id=facts.eos_token_id,
    )


def resolve_model_config(cfg: EaglenestConfig, facts: TargetSpec, aux_layer_ids: Sequence[int],
                         draft_vocab_size: int) -> DrafterModelConfig:
    """``eaglenest train``'s drafter: the target's hidden size, heads etc. unless the train.drafter section overrides
    them."""
    d = cfg.train.drafter
    return drafter_model_config(facts, aux_layer_ids, draft_vocab_size, num_heads=d.num_heads,
                                num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                                intermediate_size=d.intermediate_size,
                                max_position_embeddings=d.max_position_embeddings)
