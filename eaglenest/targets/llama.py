"""Llama-style targets (Llama, Mistral, Qwen2/3): GQA attention, SGLang always adds 1 to aux ids, decoder layers
called as ``layer(positions, hidden, forward_batch, residual)`` returning ``(hidden, residual)``."""

from __future__ import annotations

from eaglenest.targets.base import TargetArch

LLAMA = TargetArch(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    generation_capture=True,  # H200, SGLang 0.5.14: states within bf16 tolerance of prefill capture
)

QWEN = TargetArch(
    name="qwen",
    architectures=("Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    model_types=("qwen2", "qwen3"),
)
"""Same SGLang numbering and layer call as Llama; capture during generation not yet verified on a GPU."""
