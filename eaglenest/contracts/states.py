"""Which positions' hidden states training reads: the contract that lets capture skip the rest.

Kept apart from the shard schema (``shards``, which needs pyarrow) because the SGLang engine's capture path uses it
without pyarrow.
"""

from __future__ import annotations

from typing import Any


def unread_state_positions(length: int, loss_mask: Any) -> frozenset[int]:
    """Positions of a sample whose hidden states training never reads (they may be stored as zeros).

    TTT reads ``aux[t]`` to draft token ``t + 2`` and the final state ``last[t]`` as the teacher of token ``t + 1``
    where that token is masked in; attention is causal. So the last position's states are never read, and the one
    before it only as the teacher of a masked-in last token. Capture during generation relies on this: SGLang never
    feeds the last generated token back (its states are not computed), and an appended, masked-out end-of-turn token
    (a truncated answer) leaves the position before it uncomputed too. tests/unit/test_unread_states.py checks
    that the TTT loss and metrics do not change when these states do.
    """
    if length <= 0:
        return frozenset()
    unread = {length - 1}
    if length >= 2 and not int(loss_mask[length - 1]):
        unread.add(length - 2)
    return frozenset(unread)
