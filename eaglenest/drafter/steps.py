"""The pieces of a training run both drivers build: drafter set-up, optimizer, LR schedule, TTT forward, step sums.

``eaglenest train`` (Ray Train workers, :mod:`eaglenest.drafter.worker`) and the in-process fitter
(:mod:`eaglenest.drafter.spec_fit`) build their run from these and hand it to the one loop,
:func:`eaglenest.drafter.loop.train_loop`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from eaglenest.drafter.batch import Batch
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTOutput
from eaglenest.drafters.vocab import VocabMapping


def init_drafter(model_cfg: DrafterModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 mapping: VocabMapping) -> Eagle3Drafter:
    """A fresh drafter whose frozen embedding and initial ``lm_head`` rows come from the target (float32, CPU)."""
    drafter = Eagle3Drafter(model_cfg)
    drafter.init_from_target(embed.detach().float().cpu(), lm_head.detach().float().cpu(), mapping.d2t, mapping.t2d)
    return drafter


def compute_dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on GPUs, float32 elsewhere (CPU bf16 matmuls are slow and inexact)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast_for(device: torch.device):
    """The autocast context of a step: bf16 on GPUs, a no-op on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def make_optimizer(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float,
                   fused: bool = False) -> torch.optim.AdamW:
    """AdamW with EAGLE-3's betas (fused kernels on GPUs when asked)."""
    return torch.optim.AdamW(list(params), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             **({"fused": True} if fused else {}))


def ttt_forward(batch: Batch, teacher: TeacherHead, module: Any, autocast: Any) -> TTTOutput:
    """Teacher targets from the target's final states, then the TTT objective over the drafter's unrolled steps.

    ``batch`` is already on the step's device and dtype; ``module`` is the objective (or its DDP wrapper).
    """
    with autocast:
        targets = teacher(batch.last, batch.loss_mask, batch.lengths)
        return module(batch.input_ids, batch.aux, targets)


def window_sums(out: TTTOutput) -> torch.Tensor:
    """[3, ttt_steps] float64: cross-entropy sums, correct counts and token counts per unrolled step."""
    return torch.stack([out.ce_sum, out.correct, out.count]).double()
