"""fp8 storage's quantiser scales bf16 states in bf16 (regen's fast path) and must write exactly the bytes of the
format's definition: per row and state, the power-of-two scale 2^ceil(log2(amax / 448)), the row divided by it in
float32 and rounded to e4m3, then the int8 exponents. The definition (benchmarks/fp8_quantise.py) is compared byte
for byte on rows spanning 80 binary orders of magnitude, zero rows, a zero state and negative extremes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from eaglenest.contracts.shards import FP8, bytes_to_tensor, tensor_to_buffer, tensor_to_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fp8_quantise import float32_definition as definition  # noqa: E402 - the format, spelled out in float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("states", [1, 3])
def test_the_quantiser_writes_the_definition_s_bytes(dtype: torch.dtype, states: int) -> None:
    gen = torch.Generator().manual_seed(states)
    width = 64 * states
    x = torch.randn(41, width, generator=gen)
    if dtype != torch.float16:  # fp16 cannot hold the wide range: its own normal range then
        x *= torch.exp2(torch.randint(-40, 40, (41, 1), generator=gen).float())
    else:
        x *= 100
    x[3] = 0
    x[5, :64] = 0
    x[7, 10] = -6e4
    x = x.to(dtype)
    want = definition(x, states)
    assert tensor_to_bytes(x, FP8, states=states) == want
    assert bytes(tensor_to_buffer(x, FP8, states=states)) == want
    back = bytes_to_tensor(want, FP8, width, states=states)
    assert back.shape == (41, width)


def test_a_wrong_scale_is_seen() -> None:
    """The control: the same rows scaled by one power of two more do not give the same bytes."""
    x = torch.randn(8, 192).to(torch.bfloat16)
    assert tensor_to_bytes(x, FP8, states=3) != definition(x * 2, 3)
