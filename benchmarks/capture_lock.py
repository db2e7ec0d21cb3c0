"""Does a regen batch about to be submitted wait for the capture sink's reader? The copy of rows into place held
under the sink's lock (the sixth GPU run's design) vs outside it (``CaptureSink.poll`` now), side by side in one run.

A backlog of prefill-sized chunks for one reserved batch lands in the sink folder (as when the first prompts of a
regen wave are prefilled); the reader thread places them while other batches reserve their memory, one after
another, as the engine actor's batch threads do before they submit. Printed per variant: how long the reservations
took (each, and all), and when the reader finished. The old design is reproduced by holding the sink's lock (made
re-entrant for this) around the reader's whole poll, as the old reader did over its backlog; everything else is the
code as it is. Example
(BENCHMARKS.md):

    python benchmarks/capture_lock.py --chunks 8 --chunk-rows 4096 --hidden 2048 --batches 6
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglenest.engines.sglang.capture_sink import CaptureSink  # noqa: E402
from eaglenest.engines.sglang.hooks import write_chunk  # noqa: E402


def run_variant(copy_under_lock: bool, args: argparse.Namespace) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix="eaglenest-lock-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    sink = CaptureSink(folder, hidden_size=args.hidden, n_aux=3)
    per = args.chunk_rows // 64  # 64 requests per chunk, each with its prompt's rows
    rids = [f"a{i}" for i in range(args.chunks * 64)]
    assert sink.reserve(rids, [per + 8] * len(rids))
    if copy_under_lock:  # the sixth run's design: the reader held the lock over its whole backlog, copies included
        sink._lock = threading.RLock()  # type: ignore[assignment]  (re-entered by the bookkeeping inside poll)
    states = torch.ones(args.chunk_rows, 4 * args.hidden, dtype=torch.bfloat16)
    for k in range(args.chunks):
        batch = rids[k * 64:(k + 1) * 64]
        write_chunk(folder, k, batch, [per] * 64, torch.ones(args.chunk_rows, dtype=torch.int32),
                    torch.arange(per, dtype=torch.int32).repeat(64), states)
    done: list[float] = []

    def reader() -> None:
        while sink._next < args.chunks:
            if copy_under_lock:
                with sink._lock:
                    sink.poll()
            else:
                sink.poll()
        done.append(time.perf_counter())

    t0 = time.perf_counter()
    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.005)  # the reader is at its first chunk
    waits = []
    for b in range(args.batches):
        t = time.perf_counter()
        sink.reserve([f"b{b}-{i}" for i in range(256)], [200] * 256)
        waits.append(time.perf_counter() - t)
    reserved = time.perf_counter() - t0
    thread.join()
    sink.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {"reserve_max_s": max(waits), "reserve_sum_s": sum(waits), "all_reserved_at_s": reserved,
            "reader_done_at_s": done[0] - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=6, help="batches reserving while the backlog is placed")
    args = ap.parse_args()
    gb = args.chunks * args.chunk_rows * 4 * args.hidden * 2 / 1e9
    print(f"{args.chunks} chunks of {args.chunk_rows} rows at H={args.hidden} ({gb:.2f} GB) being placed while "
          f"{args.batches} batches reserve")
    for label, under in (("copy under the lock (sixth GPU run)", True), ("copy outside the lock (now)", False)):
        r = run_variant(under, args)
        print(f"{label:38s} longest reserve {r['reserve_max_s']:.3f} s, all reserved after "
              f"{r['all_reserved_at_s']:.3f} s; reader done after {r['reader_done_at_s']:.3f} s")


if __name__ == "__main__":
    main()
