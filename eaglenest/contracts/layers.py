"""The one layer-numbering convention of eaglenest, and its one translation to each engine's ids.

Physical ids index transformers' ``hidden_states`` tuple: 0 is the embedding output, ``k`` is the output of decoder
layer ``k-1`` (the residual stream entering layer ``k``). Every shard manifest and checkpoint stores physical ids.
What an engine reads from a drafter's ``eagle_aux_hidden_state_layer_ids`` depends on the engine and on the target's
architecture (SGLang adds 1 for Llama-style targets, but for DeepSeek/Kimi only when the first id is 1; vLLM reads
physical ids); the rules live in the architecture records (``eaglenest.targets``) and every reader — capture, export,
preflight, the SGLang launch — translates through :func:`engine_layer_ids` and :func:`engine_captured_layers` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from eaglenest.targets import arch_for, default_aux_taps

Engine = Literal["sglang", "vllm"]
ENGINES: tuple[str, ...] = ("sglang", "vllm")


class LayerIdError(ValueError):
    """Aux layer ids that cannot be captured from the target."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps for an ``num_layers``-layer target: low, middle and high (Kimi-K2.5: 2, 30, 58)."""
    if num_layers < 4:
        raise LayerIdError(f"a target needs at least 4 decoder layers for EAGLE-3 taps, got {num_layers}")
    return default_aux_taps(num_layers)


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


def _engine(engine: str) -> str:
    if engine not in ENGINES:
        raise LayerIdError(f"unknown engine {engine!r} for layer ids; use one of {list(ENGINES)}")
    return engine


def engine_captured_layers(config_ids: Sequence[int] | None, *, engine: str, architecture: str,
                           num_layers: int) -> list[int]:
    """Physical layers ``engine`` really captures when a drafter's config.json says ``config_ids`` (None: the
    engine's default taps), for a target of ``architecture``."""
    arch = arch_for(architecture)
    if _engine(engine) == "vllm":
        return default_aux_taps(num_layers) if config_ids is None else arch.vllm_ids(config_ids)
    return arch.sglang_captured(config_ids, num_layers)


def engine_layer_ids(physical: Sequence[int], *, engine: str, architecture: str, num_layers: int) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make ``engine`` capture exactly ``physical`` on this target."""
    arch = arch_for(architecture)
    ids = arch.vllm_ids(physical) if _engine(engine) == "vllm" else arch.sglang_ids(physical, num_layers)
    if ids is None:
        raise LayerIdError(f"no eagle_aux_hidden_state_layer_ids make {engine} capture physical layers "
                           f"{list(physical)} on a {architecture} target ({arch.name} numbering)")
    return ids

