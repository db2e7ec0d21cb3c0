"""Stacking two decode batches into one: how a continuous-batching server admits new requests at a step boundary.

A server cannot wait for a batch to finish before starting the next request, and running each late request as a
batch of its own costs a target forward per batch and step. Newcomers are prefilled as a batch of their own
(:meth:`~eaglenest.speculative.decoder.SpecDecoder.prefill`) and merged here into the running batch: both KV caches
(target and drafter) are right-padded to a common slot count and stacked (:func:`~eaglenest.speculative.cache.
merge_caches`). Every slot carries a per-row validity flag and RoPE positions are per row, so padding slots are never
attended to and each row decodes exactly as it would alone.
"""

from __future__ import annotations

import torch

from eaglenest.speculative.backlog import merge_backlogs
from eaglenest.speculative.cache import cache_length, merge_caches, pad_valid
from eaglenest.speculative.decoder import DecodeBatch


def merge_batches(a: DecodeBatch | None, b: DecodeBatch | None) -> DecodeBatch | None:
    """One batch holding the rows of both (``a``'s first; ``a`` is updated in place); slot validity keeps every
    row's attention unchanged. Both must come from the same decoder and sampling setting."""
    if a is None or b is None:
        return a if b is None else b
    if a.backlog or b.backlog:  # a schedule turned drafting off: the deferred catch-up follows each row
        a.backlog = merge_backlogs(a.backlog, len(a.rows), b.backlog, len(b.rows))
    lt = max(a.t_valid.shape[1], b.t_valid.shape[1])
    a.t_cache = merge_caches(a.t_cache, b.t_cache, lt)
    a.t_valid = torch.cat([pad_valid(a.t_valid, lt), pad_valid(b.t_valid, lt)], dim=0)
    a.next_pos = torch.cat([a.next_pos, b.next_pos])
    a.pending = torch.cat([a.pending, b.pending])
    a.gens = a.gens + b.gens
    a.rows = a.rows + b.rows
    if a.d_valid is not None and b.d_valid is not None:
        ld = max(a.d_valid.shape[1], b.d_valid.shape[1])
        # the drafter's own slot count (a draft model may keep extra leading slots: TargetSelfDraft keeps one)
        a.d_cache = merge_caches(a.d_cache, b.d_cache, max(cache_length(a.d_cache), cache_length(b.d_cache)))
        a.d_valid = torch.cat([pad_valid(a.d_valid, ld), pad_valid(b.d_valid, ld)], dim=0)
        a.root_logits = torch.cat([a.root_logits, b.root_logits])
        a.root_hidden = torch.cat([a.root_hidden, b.root_hidden])
    return a
