"""A right-padded training batch and the one collation that builds it (both training loops use it).

Kept free of pyarrow and Ray so the in-process fitter (:mod:`eaglenest.drafter.spec_fit`) runs on GPU images that
have torch only. Batches are right-padded: the TTT loss relies on that (padding only ever follows real tokens).

fp8 shards stay fp8 until the batch reaches its device: ``aux``/``last`` then hold the e4m3 payload (uint8) and
``aux_exponents``/``last_exponents`` the shard contract's per-token-and-state exponents; :meth:`Batch.to` moves
both as they are (half the bytes of bf16) and dequantises on the device with the contract's own function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Right-padded tensors of one batch; ``aux``/``last`` stay in the storage dtype until moved."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    lengths: torch.Tensor
    aux_exponents: torch.Tensor | None = None
    """``[B, T, 3]`` int8 when ``aux`` is an fp8 payload (:func:`eaglenest.contracts.shards.fp8_parts`), else None"""
    last_exponents: torch.Tensor | None = None
    """``[B, T, 1]`` int8 when ``last`` is an fp8 payload, else None"""

    @property
    def quantized(self) -> bool:
        """Whether ``aux``/``last`` are fp8 payloads still to be dequantised (by :meth:`to`)."""
        return self.aux_exponents is not None and self.last_exponents is not None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        """The batch on ``device`` with ``aux``/``last`` in ``dtype`` (if given); an fp8 batch is moved as fp8 and
        dequantised on ``device`` (bit for bit what the CPU decode gives), so the result is never quantized."""
        nb = dtype is not None and torch.device(device).type != "cpu"  # never an unfinished copy read on the host

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=nb)

        aux, last = move(self.aux), move(self.last)
        if self.quantized:
            # lazy: the shard contract imports pyarrow, and only batches read from shards are quantized
            from eaglenest.contracts.shards import dequantize_fp8

            aux = dequantize_fp8(aux, move(self.aux_exponents))
            last = dequantize_fp8(last, move(self.last_exponents))
        if dtype is not None:
            aux, last = aux.to(dtype), last.to(dtype)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), aux, last, self.lengths.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _pad(parts: Sequence[torch.Tensor], lengths: Sequence[int], t: int) -> torch.Tensor:
    """``[B, t, width]`` zeros in the first part's dtype and device, row i's first ``lengths[i]`` rows filled in."""
    out = torch.zeros(len(parts), t, parts[0].shape[-1], dtype=parts[0].dtype, device=parts[0].device)
    for i, (x, n) in enumerate(zip(parts, lengths, strict=True)):
        out[i, :n] = x[:n]
    return out


def pad_batch(rows: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor, torch.Tensor,
                                   torch.Tensor]], *, max_seq_len: int | None = None,
              exponents: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Batch:
    """Right-pad per-sample ``(input_ids, loss_mask, aux [T, 3H], last [T, H])`` into one batch.

    The one collation of both training loops (shard rows through ``data.collate``, in-memory captures in
    ``spec_fit``). Sequences are truncated to ``max_seq_len``; ``aux``/``last`` keep the first sample's dtype and
    device, ids/mask/lengths are on the CPU (:meth:`Batch.to` moves them together). ``exponents`` (per sample:
    ``aux [T, 3]``, ``last [T, 1]`` int8) marks ``aux``/``last`` as fp8 payloads; padding is 0 in both, which
    dequantises to 0 like float padding.
    """
    lengths = [min(len(r[0]), max_seq_len) if max_seq_len is not None else len(r[0]) for r in rows]
    b, t = len(rows), max(lengths)
    input_ids = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, ((ids, mask, _, _), n) in enumerate(zip(rows, lengths, strict=True)):
        input_ids[i, :n] = torch.as_tensor(ids[:n], dtype=torch.long)
        loss_mask[i, :n] = torch.as_tensor(mask[:n], dtype=torch.bool)
    aux = _pad([r[2] for r in rows], lengths, t)
    last = _pad([r[3] for r in rows], lengths, t)
    aux_e = last_e = None
    if exponents is not None:
        aux_e = _pad([e[0] for e in exponents], lengths, t)
        last_e = _pad([e[1] for e in exponents], lengths, t)
    return Batch(input_ids, loss_mask, aux, last, torch.tensor(lengths, dtype=torch.long), aux_e, last_e)
