"""The one learning-rate shape of every training loop here (drafters and stand-in targets): linear warm-up, then a
cosine down to a floor. Pure arithmetic, so any loop can import it without the rest of its package."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(total_steps: int, warmup_steps: int, floor: float = 0.0) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``warmup_steps``, then a cosine from 1 down to ``floor`` at ``total_steps``
    (and ``floor`` after it: a run that goes on never climbs back)."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f
