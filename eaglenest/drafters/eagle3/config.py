"""DrafterModelConfig: an EAGLE-3 drafter's hyperparameters and the target it serves.

One record, three places: training checkpoints (``drafter_config.json``), the export sidecar (its
``drafter_config`` key, see ``eaglenest.drafters.eagle3.format``) and the model (``eaglenest.drafters.eagle3.model``).
``aux_layer_ids`` are always physical ids (``eaglenest.contracts.layers``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


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
        if problems:
            raise ValueError("invalid drafter config: " + "; ".join(problems))
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DrafterModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
