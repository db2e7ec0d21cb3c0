"""When does each regen batch reach the engine stage? The plan read lazily (``read_parquet``, one block per file) vs
handed over as in-memory blocks (what ``regen.pipeline.plan_dataset`` does for a plan that fits), side by side in
one run, through an actor pool shaped like regen's (one actor, every batch in flight, ``batch_size`` = the plan's
rows per file) and a stand-in engine call that sleeps.

A plan of N full files and one short last file: lazily read, Ray Data keeps the short block in its bundler until
the read has completed, so the last batch starts late (on the H200: 17 s after the others had ended, BENCHMARKS.md,
fifth GPU run). Printed per variant: each call's start (seconds after the first), its rows, and the gap between the
short batch's start and the first start. Example (BENCHMARKS.md):

    python benchmarks/plan_delivery.py --files 12 --rows 256 --last 128 --call-seconds 3 --output-mb 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plan_files(folder: Path, full: int, rows: int, last: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    for k, n in enumerate([rows] * full + [last]):
        path = folder / f"part-{k:04d}.parquet"
        pq.write_table(pa.table({"id": [f"{k}-{i}" for i in range(n)], "raw": ["x" * 500] * n}), path)
        files.append(str(path))
    return files


def run_variant(ds, batch_size: int, in_flight: int, call_s: float, output_mb: int) -> list[tuple[float, int]]:
    import pyarrow as pa
    from ray.data import ActorPoolStrategy

    class SleepingEngine:
        def __call__(self, batch: pa.Table) -> pa.Table:
            t0 = time.time()
            time.sleep(call_s)
            blob = bytes(output_mb * 2**20)  # the engine stage's output (hidden states) occupies the object store
            return pa.table({"rows": [batch.num_rows], "start": [t0], "blob": pa.array([blob], pa.large_binary())})

    calls = ds.map_batches(
        SleepingEngine, batch_size=batch_size, batch_format="pyarrow", zero_copy_batch=True, num_cpus=0.25,
        compute=ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=in_flight, enable_true_multi_threading=True),
    ).select_columns(["rows", "start"]).take_all()
    t0 = min(c["start"] for c in calls)
    return sorted((round(c["start"] - t0, 2), c["rows"]) for c in calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=12, help="full plan files")
    ap.add_argument("--rows", type=int, default=256, help="rows per full file (= regen.batch_size)")
    ap.add_argument("--last", type=int, default=128, help="rows in the short last file")
    ap.add_argument("--call-seconds", type=float, default=3.0)
    ap.add_argument("--output-mb", type=int, default=1)
    args = ap.parse_args()
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    import ray

    from eaglenest.regen.pipeline import plan_dataset
    from eaglenest.regen.sources import data_context

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    in_flight = args.files + 1
    with tempfile.TemporaryDirectory() as tmp:
        files = plan_files(Path(tmp), args.files, args.rows, args.last)
        variants = {
            "read lazily (read_parquet, one block per file)": lambda: ray.data.read_parquet(
                files, num_cpus=0.25, file_extensions=None, override_num_blocks=len(files)),
            "in-memory blocks (plan_dataset)": lambda: plan_dataset(files),
        }
        with data_context(use_datasource_v2=False, preserve_order=False):  # as run_regen reads it
            for name, make in variants.items():
                starts = run_variant(make(), args.rows, in_flight, args.call_seconds, args.output_mb)
                short = next(s for s, n in starts if n == args.last)
                full = [s for s, n in starts if n == args.rows]
                print(f"{name}: full batches start within {max(full):.2f} s; the short batch at {short:.2f} s "
                      f"(each call takes {args.call_seconds} s)")
                print("   ", " ".join(f"{s}({n})" for s, n in starts))
    ray.shutdown()


if __name__ == "__main__":
    main()
