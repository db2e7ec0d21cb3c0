"""A right-padded training batch and the one collation that builds it (both training loops use it).

Kept free of pyarrow and Ray so the in-process fitter (:mod:`eaglenest.drafter.spec_fit`) runs on GPU images that
have torch only. Batches are right-padded: the TTT loss relies on that (padding only ever follows real tokens).
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

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        cast = (lambda t: t.to(device, dtype, non_blocking=True)) if dtype else (lambda t: t.to(device))
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), cast(self.aux), cast(self.last),
                     self.lengths.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def pad_batch(rows: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor, torch.Tensor,
                                   torch.Tensor]], *, max_seq_len: int | None = None) -> Batch:
    """Right-pad per-sample ``(input_ids, loss_mask, aux [T, 3H], last [T, H])`` into one batch.

    The one collation of both training loops (shard rows through ``data.collate``, in-memory captures in
    ``spec_fit``). Sequences are truncated to ``max_seq_len``; ``aux``/``last`` keep the first sample's dtype and
    device, ids/mask/lengths are on the CPU (:meth:`Batch.to` moves them together).
    """
    lengths = [min(len(r[0]), max_seq_len) if max_seq_len is not None else len(r[0]) for r in rows]
    b, t = len(rows), max(lengths)
    a0, h0 = rows[0][2], rows[0][3]
    input_ids = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, a0.shape[-1], dtype=a0.dtype, device=a0.device)
    last = torch.zeros(b, t, h0.shape[-1], dtype=h0.dtype, device=h0.device)
    for i, ((ids, mask, a, h), n) in enumerate(zip(rows, lengths, strict=True)):
        input_ids[i, :n] = torch.as_tensor(ids[:n], dtype=torch.long)
        loss_mask[i, :n] = torch.as_tensor(mask[:n], dtype=torch.bool)
        aux[i, :n] = a[:n]
        last[i, :n] = h[:n]
    return Batch(input_ids, loss_mask, aux, last, torch.tensor(lengths, dtype=torch.long))
