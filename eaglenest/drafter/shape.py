"""The drafter's shape, derived from the target's facts: the one model-config builder of both training loops.

EAGLE-3's default drafter is one decoder layer shaped like the target's; ``eaglenest train`` lets its
``train.drafter`` config section override the attention and MLP widths, the in-process fitter only the MLP width.
``draft_shape="mla"`` builds the MLA-attention layer (Kimi-K2.5's public drafters): its ranks and head widths default
to the target's text config, read through the target's architecture record (``eaglenest.targets``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.config import MLA_WIDTHS, DrafterModelConfig


def target_widths(facts: TargetSpec, text_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The architecture's own widths (MLA ranks, ...) of the target: from ``text_config`` when given, else from the
    target folder's config.json (its text config for a multimodal wrapper); {} when neither is readable."""
    arch = facts.arch
    if text_config is None:
        cfg_path = Path(facts.path).expanduser() / "config.json" if facts.path else None
        if cfg_path is None or not cfg_path.is_file():
            return {}
        raw = json.loads(cfg_path.read_text())
        text_config = (raw.get(arch.text_config_key) if arch.text_config_key else None) or raw.get("text_config") or raw
    return arch.widths(text_config)


def drafter_model_config(facts: TargetSpec, aux_layer_ids: Sequence[int], draft_vocab_size: int, *,
                         num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                         intermediate_size: int | None = None,
                         max_position_embeddings: int | None = None, draft_shape: str = "llama",
                         mla: Mapping[str, int | None] | None = None,
                         text_config: Mapping[str, Any] | None = None, fc_norm: bool = False,
                         norm_output: bool = False) -> DrafterModelConfig:
    """A drafter over ``facts``' target; each ``None`` override takes the target's value.

    Changing the head count without giving ``num_kv_heads``/``head_dim`` uses plain multi-head attention over the
    target's hidden size (the target's GQA ratio and head width belong to its own head count).
    ``draft_shape="mla"``: ``mla`` overrides the MLA widths (``q_lora_rank``, ...), the rest come from the target's
    ``text_config`` (default: read from its folder); an MLA layer has one key/value head per query head.
    ``fc_norm`` / ``norm_output``: EAGLE-3.1's options (both shapes).
    """
    heads = num_heads or facts.num_attention_heads
    same_heads = heads == facts.num_attention_heads
    widths: dict[str, int] = {}
    if draft_shape == "mla":
        unknown = sorted(set(mla or {}) - set(MLA_WIDTHS))
        if unknown:
            raise ValueError(f"unknown MLA widths {unknown}; known: {list(MLA_WIDTHS)}")
        widths = DrafterModelConfig.mla_widths(target_widths(facts, text_config), **dict(mla or {}))
        num_kv_heads = heads
        head_dim = widths["qk_nope_head_dim"] + widths["qk_rope_head_dim"]
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
        draft_shape=draft_shape,
        fc_norm=fc_norm,
        norm_output=norm_output,
        **widths,
    )


def resolve_model_config(cfg: EaglenestConfig, facts: TargetSpec, aux_layer_ids: Sequence[int],
                         draft_vocab_size: int) -> DrafterModelConfig:
    """``eaglenest train``'s drafter: the target's hidden size, heads etc. unless the train.drafter section overrides
    them."""
    d = cfg.train.drafter
    return drafter_model_config(facts, aux_layer_ids, draft_vocab_size, num_heads=d.num_heads,
                                num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                                intermediate_size=d.intermediate_size,
                                max_position_embeddings=d.max_position_embeddings, **d.shape_kwargs())
