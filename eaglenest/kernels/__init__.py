"""CPU kernels for the transformers engine: a small-batch fp32 linear that keeps speculative verify cheap."""

from eaglenest.kernels.build import load_kernel, unavailable_reason
from eaglenest.kernels.packed_linear import (
    MIN_PACKED_ELEMENTS,
    PackedLinear,
    can_pack,
    pack_linears,
    pack_weight,
    uses_packed_linears,
)

__all__ = ["MIN_PACKED_ELEMENTS", "PackedLinear", "can_pack", "load_kernel", "pack_linears", "pack_weight",
           "unavailable_reason", "uses_packed_linears"]
