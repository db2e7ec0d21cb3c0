"""Continuous batching on the reference speculative decoder: requests join the running batch at a step boundary.

``speculative.decoder.SpecDecoder`` decodes a fixed batch (``_run``). A server cannot wait for a batch to finish before
starting the next request, and running each late request as a batch of its own costs a target forward per batch and
step. Here a :class:`ContinuousBatch` prefills newcomers with the decoder's own ``_prefill`` and merges their state
into the running batch: the two KV caches (target and drafter) are right-padded to a common slot count and stacked.
That is exact because every cache slot carries a per-row validity flag and RoPE positions are per row
(``eaglenest.speculative.cache``): padding slots are never attended to. Each step then is the decoder's own
draft -> verify -> commit, the same ``SpecDecoder._step`` that ``SpecDecoder._run`` calls.

The decoder internals this module relies on (update them together): ``SpecDecoder._prefill/_step/_emit/_chunk/
_drop_finished/_sync``, ``speculative.decoder._Row`` (``prompt, tokens, finish, accepted, draft_s, verify_s, prefill_s,
start, end``), ``speculative.decoder._Batch`` (``rows, t_cache, t_valid, next_pos, pending, gens, d_cache, d_valid,
root_logits, root_hidden``); caches are transformers
``DynamicCache`` (``layers[i].keys/values``) or ``eaglenest.drafter.model.DrafterKVCache`` (``k, v``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.decoder import SpecDecoder, StreamChunk, _Batch, _Row
from eaglenest.speculative.model import DrafterKVCache

Emit = Callable[[int, StreamChunk], None]


def _pad_slots(t: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad the slot dimension (dim 2 of ``[B, h, L, d]``) with zeros up to ``length``."""
    extra = length - t.shape[2]
    return t if extra <= 0 else F.pad(t, (0, 0, 0, extra))


