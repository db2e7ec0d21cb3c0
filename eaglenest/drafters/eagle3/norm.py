"""RMSNorm as the EAGLE-3 drafters compute it (shared by both draft shapes)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm computed in fp32 and rounded once to the input dtype (as SGLang's fused kernel does).

    Returning the input dtype matters under bf16 autocast with fp32 master weights: an fp32 result would be
    re-cast to bf16 by every linear that reads it (q, k and v each), costing memory traffic for the same values.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(dtype)
