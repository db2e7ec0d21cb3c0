"""Target architectures: one :class:`TargetArch` record each (``llama``, ``qwen``, ``deepseek_v3``, ``kimi_k25``).

Look one up with :func:`arch_for` (by ``config.json``'s ``architectures[0]``, else its ``model_type``); an architecture
no record names gets :data:`GENERIC`, which numbers aux layers as Llama does and is not verified for capture during
generation. To add an architecture: a module here with its record, and its name in :data:`ARCHS`.
"""

from __future__ import annotations

from eaglenest.targets.base import SGLANG_RULES, LayerCall, TargetArch, default_aux_taps
from eaglenest.targets.deepseek_v3 import DEEPSEEK_FAMILY, DEEPSEEK_V3, KIMI_K25, SGLANG_MOE_KEYS
from eaglenest.targets.llama import LLAMA, QWEN

ARCHS: tuple[TargetArch, ...] = (LLAMA, QWEN, DEEPSEEK_V3, KIMI_K25, DEEPSEEK_FAMILY)

GENERIC = TargetArch(name="generic", architectures=())
"""Every other architecture with EAGLE-3 support in SGLang (its models add 1 to aux ids); layer call as Llama's."""


def arch_for(architecture: str | None, model_type: str | None = None) -> TargetArch:
    """The record for a target's ``architectures[0]`` (or ``model_type``); :data:`GENERIC` when none matches."""
    for rec in ARCHS:
        if architecture and architecture in rec.architectures:
            return rec
    for rec in ARCHS:
        if model_type and model_type in rec.model_types:
            return rec
    return GENERIC


__all__ = [
    "ARCHS",
    "DEEPSEEK_V3",
    "GENERIC",
    "KIMI_K25",
    "LLAMA",
    "QWEN",
    "SGLANG_MOE_KEYS",
    "SGLANG_RULES",
    "LayerCall",
    "TargetArch",
    "arch_for",
    "default_aux_taps",
]
