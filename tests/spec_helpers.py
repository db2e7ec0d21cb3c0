"""Drafters the reference decoder's tests share (importable from any test folder, as ``serve_helpers`` is)."""

from __future__ import annotations

from typing import Any

import torch

from eaglenest.drafter.spec_fit import drafter_config_for
from eaglenest.drafters.eagle3.model import Eagle3Drafter


def untrained_eagle3(engine: Any, draft_vocab_size: int = 400) -> Eagle3Drafter:
    """A seeded, untrained EAGLE-3 drafter for ``engine``'s target with a non-trivial draft vocabulary (every other
    target token: its d2t offsets are not all zero)."""
    torch.manual_seed(0)
    cfg = drafter_config_for(engine, engine.aux_layer_ids, draft_vocab_size=draft_vocab_size)
    d = Eagle3Drafter(cfg)
    ids = torch.arange(0, cfg.vocab_size, 2)[: cfg.draft_vocab_size]
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    d.init_from_target(engine.embed_weight(), engine.lm_head_weight(), ids - torch.arange(ids.numel()), t2d)
    return d.eval()
