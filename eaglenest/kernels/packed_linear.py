"""``PackedLinear``: an inference-only ``nn.Linear`` on CPU fp32 whose cost hardly grows from 1 to 6 rows.

Speculative decoding pays only while verifying k draft tokens in one target forward costs about one decode step.
With torch's BLAS on an AVX2 CPU a 6-row linear costs ~2.2x a 1-row one; this kernel streams the pre-packed
weights once per call whatever the row count up to 6, so a verify step costs ~1.1-1.4x a decode step (numbers in
BENCHMARKS.md). Both the plain decoder and the speculative one run on it, so speedups stay like-for-like; a row's
result is independent of the batch it is in, so greedy speculative output stays token-identical to plain decoding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from eaglenest.kernels.build import load_kernel

_kernel = None  # the kernel's torch operator, set by the first PackedLinear

PANEL = 16
_MIN_WORK_PER_THREAD = 1 << 16  # weights below this run on one thread: OpenMP fork/join would cost more
MIN_PACKED_ELEMENTS = 1 << 17
"""Smaller weights stay on torch's linear, where a call's fixed cost (~10-15 us more through the operator call
and Python) is more than the kernel saves: on this repo's 2-core AVX2 VM a 6-row product wins from ~130k weights
(256 x 512) on; one row costs ~10 us more while the weights sit in cache and less once they stream from memory (a
whole model)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> ceil(N/16) panels of [K, 16] (zero-padded), the layout the kernel streams."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach().float().cpu()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` at inference (no autograd); ``weight`` is still readable (unpacked on access)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        op = load_kernel()
        if op is None:
            raise RuntimeError("the CPU kernel is unavailable here; use eaglenest.kernels.pack_linears, which skips")
        global _kernel
        _kernel = op  # module-level, not on the instance: modules must stay deep-copyable
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu().clone()
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The original [out, in] matrix (a fresh tensor: for code that reads ``lm_head.weight`` and the like)."""
        p = self.packed
        return p.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.packed.dtype != torch.float32:
            raise RuntimeError(f"PackedLinear runs on CPU float32 only, got {x.device} {x.dtype} input and "
                               f"{self.packed.dtype} weights; "
                               "set target.cpu_kernels: off for other devices or dtypes")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("PackedLinear is inference-only (no backward); train the unpacked module instead")
        k, n = self.in_features, self.out_features
        rows = x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        threads = torch.get_num_threads() if n * k >= _MIN_WORK_PER_THREAD else 1
        out = _kernel(rows, self.packed, n, threads)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(module: nn.Module) -> bool:
    """True when ``module`` lives on the CPU in float32 and the kernel loads on this machine."""
    p = next(module.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and load_kernel() is not None


def uses_packed_linears(module: nn.Module) -> bool:
    """True when any linear of ``module`` runs on the packed kernel."""
    return any(isinstance(m, PackedLinear) for m in module.modules())


def pack_linears(module: nn.Module, *, inplace: bool = True,
                 min_elements: int = MIN_PACKED_ELEMENTS) -> tuple[nn.Module, int]:
    """Swap every ``nn.Linear`` of at least ``min_elements`` weights for a :class:`PackedLinear`.

    Returns the module and how many were swapped; does nothing (count 0) where :func:`can_pack` is false.
    ``inplace=False`` packs a deep copy, for modules the caller may still train.
    """
    if not can_pack(module):
        return module, 0
    if not inplace:
        module = copy.deepcopy(module)
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.numel() >= min_elements]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return module, len(swaps)
