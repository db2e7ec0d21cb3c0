"""TargetArch: everything eaglenest must know about one target architecture, in one record.

A target's architecture decides how its config names its widths, which layers EAGLE-3 taps by default, how each
serving engine numbers aux layers, where SGLang's decoder layers sit in the module tree (for capture hooks) and what
those layers return. Every stage asks the record for ``TargetSpec.architecture`` (:func:`eaglenest.targets.arch_for`)
instead of keeping its own table, so adding an architecture is one module here plus its registration.

This package is the bottom of the import graph: it imports nothing else of eaglenest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def default_aux_taps(num_layers: int) -> list[int]:
    """EAGLE-3's default taps for an ``num_layers``-layer target: low, middle and high (Kimi-K2.5: 2, 30, 58)."""
    return [2, num_layers // 2, num_layers - 3]


def _add_one(config_ids: Sequence[int]) -> list[int]:
    return [int(i) + 1 for i in config_ids]


def _deepseek_first_id(config_ids: Sequence[int]) -> list[int]:
    """SGLang's DeepseekV2 rule (PR #25454): ids are physical unless the first is 1, then every id gets +1."""
    ids = [int(i) for i in config_ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids


SGLANG_RULES: dict[str, Callable[[Sequence[int]], list[int]]] = {
    "add_one": _add_one,
    "first_id": _deepseek_first_id,
}
"""How SGLang 0.5.14 turns a drafter's ``eagle_aux_hidden_state_layer_ids`` into the physical layers it captures
(``set_eagle3_layers_to_capture`` of the target's model class)."""


@dataclass(frozen=True)
class LayerCall:
    """How SGLang calls one decoder layer and what it returns, as capture hooks see it.

    ``forward_batch_arg``: position of the ``ForwardBatch`` among the layer's positional arguments;
    ``output_hidden`` / ``output_residual``: indexes of hidden and residual in the layer's output tuple (the stream
    entering the next layer is hidden + residual); ``output_len``: the tuple's length, checked by the hooks so a changed
    convention fails loudly instead of recording the wrong tensor.
    """

    forward_batch_arg: int = 2
    output_hidden: int = 0
    output_residual: int = 1
    output_len: int = 2

    def stream(self, output: Any) -> tuple[Any, Any]:
        """(hidden, residual or None) from a decoder layer's output."""
        if not isinstance(output, tuple):
            return output, None
        if len(output) != self.output_len:
            raise ValueError(f"decoder layer returned a {len(output)}-tuple; this architecture's layers return "
                             f"{self.output_len} (hidden at {self.output_hidden}, residual at {self.output_residual})")
        return output[self.output_hidden], output[self.output_residual]


@dataclass(frozen=True)
class TargetArch:
    """One target architecture's facts (see the module docstring)."""

    name: str
    architectures: tuple[str, ...]
    """``config.json`` ``architectures[0]`` values this record serves"""
    model_types: tuple[str, ...] = ()
    sglang_rule: str = "add_one"
    """key of :data:`SGLANG_RULES`"""
    attention: str = "gqa"
    """``gqa`` (Llama-style q/k/v heads) or ``mla`` (DeepSeek's multi-head latent attention)"""
    sglang_layers: str = "model.layers.{i}"
    """module path of decoder layer ``i`` inside SGLang's model (the ``forward_hooks`` target)"""
    sglang_norm: str = "model.norm"
    layer_call: LayerCall = field(default_factory=LayerCall)
    generation_capture: bool = False
    """capture during generation (SGLang forward hooks) verified on a GPU for this architecture"""
    text_config_key: str | None = None
    """multimodal wrappers keep the language model's config under this key (``text_config``)"""
    extra_widths: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """reads the architecture's own widths (MLA ranks, MoE sizes) from its text config"""

    # ---------------------------------------------------------------------------------------------- layer ids
    def sglang_captured(self, config_ids: Sequence[int] | None, num_layers: int) -> list[int]:
        """Physical layers SGLang captures for a drafter config's ids (None: SGLang's default taps)."""
        if config_ids is None:
            return default_aux_taps(num_layers)
        return SGLANG_RULES[self.sglang_rule](config_ids)

    def sglang_ids(self, physical: Sequence[int], num_layers: int) -> list[int] | None:
        """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang capture exactly ``physical`` (None: no list
        does)."""
        phys = [int(i) for i in physical]
        for cand in ([i - 1 for i in phys], phys):
            if self.sglang_captured(cand, num_layers) == phys:
                return cand
        return None

    @staticmethod
    def vllm_ids(ids: Sequence[int]) -> list[int]:
        """vLLM and speculators read ``eagle_aux_hidden_state_layer_ids`` as physical ids, for every architecture:
        the ids to write and the layers captured are the same list."""
        return [int(i) for i in ids]

    # -------------------------------------------------------------------------------------------- capture hooks
    def layer_module(self, i: int) -> str:
        """SGLang module path of decoder layer ``i`` (0-based), whose output is the stream entering physical
        layer ``i + 1``."""
        return self.sglang_layers.format(i=i)

    def widths(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        """Architecture-specific widths from a text config ({} when the architecture has none beyond Llama's)."""
        return dict(self.extra_widths(text_config)) if self.extra_widths else {}
