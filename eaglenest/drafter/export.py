"""Export a trained drafter (in memory or a training checkpoint) to the serving format.

The format itself (file names, config.json keys, sidecar, required tensors, layer-id conventions, validation) is
``eaglenest.drafters.eagle3.format``'s; this module only gathers the tensors: a model's state dict, or a
checkpoint's weights plus the frozen embedding copied from the target the checkpoint records.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.checkpoint import find_latest_checkpoint, load_training_checkpoint
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.format import DEFAULT_FORMAT, ExportError, Format, write_export
from eaglenest.drafters.eagle3.model import Eagle3Drafter

__all__ = ["ExportError", "export_checkpoint", "export_drafter", "export_tensors"]

export_tensors = write_export
"""Validate and write an export folder from a tensor dict (``eaglenest.drafters.eagle3.format.write_export``)."""


def export_drafter(
    drafter: Eagle3Drafter,
    output_dir: str | Path,
    *,
    fmt: Format = DEFAULT_FORMAT,
    dtype: str = "bfloat16",
    include_embedding: bool = True,
    extra_sidecar: dict[str, Any] | None = None,
) -> Path:
    """Export an in-memory drafter."""
    return drafter.save_pretrained(output_dir, fmt=fmt, dtype=dtype, include_embedding=include_embedding,
                                   extra_sidecar=extra_sidecar)


def export_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    fmt: Format = DEFAULT_FORMAT,
    dtype: str = "bfloat16",
    include_embedding: bool = True,
) -> Path:
    """Export a training checkpoint (a checkpoint folder or a training output folder: its newest checkpoint).

    The frozen embedding is copied from the target recorded in the checkpoint (it is not stored in checkpoints).
    """
    src = find_latest_checkpoint(checkpoint)
    if src is None:
        raise FileNotFoundError(
            f"no drafter training checkpoint under {checkpoint} (expected drafter.safetensors, train_state.json, ...; "
            "run `eaglenest train` first or pass the checkpoint folder)"
        )
    ckpt = load_training_checkpoint(src, optimizer=False)
    cfg = _with_target_architecture(ckpt.config)
    tensors = dict(ckpt.weights)
    if include_embedding:
        try:
            embed, _ = TargetSpec.read(ckpt.config.target).load_embed_and_head()
        except FileNotFoundError as e:
            raise ExportError(
                f"cannot copy the target embedding from {ckpt.config.target!r} ({e}); pass --no-embedding to export "
                "without it (SGLang and vLLM then share the target's embedding)"
            ) from e
        tensors["embed_tokens.weight"] = embed
    return write_export(
        tensors, cfg, output_dir, fmt=fmt, dtype=dtype,
        extra_sidecar={"trained_steps": ckpt.step, "vocab_fingerprint": ckpt.mapping.fingerprint(),
                       "source_checkpoint": str(src)},
    )


def _with_target_architecture(cfg: DrafterModelConfig) -> DrafterModelConfig:
    """Checkpoints written before the target's architecture was recorded get it from the target's config.json (the
    engines' layer-id rules depend on it); a target that cannot be read leaves it empty (Llama-style numbering)."""
    if cfg.target_architecture or not cfg.target:
        return cfg
    try:
        arch = TargetSpec.read(cfg.target).architecture
    except (OSError, ValueError):
        return cfg
    return dataclasses.replace(cfg, target_architecture=arch if arch != "?" else "")
