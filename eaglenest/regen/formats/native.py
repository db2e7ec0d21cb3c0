"""Pre-tokenized samples (``input_ids`` + ``loss_mask``) already produced by the target: regeneration is skipped."""

from __future__ import annotations

from eaglenest.regen.formats.fields import _field
from eaglenest.regen.formats.reasons import BAD_NATIVE, TOKEN_OUT_OF_RANGE, WRONG_TYPE, BadRow
from eaglenest.regen.formats.schema import Conversation


def adapt_native(row: dict) -> Conversation:
    """Samples already produced by the target: ``input_ids`` + ``loss_mask`` (0/1), regeneration is skipped."""
    ids = _field(row, "input_ids")
    mask = _field(row, "loss_mask")
    for name, v in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise BadRow(WRONG_TYPE, f"{name} must be a list of integers")
    if not ids:
        raise BadRow(BAD_NATIVE, "input_ids is empty")
    if len(ids) != len(mask):
        raise BadRow(BAD_NATIVE, f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
    if any(x not in (0, 1) for x in mask):
        raise BadRow(BAD_NATIVE, "loss_mask values must be 0 or 1")
    if not any(mask):
        raise BadRow(BAD_NATIVE, "loss_mask has no 1s: nothing the target generated")
    if any(x < 0 for x in ids):
        raise BadRow(TOKEN_OUT_OF_RANGE, "negative token id")
    return Conversation(native_input_ids=list(ids), native_loss_mask=list(mask))
