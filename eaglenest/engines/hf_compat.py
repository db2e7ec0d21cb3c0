"""Small shims over transformers versions (the GPU bundle ships 5.8, this machine 5.24; the KV-cache kwarg moved)."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=8)
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{"cache": c}`` or ``{"past_key_values": c}``, whichever this transformers version's forward takes."""
    return {_cache_kwarg_for(type(model)): cache}


def output_cache(out: Any) -> Any:
    """The KV cache of a model output under either attribute name."""
    return getattr(out, "cache", None) if getattr(out, "cache", None) is not None else out.past_key_values


def new_dynamic_cache(config: Any) -> Any:
    """An empty ``DynamicCache`` (the constructor's signature changed across versions)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()
