"""Any 64-bit ``seed`` a client sends, as a seed the decoders can use.

Why: OpenAI accepts any 64-bit integer, but the hf and reference decoders seed ``torch.Generator`` with
``seed * 1_000_003 + row``, which must fit in 64 bits (a seed above ~1.8e13 or below 0 failed with "Overflow when
unpacking long long", a 500). :func:`engine_seed` leaves seeds in ``[0, 2**43)`` as they are (the same stream as the
engines' own seeded runs) and maps every other 64-bit seed deterministically, by a hash, into that range.
"""

from __future__ import annotations

import hashlib

ENGINE_SEED_BITS = 43
"""seeds below 2**43 reach the decoder as sent: 2**43 * 1_000_003 + row stays below 2**63"""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""any signed or unsigned 64-bit integer is a valid seed"""


def engine_seed(seed: int | None) -> int | None:
    """The seed the decoder uses: ``seed`` itself when below 2**43 and not negative, else a hash of it (the same
    seed always gives the same stream); outside 64 bits: ValueError."""
    if seed is None:
        return None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {seed}")
    if 0 <= seed < 2**ENGINE_SEED_BITS:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - ENGINE_SEED_BITS)
