"""fp8 storage's quantiser (``contracts.shards.tensor_to_buffer``) vs the format's float32 definition, side by side.

Regen quantises every sample's states after its generation when ``regen.storage_dtype`` is float8_e4m3fn; at
Kimi-K2.5's widths a 256-sample batch is ~1.2 GB. The quantiser scales bf16 in bf16 into one preallocated buffer; the
definition (what it replaced) converts each row to float32 first. Same bytes (checked here and in
tests/unit/test_fp8_quantise.py); this prints the time of each on one sample's aux states, interleaved, medians.

    python benchmarks/fp8_quantise.py --tokens 167 --width 21504 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.contracts.shards import FP8, FP8_MAX, tensor_to_buffer  # noqa: E402


def float32_definition(t: torch.Tensor, states: int) -> bytes:
    """The format in float32: per row and state the scale 2^ceil(log2(amax / 448)), e4m3 payload, int8 exponents."""
    x = t.to(torch.float32)
    rows, width = x.shape
    g = x.reshape(rows, states, width // states)
    amax = g.abs().amax(dim=-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    q = (g / torch.exp2(exp).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(rows, width)
    return q.view(torch.uint8).numpy().tobytes() + exp.to(torch.int8).numpy().tobytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=167, help="rows (tokens of one sample; the Kimi run's mean: 167)")
    p.add_argument("--width", type=int, default=21504, help="3 aux states x hidden (Kimi-K2.5: 3 x 7168)")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    x = (torch.randn(a.tokens, a.width, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    same = bytes(tensor_to_buffer(x, FP8, states=3)) == float32_definition(x, 3)
    times: dict[str, list[float]] = {"float32 definition": [], "quantiser": []}
    for _ in range(a.repeats):  # interleaved: the shared machine's noise falls on both
        for name, fn in (("float32 definition", lambda: float32_definition(x, 3)),
                         ("quantiser", lambda: tensor_to_buffer(x, FP8, states=3))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{a.tokens} x {a.width} bf16, {a.repeats} interleaved repeats, torch threads {torch.get_num_threads()}; "
          f"identical bytes: {same}")
    for k, v in med.items():
        print(f"  {k:<20} {v:8.2f} ms (median)")
    print(f"  quantiser speedup: {med['float32 definition'] / med['quantiser']:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
