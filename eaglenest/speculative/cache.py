"""KV-cache bookkeeping for speculative decoding: per-row slot validity, rollback and compaction.

Both caches (the target's transformers ``DynamicCache`` and the drafter's ``DrafterKVCache``) are kept as dense
``[B, heads, L, d]`` tensors whose slots line up across the batch. Each row carries a bool ``valid [B, L]`` mask:
left padding of the prompt and the padding of ragged acceptance are slots that exist but are never attended to.
After a verify step only the accepted path of each row is kept (``commit_block``), so the cache grows by the
longest accepted path of the batch, never by the whole draft tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eaglenest.drafters.eagle3.model import DrafterKVCache

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def apply_to_cache(cache: Any, fn: TensorFn) -> None:
    """Replace every key/value tensor ``[B, h, L, d]`` of ``cache`` by ``fn(tensor)`` (in place on the object)."""
    if cache is None:
        return
    if isinstance(cache, DrafterKVCache):
        if cache.k is not None:
            cache.k, cache.v = fn(cache.k), fn(cache.v)
        return
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: DynamicCache.layers[i].keys / .values
        for layer in layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.numel() == 0:
                continue
            if getattr(layer, "is_sliding", False):
                raise NotImplementedError("sliding-window KV layers cannot be rolled back by the reference decoder")
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        return
    if hasattr(cache, "key_cache"):  # older transformers
        for i in range(len(cache.key_cache)):
            if cache.key_cache[i].numel():
                cache.key_cache[i] = fn(cache.key_cache[i])
                cache.value_cache[i] = fn(cache.value_cache[i])
        return
    raise TypeError(f"unsupported KV cache type {type(cache).__name__}")


def cache_length(cache: Any) -> int:
    """Number of slots in the cache (0 when empty)."""
    if cache is None:
        return 0
    if isinstance(cache, DrafterKVCache):
        return cache.length
    return int(cache.get_seq_length())


def truncate(cache: Any, length: int) -> None:
    """Drop every slot from ``length`` on (rolls back the speculative part)."""
    apply_to_cache(cache, lambda t: t[:, :, :length])


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep the batch rows in ``rows`` (finished requests leave the batch)."""
    apply_to_cache(cache, lambda t: t.index_select(0, rows.to(t.device)))


def commit_block(cache: Any, start: int, index: torch.Tensor) -> None:
    """Keep slots ``[:start]`` and, of the block written after ``start``, the per-row slots ``index [B, M]``.

    ``index`` holds offsets into the block; padded entries may point anywhere (their validity is False).
    """

    def fn(t: torch.Tensor) -> torch.Tensor:
        idx = index.to(t.device)[:, None, :, None].expand(t.shape[0], t.shape[1], index.shape[1], t.shape[3])
        return torch.cat([t[:, :, :start], t[:, :, start:].gather(2, idx)], dim=2)

    apply_to_cache(cache, fn)


def pad_slots(t: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad the slot dimension (dim 2 of ``[B, h, L, d]``) with zeros up to ``length``."""
    extra = length - t.shape[2]
    return t if extra <= 0 else torch.nn.functional.pad(t, (0, 0, 0, extra))


def pad_valid(v: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad a validity mask ``[B, L]`` with False up to ``length`` slots."""
    extra = length - v.shape[1]
    return v if extra <= 0 else torch.nn.functional.pad(v, (0, extra), value=False)


def merge_caches(a: Any, b: Any, length: int) -> Any:
    """Stack cache ``b``'s rows under ``a``'s (both right-padded to ``length`` slots); returns ``a``, updated.

    Exact because every slot carries a per-row validity flag and RoPE positions are per row: padding slots are
    never attended to."""
    if a is None or b is None:
        if a is None and b is None:
            return None
        raise TypeError("cannot merge a batch with a cache into one without")
    if isinstance(a, DrafterKVCache):
        if a.k is None or b.k is None:
            raise ValueError("cannot merge an empty drafter cache")
        a.k = torch.cat([pad_slots(a.k, length), pad_slots(b.k, length)], dim=0)
        a.v = torch.cat([pad_slots(a.v, length), pad_slots(b.v, length)], dim=0)
        return a
    layers_a, layers_b = getattr(a, "layers", None), getattr(b, "layers", None)
    if layers_a is None or layers_b is None or len(layers_a) != len(layers_b):
        raise TypeError(f"unsupported KV cache types {type(a).__name__} / {type(b).__name__}")
    for la, lb in zip(layers_a, layers_b, strict=True):
        if getattr(la, "is_sliding", False) or getattr(lb, "is_sliding", False):
            raise NotImplementedError("sliding-window KV layers cannot be merged")
        la.keys = torch.cat([pad_slots(la.keys, length), pad_slots(lb.keys, length)], dim=0)
        la.values = torch.cat([pad_slots(la.values, length), pad_slots(lb.values, length)], dim=0)
    return a


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B, S, L]`` (True = may attend) -> float ``[B, 1, S, L]`` with 0 / dtype-min (works for SDPA and eager).

    dtype-min instead of -inf keeps a fully masked row finite instead of NaN (callers always allow the diagonal).
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def block_mask(past_valid: torch.Tensor, block_allowed: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S, L+S]``: every new position sees the row's valid past slots, and ``block_allowed [B, S, S]``."""
    b, s = block_allowed.shape[:2]
    past = past_valid[:, None, :].expand(b, s, past_valid.shape[1])
    return torch.cat([past, block_allowed], dim=2)


def causal_block(valid: torch.Tensor) -> torch.Tensor:
    """``[B, S, S]``: causal among valid new positions; every position (even padding) sees itself."""
    s = valid.shape[1]
    tril = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    return (tril[None] & valid[:, None, :]) | eye[None]
