"""eaglenest: regenerate chat data with a target LLM, train an EAGLE-3 drafter on its hidden states, serve it.

The core package: configuration, the one layer-numbering convention, the hidden-state shard contract and the
engine layer. Stage packages (``regen``, ``drafter``, ``serve``) build on it; it imports none of them.
"""

from eaglenest.config import ConfigError, EaglenestConfig, TargetConfig, TinyTargetSpec, load_config
from eaglenest.contracts.layers import (
    LayerIdError,
    default_aux_layer_ids,
    engine_captured_layers,
    engine_layer_ids,
    validate_aux_layer_ids,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EaglenestConfig",
    "LayerIdError",
    "TargetConfig",
    "TinyTargetSpec",
    "__version__",
    "default_aux_layer_ids",
    "load_config",
    "engine_captured_layers",
    "engine_layer_ids",
    "validate_aux_layer_ids",
]
