"""The drafter's deferred catch-up: what lets a speculating batch switch drafting off (and back on) between steps.

After every verify step the drafter re-reads the accepted tokens with the target's features (its "catch-up"
forward), so that its cache is ready for the next draft. A step that does not draft (the schedule turned
speculation off at this batch size) does not need that cache yet: paying the drafter's forward on every such step
would make "off" slower than plain decoding, which is the one thing a schedule must never be. Here the step only
keeps the rows' new tokens, target features and positions (:class:`Block`); the next drafting step first runs the
drafter once over everything kept (:func:`catch_up`), which leaves its cache exactly as step-by-step catch-ups
would have (the drafter is causal and every slot carries its own position and validity).

The blocks follow the batch: rows that leave (:func:`select_backlog`) and rows that join
(:func:`merge_backlogs`) keep each row's own columns in order; a row without columns in a block sees padding slots
that are never attended to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eaglenest.speculative.cache import block_mask, causal_block


@dataclass
class Block:
    """One deferred catch-up input: ``tokens``/``pos``/``valid`` ``[B, M]``, ``feats [B, M, F]`` (the drafter's
    ``step`` arguments, as the decoder's commit would have passed them)."""

    tokens: torch.Tensor
    feats: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    def rows(self, index: torch.Tensor) -> Block:
        return Block(self.tokens[index], self.feats[index], self.pos[index], self.valid[index])

    def pad_rows(self, before: int, after: int) -> Block:
        """Padding rows (never valid) above and below: the block as a bigger batch sees it."""
        def pad(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            top, bottom = shape.copy(), shape.copy()
            top[0], bottom[0] = before, after
            return torch.cat([t.new_zeros(top), t, t.new_zeros(bottom)], dim=0)

        return Block(pad(self.tokens), pad(self.feats), pad(self.pos), pad(self.valid))


def select_backlog(backlog: list[Block], index: torch.Tensor) -> list[Block]:
    """The blocks of the rows in ``index`` (finished rows leave the batch)."""
    return [b.rows(index) for b in backlog]


def merge_backlogs(a: list[Block], rows_a: int, b: list[Block], rows_b: int) -> list[Block]:
    """Blocks of a batch stacking ``b``'s rows under ``a``'s: each side's blocks padded with the other's rows."""
    return [blk.pad_rows(0, rows_b) for blk in a] + [blk.pad_rows(rows_a, 0) for blk in b]


def catch_up(draft: Any, batch: Any) -> None:
    """Run the drafter once over ``batch.backlog`` (its cache, validity and next-draft roots updated in place).

    Rows with no valid column keep their roots; the backlog is empty afterwards.
    """
    blocks: list[Block] = batch.backlog
    if not blocks:
        return
    batch.backlog = []
    tokens = torch.cat([blk.tokens for blk in blocks], dim=1)
    valid = torch.cat([blk.valid for blk in blocks], dim=1)
    pos = torch.cat([blk.pos for blk in blocks], dim=1)
    width = max(blk.feats.shape[-1] for blk in blocks)
    feats = torch.cat([_widen(blk.feats, width) for blk in blocks], dim=1)
    allowed = block_mask(batch.d_valid, causal_block(valid))
    d_logits, d_hidden = draft.step(batch.d_cache, tokens, feats, pos, allowed, own_hidden=False)
    batch.d_valid = torch.cat([batch.d_valid, valid], dim=1)
    has = valid.any(dim=1)
    if not bool(has.any()):
        return
    cols = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, cols, torch.full_like(cols, -1)).max(dim=1).values.clamp(min=0)
    idx = last[:, None, None]
    logits = d_logits.gather(1, idx.expand(-1, 1, d_logits.shape[-1]))[:, 0]
    hidden = d_hidden.gather(1, idx.expand(-1, 1, d_hidden.shape[-1]))[:, 0]
    keep = has[:, None]
    batch.root_logits = torch.where(keep, logits.to(batch.root_logits.dtype), batch.root_logits)
    batch.root_hidden = torch.where(keep, hidden.to(batch.root_hidden.dtype), batch.root_hidden)


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the feature dim (a drafter without target features gets ``[B, M, 1]`` zeros per block)."""
    extra = width - t.shape[-1]
    return t if extra <= 0 else torch.nn.functional.pad(t, (0, extra))
