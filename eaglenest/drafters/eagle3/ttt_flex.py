"""The TTT attention pattern as one FlexAttention call (fused, block-sparse; the CUDA fast path of drafters.eagle3.ttt).

Step ``k`` of the TTT unroll lets query row ``t`` see the step-0 keys at rows ``<= t`` plus the key of every step
``1..k`` at row ``t`` itself. Written as ordinary attention over one key sequence, the keys are packed as segments::

    [ k0 | kd_1 | ... | kd_k | zeros ... ]      each segment Tp rows, kv_blocks segments in all

and query row ``q`` may see key ``kv`` iff ``kv <= q`` (causal inside segment 0) or ``kv >= Tp and kv % Tp == q``
(the same row of a later segment). ``Tp`` is T rounded up to a multiple of :data:`SEQ_ALIGN` and the caller passes
``kv_blocks = K`` (the number of TTT steps), so every step of a batch has the same shapes and the compiled kernel is
built once per ``Tp``, not once per step. The zero segments past step ``k`` are masked (``kv < (k + 1) * Tp``) and,
as ``Tp`` is a multiple of the mask's block size, never even loaded: the block mask lists none of their blocks.
Padded rows (``T <= row < Tp``) sit after every real row, so the causal rule keeps them out of every real row's
view; their outputs are dropped.

A materialised ``[B, h, T, T + k]`` score tensor (the manual path) costs about as much memory traffic as all the
attention FLOPs at long T; FlexAttention never writes scores to memory and skips the masked blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch: the manual path is used
    BlockMask = create_block_mask = flex_attention = None  # type: ignore[assignment,misc]

SEQ_ALIGN = 256
"""``Tp`` granularity: a multiple of FlexAttention's 128-row blocks, coarse enough that a trainer whose batches have
varying T compiles only a few kernels (one per distinct ``Tp``)."""

RECOMPILE_LIMIT = 64
"""dynamo's per-function recompile limit while the compiled kernel is called (default 8 is too low once batches of
several ``Tp`` buckets, batch sizes and grad modes each need their own static kernel)."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flex_available() -> bool:
    """Whether this torch has ``torch.nn.attention.flex_attention``."""
    return flex_attention is not None


def padded_len(t: int) -> int:
    """``Tp``: ``t`` rounded up to a multiple of :data:`SEQ_ALIGN`."""
    return -(-t // SEQ_ALIGN) * SEQ_ALIGN


def ttt_mask_mod(tp: int, limit: torch.Tensor) -> MaskMod:
    """The TTT visibility rule for segments of ``tp`` rows, restricted to keys ``< limit`` (the real segments).

    ``limit`` is a captured 0-d tensor, not a Python int: the masks of all steps then share one code object and
    differ only in a tensor value, so the compiled kernel is reused (dynamo guards a closure by its code and the
    captured tensor by shape and dtype) and eager and compiled FlexAttention apply exactly the same rule.
    """

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        same_row = (kv_idx >= tp) & (kv_idx % tp == q_idx) & (kv_idx < limit)
        return (kv_idx <= q_idx) | same_row

    return mask_mod


_BLOCK_MASKS: dict[tuple[int, int, int, str], BlockMask] = {}


def ttt_block_mask(tp: int, step: int, kv_blocks: int, device: torch.device | str) -> BlockMask:
    """Block mask of TTT step ``step`` over ``kv_blocks`` segments of ``tp`` rows; built once and cached.

    Broadcast over batch and heads; lists the causal blocks of segment 0 and one diagonal block per segment
    ``1..step``, nothing of the zero segments after them.
    """
    if not flex_available():
        raise RuntimeError("torch.nn.attention.flex_attention is missing in this torch; use the manual attention")
    if tp % SEQ_ALIGN:
        raise ValueError(f"segment length {tp} must be a multiple of {SEQ_ALIGN} (use padded_len)")
    if not 0 <= step < kv_blocks:
        raise ValueError(f"TTT step {step} needs {step + 1} key segments but kv_blocks is {kv_blocks}")
    device = torch.device(device)
    key = (tp, step, kv_blocks, str(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        limit = torch.tensor((step + 1) * tp, dtype=torch.int32, device=device)
        mask = create_block_mask(ttt_mask_mod(tp, limit), None, None, tp, kv_blocks * tp, device=device)
        _BLOCK_MASKS[key] = mask
    return mask


def pack_segments(x0: torch.Tensor, diag: list[torch.Tensor], tp: int, kv_blocks: int) -> torch.Tensor:
    """``[B, hk, T, d]`` step-0 keys (or values) and steps ``1..k`` -> ``[B, hk, kv_blocks * tp, d]`` segments."""
    b, hk, t, d = x0.shape
    parts = [x0, *diag]
    if tp > t:
        parts = [F.pad(p, (0, 0, 0, tp - t)) for p in parts]
    rest = kv_blocks - len(parts)
    if rest < 0:
        raise ValueError(f"{len(parts)} key segments do not fit kv_blocks={kv_blocks}")
    if rest:
        parts.append(x0.new_zeros(b, hk, rest * tp, d))
    return torch.cat(parts, dim=2)


_COMPILED: Callable[..., torch.Tensor] | None = None


def _compiled_flex() -> Callable[..., torch.Tensor]:
    global _COMPILED
    if _COMPILED is None:
        # static shapes: T is fixed per Tp bucket and the packed key length per objective (see module docstring)
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def _recompile_headroom() -> contextlib.AbstractContextManager:
    """dynamo's recompile limit raised to at least :data:`RECOMPILE_LIMIT` (no-op where the knob is missing)."""
    current = getattr(torch._dynamo.config, "recompile_limit", None)
    if current is None or current >= RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)


def flex_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_diag: list[torch.Tensor],
    v_diag: list[torch.Tensor],
    kv_blocks: int | None = None,
    compiled: bool | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`ttt.ttt_attention` (``q [B, h, T, d]``, keys/values ``[B, hk, T, d]``).

    ``kv_blocks``: key segments to pack (default ``len(k_diag) + 1``; pass the number of TTT steps so all steps
    share one compiled kernel). ``compiled``: run ``torch.compile(flex_attention)`` (default: on CUDA). Eager
    FlexAttention materialises the scores (a reference, not a fast path) and, in torch up to at least 2.13, has no
    backward on CPU.
    """
    if not flex_available():
        raise RuntimeError("torch.nn.attention.flex_attention is missing in this torch; use the manual attention")
    b, h, t, d = q.shape
    hk = k0.shape[1]
    if h % hk:
        raise ValueError(f"{h} query heads are not a multiple of {hk} key/value heads")
    step = len(k_diag)
    kv_blocks = step + 1 if kv_blocks is None else kv_blocks
    tp = padded_len(t)
    if compiled is None:
        compiled = q.device.type == "cuda"
    with torch.autocast(device_type=q.device.type, enabled=False):
        dtype = q.dtype
        keys = pack_segments(k0.to(dtype), [x.to(dtype) for x in k_diag], tp, kv_blocks)
        vals = pack_segments(v0.to(dtype), [x.to(dtype) for x in v_diag], tp, kv_blocks)
        qp = F.pad(q, (0, 0, 0, tp - t)) if tp > t else q
        mask = ttt_block_mask(tp, step, kv_blocks, q.device)
        if compiled:
            with _recompile_headroom():
                o = _compiled_flex()(qp, keys, vals, block_mask=mask, scale=scale, enable_gqa=h != hk)
        else:
            o = flex_attention(qp, keys, vals, block_mask=mask, scale=scale, enable_gqa=h != hk)
    return o[:, :, :t] if tp > t else o