def _pad_valid(v: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - v.shape[1]
    return v if extra <= 0 else F.pad(v, (0, extra), value=False)


def merge_caches(a: Any, b: Any, length: int) -> Any:
    """Stack cache ``b``'s rows under ``a``'s (both right-padded to ``length`` slots); returns ``a``, updated."""
    if a is None or b is None:
        if a is None and b is None:
            return None
        raise TypeError("cannot merge a batch with a cache into one without")
    if isinstance(a, DrafterKVCache):
        if a.k is None or b.k is None:
            raise ValueError("cannot merge an empty drafter cache")
        a.k = torch.cat([_pad_slots(a.k, length), _pad_slots(b.k, length)], dim=0)
        a.v = torch.cat([_pad_slots(a.v, length), _pad_slots(b.v, length)], dim=0)
        return a
    layers_a, layers_b = getattr(a, "layers", None), getattr(b, "layers", None)
    if layers_a is None or layers_b is None or len(layers_a) != len(layers_b):
        raise TypeError(f"unsupported KV cache types {type(a).__name__} / {type(b).__name__}")
    for la, lb in zip(layers_a, layers_b, strict=True):
        if getattr(la, "is_sliding", False) or getattr(lb, "is_sliding", False):
            raise NotImplementedError("sliding-window KV layers cannot be merged")
        la.keys = torch.cat([_pad_slots(la.keys, length), _pad_slots(lb.keys, length)], dim=0)
        la.values = torch.cat([_pad_slots(la.values, length), _pad_slots(lb.values, length)], dim=0)
    return a


def merge_batches(a: _Batch | None, b: _Batch | None) -> _Batch | None:
    """One batch holding the rows of both (``a``'s first); slot validity keeps every row's attention unchanged."""
    if a is None or b is None:
        return a if b is None else b
    lt = max(a.t_valid.shape[1], b.t_valid.shape[1])
    a.t_cache = merge_caches(a.t_cache, b.t_cache, lt)
    a.t_valid = torch.cat([_pad_valid(a.t_valid, lt), _pad_valid(b.t_valid, lt)], dim=0)
    a.next_pos = torch.cat([a.next_pos, b.next_pos])
    a.pending = torch.cat([a.pending, b.pending])
    a.gens = a.gens + b.gens
    a.rows = a.rows + b.rows
    if a.d_valid is not None and b.d_valid is not None:
        ld = max(a.d_valid.shape[1], b.d_valid.shape[1])
        a.d_cache = merge_caches(a.d_cache, b.d_cache, ld)
        a.d_valid = torch.cat([_pad_valid(a.d_valid, ld), _pad_valid(b.d_valid, ld)], dim=0)
        a.root_logits = torch.cat([a.root_logits, b.root_logits])
        a.root_hidden = torch.cat([a.root_hidden, b.root_hidden])
    return a


class ContinuousBatch:
    """One running batch of a SpecDecoder (one sampling setting); ``add`` newcomers, ``step`` advances everyone.

    ``emit(row_id, chunk)`` receives every chunk (``chunk.result`` on a row's last one); row ids come from ``add``.
    """

    def __init__(self, dec: SpecDecoder, sampling: SamplingParams, emit: Emit) -> None:
        self.dec = dec
        self.sampling = sampling
        self.emit = emit
        self.rows: dict[int, _Row] = {}
        self.batch: _Batch | None = None
        self.incoming: list[tuple[int, list[int]]] = []
        self.steps = 0
        self._ids = itertools.count()

    @property
    def alive(self) -> int:
        """Rows decoding or waiting to join."""
        return len(self.incoming) + sum(1 for r in self.rows.values() if r.finish is None)

    def add(self, prompt_ids: list[int]) -> int:
        if not prompt_ids:
            raise ValueError("empty prompt: every prompt needs at least one token")
        rid = next(self._ids)
        self.incoming.append((rid, list(prompt_ids)))
        return rid

    def cancel(self, rid: int) -> None:
        """Stop decoding a row (its client went away); it leaves the batch at the next step, without a chunk."""
        self.incoming = [(i, p) for i, p in self.incoming if i != rid]
        row = self.rows.get(rid)
        if row is not None and row.finish is None:
            row.finish = "cancelled"

    @torch.inference_mode()
    def step(self) -> None:
        """Admit newcomers (one prefill forward for all of them), then one draft/verify/commit step for the batch."""
        dec, sampling = self.dec, self.sampling
        if self.batch is not None:
            self.batch = dec._drop_finished(self.batch, self.rows)
        self._forget_dropped()
        if self.incoming:
            self._admit()
        batch = self.batch
        if batch is None:
            return
        self.steps += 1
        for ri, r, took, accepted in dec._step(batch, self.rows, sampling):
            if took is None:  # cancelled: decoded in this step's batch, nothing emitted
                continue
            for row, chunk in dec._chunk(ri, r, took, self.steps, accepted, sampling):
                self.emit(row, chunk)

    def _admit(self) -> None:
        dec, sampling = self.dec, self.sampling
        new, self.incoming = self.incoming, []
        t0 = dec._sync()
        rows = [_Row(prompt=p, start=t0) for _, p in new]
        fresh, first = dec._prefill(rows, sampling)
        t1 = dec._sync()
        ids = [rid for rid, _ in new]
        fresh.rows = [ids[i] for i in fresh.rows]
        for rid, r in zip(ids, rows, strict=True):
            self.rows[rid] = r
        for i, (rid, r) in enumerate(zip(ids, rows, strict=True)):
            r.prefill_s = t1 - t0
            took = dec._emit(r, [int(first[i])], sampling)
            for row, chunk in dec._chunk(rid, r, took, 0, None, sampling):
                self.emit(row, chunk)
        fresh = dec._drop_finished(fresh, self.rows)
        self.batch = merge_batches(self.batch, fresh)
        self._forget_dropped()

    def _forget_dropped(self) -> None:
        """Rows that left the batch are done: forget them (a long-running batch must not grow without bound)."""
        live = set(self.batch.rows) if self.batch is not None else set()
        for rid in [rid for rid, r in self.rows.items() if rid not in live and r.finish is not None]:
            del self.rows[rid]
