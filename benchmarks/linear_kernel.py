"""eaglenest's packed CPU linear vs torch's, per shape, and on the tiny target's decode (where it must not be used).

    OMP_NUM_THREADS=1 python benchmarks/linear_kernel.py

Three tables, each measured side by side in one run (medians):

1. cache-hot single linears at 1 and 6 rows: the per-call cost that sets ``MIN_PACKED_ELEMENTS``;
2. long prefills (hundreds to thousands of rows): the row tiling keeps the kernel at about BLAS speed;
3. the embedded tiny target (8 layers, hidden 128) decoding 64 tokens at batch 1: every linear packed vs the
   default threshold (which leaves its small layers on torch) vs torch's linear throughout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from eaglenest.kernels import MIN_PACKED_ELEMENTS, PackedLinear, load_kernel, pack_linears, unavailable_reason

    if load_kernel() is None:
        sys.exit(f"the kernel is unavailable here: {unavailable_reason()}")
    print(f"threads {a.threads}; MIN_PACKED_ELEMENTS {MIN_PACKED_ELEMENTS}")
    with torch.no_grad():
        print("\n1. one linear, cache-hot (us per call)")
        print(f"{'out x in':>12}{'weights':>10}{'torch 1':>10}{'packed 1':>10}{'torch 6':>10}{'packed 6':>10}")
        for n, k in [(128, 128), (344, 128), (256, 512), (512, 512), (256, 768), (768, 768), (2048, 768)]:
            lin = nn.Linear(k, n, bias=False)
            packed = PackedLinear(lin)
            row = []
            for m in (1, 6):
                x = torch.randn(1, m, k)
                row += [1000 * median_ms(lambda lin=lin, x=x: lin(x), 400),
                        1000 * median_ms(lambda x=x, packed=packed: packed(x), 400)]
            print(f"{f'{n} x {k}':>12}{n * k:>10}" + "".join(f"{v:>10.1f}" for v in row))

        print("\n2. long prefills (ms per call)")
        print(f"{'out x in':>12}{'rows':>7}{'torch':>10}{'packed':>10}{'ratio':>8}")
        for n, k, m in [(2048, 768, 4096), (4096, 4096, 1024), (11008, 4096, 256)]:
            lin = nn.Linear(k, n, bias=False)
            packed = PackedLinear(lin)
            x = torch.randn(m, k)
            t, p = median_ms(lambda lin=lin, x=x: lin(x), 3), median_ms(lambda x=x, packed=packed: packed(x), 3)
            print(f"{f'{n} x {k}':>12}{m:>7}{t:>10.0f}{p:>10.0f}{p / t:>8.2f}")

    print("\n3. tiny target, batch 1, 64 tokens (s, median of 3 interleaved)")
    from eaglenest.config import TargetConfig
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import ensure_tiny_target

    path = str(ensure_tiny_target())
    engines = {"torch": HFEngine.from_config(TargetConfig(model=path, device="cpu", dtype="float32",
                                                          cpu_kernels="off")),
               "default": HFEngine.from_config(TargetConfig(model=path, device="cpu", dtype="float32"))}
    engines["all packed"] = HFEngine.from_config(TargetConfig(model=path, device="cpu", dtype="float32",
                                                              cpu_kernels="off"))
    pack_linears(engines["all packed"].model, min_elements=0)
    prompt = engines["torch"].render_prompt([{"role": "user", "content": "Count from 3 to 40."}])
    sampling = SamplingParams(max_new_tokens=64, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(3):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate_ids([prompt], sampling)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch"])
    for name, ts in times.items():
        packed = sum(isinstance(m, PackedLinear) for m in engines[name].model.modules())
        print(f"{name:>12}: {statistics.median(ts):.3f} s ({statistics.median(ts) / base:.2f}x torch; "
              f"{packed} linears packed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
