"""What one target forward over q tokens costs relative to one token: the ceiling of speculative decoding here.

A verify step feeds the target every draft token at once; speculation pays off only while that forward costs about
what a one-token decode step does. On a GPU it does. On a CPU it depends on the linear kernel: torch's BLAS makes a
few-row product cost ~2x a one-row one on AVX2, eaglenest's packed kernel (``eaglenest.kernels``) streams the weights
once whatever the row count. This script times the bare decoder stack of the target (no cache, no lm_head) over
q = 1..N tokens, side by side in one run, for each linear kernel, thread count and dtype asked for, and prints each
time and its ratio to the q = 1 time of torch's linear in the same setting.

    OMP_NUM_THREADS=2 python benchmarks/verify_cost.py [--target DIR] [--kernels torch packed] [--threads 1 2]
        [--dtypes float32 bfloat16]

``--target`` defaults to the newest 12-layer bench target that ``benchmarks/spec_speedup.py`` cached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def newest_bench_target() -> Path:
    from eaglenest.config import default_cache_dir  # where spec_speedup.py caches it ($EAGLENEST_CACHE)

    found = sorted(default_cache_dir().glob("bench-target-*"), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit("no cached bench target: run benchmarks/spec_speedup.py first, or pass --target DIR")
    return found[-1]


def time_forward(model, q: int, repeats: int) -> float:
    """Median seconds of one forward over ``q`` tokens (after two warm-up calls)."""
    x = torch.randint(0, model.config.vocab_size, (1, q))
    with torch.no_grad():
        for _ in range(2):
            model.model(input_ids=x)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.model(input_ids=x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--kernels", nargs="+", default=["torch", "packed"], choices=["torch", "packed"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from eaglenest.kernels import pack_linears, unavailable_reason

    target = args.target or newest_bench_target()
    print(f"target {target}; times are medians of {args.repeats} forwards; ratios are to torch's q=1 time")
    print(f"{'dtype':<9}{'kernel':>8}{'threads':>8}" + "".join(f"{f'q={q}':>16}" for q in args.tokens))
    for dtype in args.dtypes:
        models = {}
        for kernel in args.kernels:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype),
                                                         use_safetensors=True).eval()
            if kernel == "packed" and pack_linears(model)[1] == 0:
                print(f"{dtype:<9}{kernel:>8}  skipped: {unavailable_reason() or 'fp32 only'}")
                continue
            models[kernel] = model
        for threads in args.threads:
            torch.set_num_threads(threads)
            base = None
            for kernel, model in models.items():
                ms = [1000 * time_forward(model, q, args.repeats) for q in args.tokens]
                base = base or ms[0]
                print(f"{dtype:<9}{kernel:>8}{threads:>8}" + "".join(f"{m:>8.1f} ms {m / base:>4.2f}x" for m in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
