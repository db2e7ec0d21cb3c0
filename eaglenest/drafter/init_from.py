"""``train.init_from``: a training run that starts from an exported drafter (the flywheel starts from the live one).

Why: retraining on recent traffic from scratch throws away what the live drafter knows; starting from its weights keeps
its shape and its draft vocabulary (``lm_head`` rows are indexed by that vocabulary, so it cannot be rebuilt from the
new data). The drafter must fit this target: same target widths, vocabulary and aux layers as the shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest.config import EaglenestConfig
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.format import WEIGHTS, read_export_config
from eaglenest.drafters.vocab import VocabMapping


@dataclass(frozen=True)
class InitDrafter:
    """The export a run starts from: its folder, its config (physical layer ids) and its draft vocabulary."""

    path: Path
    config: DrafterModelConfig
    mapping: VocabMapping


def read_init_drafter(cfg: EaglenestConfig) -> InitDrafter | None:
    """``train.init_from``'s export (None when unset); refused with the fix when it is not an eaglenest export."""
    given = cfg.train.init_from
    if not given:
        return None
    path = Path(cfg.resolve(given) or given).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"train.init_from: {path} is not a folder; point it at a drafter export (the live "
                                "drafter's folder, or a training run's OUT/export)")
    dcfg, _, _ = read_export_config(path)
    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        mapping = VocabMapping.from_maps(f.get_tensor("d2t"), f.get_tensor("t2d"))
    return InitDrafter(path, dcfg, mapping)


def init_model_config(init: InitDrafter, fresh: DrafterModelConfig) -> DrafterModelConfig:
    """The run's drafter config: ``init``'s shape over this run's target (``fresh``: what the run would build).

    A drafter for another target (hidden size, vocabulary, depth) or other aux layers than the shards' is refused."""
    keys = ("target_hidden_size", "target_num_layers", "vocab_size", "aux_layer_ids")
    diff = [f"{k}: drafter {getattr(init.config, k)}, this run {getattr(fresh, k)}" for k in keys
            if getattr(init.config, k) != getattr(fresh, k)]
    if diff:
        raise ValueError(f"train.init_from {init.path} does not fit this run's target and shards ({'; '.join(diff)}); "
                         "start from a drafter trained for this target on these layers, or unset train.init_from")
    return dataclasses.replace(init.config, target=fresh.target, target_architecture=fresh.target_architecture)


def load_init_weights(drafter: torch.nn.Module, path: str | Path, embed: torch.Tensor) -> None:
    """Copy an export's weights into a freshly built drafter of the same config (the embedding is the target's)."""
    from eaglenest.drafters.eagle3.model import load_drafter

    src = load_drafter(path, target_embedding=embed)
    state = {k: v.to(drafter.state_dict()[k].dtype) for k, v in src.state_dict().items()}
    drafter.load_state_dict(state, strict=True)


__all__ = ["InitDrafter", "init_model_config", "load_init_weights", "read_init_drafter"]
