"""DrafterModelConfig: an EAGLE-3 drafter's hyperparameters and the target it serves.

One record, three places: training checkpoints (``drafter_config.json``), the export sidecar (its
``drafter_config`` key, see ``eaglenest.drafters.eagle3.format``) and the model (``eaglenest.drafters.eagle3.model``).
``aux_layer_ids`` are always physical ids (``eaglenest.contracts.layers``).

Two draft shapes share the EAGLE-3 algorithm (``draft_shape``): ``llama``, the Llama decoder layer SGLang serves as
``LlamaForCausalLMEagle3``, and ``mla``, a decoder layer with DeepSeek multi-head latent attention that SGLang serves
as ``Eagle3DeepseekV2ForCausalLM`` (public Kimi-K2.5 drafters). Only an ``mla`` drafter carries the MLA widths.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

DRAFT_SHAPES = ("llama", "mla")
LAUNCH_NUM_STEPS = 3
"""Draft steps of the chain an export is launched with unless told otherwise (SGLang 3-1-4, vLLM 3 speculative
tokens: ``serving``), and where the trainer cuts its simulated accept length (``ttt.step_metrics``)."""
MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The MLA ranks and head widths (DeepSeek-V3 / Kimi-K2.5 text-config keys of the same names)."""

@dataclass
class DrafterModelConfig:
    """The drafter's own hyperparameters (what ``config.json`` of an export records), plus the target it serves."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """the target's vocabulary (embedding rows, ``t2d`` length)"""
    draft_vocab_size: int
    aux_layer_ids: list[int]
    """physical ids (index into transformers' ``hidden_states``) of the three fused target layers"""
    target_hidden_size: int
    target_num_layers: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    target: str = ""
    """where the target came from (folder or hub id), recorded for preflight checks"""
    target_architecture: str = ""
    """the target's ``architectures[0]``: each engine's layer-id rule depends on it (``eaglenest.targets``); empty in
    checkpoints written before it was recorded (read as a Llama-style target)"""
    algorithm: str = "eagle3"
    """the drafter algorithm (``eaglenest.drafters.registry``)"""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    draft_shape: str = "llama"
    """``llama`` (q/k/v heads, ``LlamaForCausalLMEagle3``) or ``mla`` (DeepSeek MLA, ``Eagle3DeepseekV2ForCausalLM``)"""
    q_lora_rank: int | None = None
    """MLA only: query down-projection rank (SGLang's MLA drafter requires one)"""
    kv_lora_rank: int | None = None
    """MLA only: the compressed key/value latent width"""
    qk_nope_head_dim: int | None = None
    """MLA only: per-head query/key width without RoPE"""
    qk_rope_head_dim: int | None = None
    """MLA only: per-head query/key width with RoPE (the key part is shared by all heads)"""
    v_head_dim: int | None = None
    """MLA only: per-head value width"""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per aux layer before ``fc`` (tensors ``fc_norm.{0,1,2}.weight``)"""
    norm_output: bool = False
    """EAGLE-3.1: the hidden state fed to the next draft step is the post-norm one (default: pre-norm)"""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab {self.vocab_size}")
        if len(self.aux_layer_ids) != 3:
            problems.append(f"EAGLE-3 fuses exactly 3 aux layers, got {self.aux_layer_ids}")
        problems.extend(self._shape_problems())
        if problems:
            raise ValueError("invalid drafter config: " + "; ".join(problems))
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]

    def _shape_problems(self) -> list[str]:
        if self.draft_shape not in DRAFT_SHAPES:
            return [f"draft_shape {self.draft_shape!r} is not one of {list(DRAFT_SHAPES)}"]
        widths = {k: getattr(self, k) for k in MLA_WIDTHS}
        if self.draft_shape == "llama":
            given = sorted(k for k, v in widths.items() if v is not None)
            return [f"{given} are MLA widths; a llama-shaped drafter has none (set draft_shape: mla)"] if given else []
        bad = sorted(k for k, v in widths.items() if not (isinstance(v, int) and v > 0))
        if bad:
            return [f"an MLA drafter needs positive {bad} (SGLang's Eagle3DeepseekV2ForCausalLM requires q_lora_rank "
                    f"too); take them from the target's text config (mla_widths)"]
        problems = []
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append(f"an MLA drafter has one key/value head per query head: num_key_value_heads "
                            f"{self.num_key_value_heads} != num_attention_heads {self.num_attention_heads}")
        return problems

    @property
    def is_mla(self) -> bool:
        return self.draft_shape == "mla"

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query/key: ``head_dim`` (llama) or ``qk_nope_head_dim + qk_rope_head_dim`` (mla)."""
        if self.is_mla:
            return int(self.qk_nope_head_dim or 0) + int(self.qk_rope_head_dim or 0)
        return self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def mla_widths(cls, text_config: dict[str, Any], **overrides: int | None) -> dict[str, int]:
        """The MLA widths of a drafter for a target whose text config is ``text_config`` (DeepSeek-V3 / Kimi keys, as
        ``eaglenest.targets`` records read them); each non-None override replaces the target's value."""
        out = {}
        for k in MLA_WIDTHS:
            v = overrides.get(k)
            v = text_config.get(k) if v is None else v
            if v is None:
                raise ValueError(f"the target's text config has no {k} (not an MLA target, or its config.json is not "
                                 f"readable here); give {k} explicitly")
            out[k] = int(v)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DrafterModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
