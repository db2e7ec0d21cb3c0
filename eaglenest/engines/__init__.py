"""Engine layer: the TargetEngine protocol and its backends (transformers here; SGLang imported lazily)."""

from __future__ import annotations

from eaglenest.config import TargetConfig
from eaglenest.engines.base import (
    Capture,
    CaptureHint,
    Generation,
    Message,
    OutputConstraint,
    SamplingParams,
    TargetEngine,
    TargetInfo,
    decode_texts,
    render_chat_ids,
    render_chat_text,
)


def load_engine(cfg: TargetConfig, *, regen: bool = False) -> TargetEngine:
    """Build the configured backend; SGLang is imported only when chosen. ``regen``: for regen's engine actors (an
    SGLang engine may then record hidden states while generating, per ``target.sglang.capture``)."""
    if cfg.engine == "hf":
        from eaglenest.engines.hf import HFEngine

        return HFEngine.from_config(cfg)
    if cfg.engine == "sglang":
        from eaglenest.engines.sglang.engine import SGLangEngine

        return SGLangEngine.from_config(cfg, regen=regen)
    raise ValueError(f"unknown engine {cfg.engine!r}; allowed: hf, sglang")


__all__ = [
    "Capture",
    "CaptureHint",
    "Generation",
    "Message",
    "OutputConstraint",
    "SamplingParams",
    "TargetEngine",
    "TargetInfo",
    "decode_texts",
    "load_engine",
    "render_chat_ids",
    "render_chat_text",
]
