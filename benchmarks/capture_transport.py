"""How recorded states travel from SGLang's scheduler process to the engine actor, and what that costs the scheduler.

The seventh GPU run showed the recording engine's decode steps with a floor of ~90 ms that the offline engine does not
have, while the hooks themselves took 0.14 s in all: the cost sits around the scheduler's thread, on the host. This
script runs the two transports side by side in one run, with the real recorder (``sglang_hooks._Recorder``, driven
the way SGLang's forward hooks drive it) in this process, standing in for the scheduler, and the real sink
(``capture_sink.CaptureSink``) in a child process, standing in for the engine actor:

- ``files``: each forward's states go to a pinned staging buffer, then into a chunk file in tmpfs (written page by
  page), which the sink maps, copies into place and deletes (how the sixth and seventh runs worked);
- ``ring``: each forward's states go into a region of a shared-memory ring (with ``--device cuda`` by DMA, costing no
  CPU; on a CPU by a CPU copy, the ring's worst case) and the chunk file holds only the header, ids and positions;
  the sink copies the rows into place from the ring and hands the space back.

Between forwards the "scheduler" runs pure-Python bookkeeping over every live request (as SGLang's scheduler does
each decode step); its time per step is what recording must not inflate. Reported per transport: that bookkeeping's
time per step next to a run with no recording at all, the recorder's CPU time, and the sink's placing rate.

    python benchmarks/capture_transport.py --forwards 40 --rows 1024 --hidden 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglenest.engines.sglang.capture_sink import CaptureSink  # noqa: E402
from eaglenest.engines.sglang.hooks import _Recorder  # noqa: E402

N_AUX = 3


class _Decode:
    """SGLang's forward mode, as the hooks ask it."""

    def is_idle(self) -> bool:
        return False

    def is_decode(self) -> bool:
        return True

    def is_extend(self) -> bool:
        return False


def _actor(folder: str, hidden: int, rids: list[str], forwards: int, ring_bytes: int, out: str) -> None:
    """The engine actor's side: reserve the batch, read while the scheduler records, wait for every row."""
    sink = CaptureSink(folder, hidden_size=hidden, n_aux=N_AUX, dtype=torch.bfloat16, ring_bytes=ring_bytes,
                       reserve_max_bytes=64 << 30)
    assert sink.reserve(rids, [forwards] * len(rids))
    sink.start()
    Path(folder, "actor.ready").touch()
    t0 = time.perf_counter()
    sink.wait({r: forwards for r in rids}, quiet_s=60.0)
    st = sink.take_stats()
    Path(out).write_text(json.dumps({"wait_s": time.perf_counter() - t0, "placing_s": st.placing_s,
                                     "gb": st.bytes / 1e9}))
    sink.close()


def _bookkeeping(reqs: list[dict]) -> None:
    """A decode step's scheduler work per request: append the token, check for a stop, keep counters."""
    for r in reqs:
        r["out"].append(r["n"])
        r["n"] += 1
        if r["n"] in r["stops"] or r["n"] >= r["max"]:
            r["done"] = True


def run(mode: str, args: argparse.Namespace, base: Path) -> dict:
    folder = base / f"{mode}-{time.monotonic_ns()}"
    rids = [f"eaglenest-bench-{k}" for k in range(args.rows)]
    ring_bytes = int(args.ring_gib * 2**30) if mode == "ring" else 0
    out = base / f"{mode}.json"
    child = None
    if mode != "none":
        child = mp.get_context("spawn").Process(target=_actor, args=(str(folder), args.hidden, rids, args.forwards,
                                                                      ring_bytes, str(out)))
        child.start()
        while not (folder / "actor.ready").exists():
            time.sleep(0.01)
    rec = _Recorder(str(folder), N_AUX, "bfloat16", writers=args.writers, ring=mode == "ring") if child else None
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(args.rows, args.hidden, generator=g).to(torch.bfloat16).to(args.device)
              for _ in range(N_AUX + 1)]
    ids = torch.arange(args.rows, dtype=torch.int64, device=args.device)
    reqs = [{"out": [], "n": 0, "stops": {10**9}, "max": 10**9, "done": False} for _ in range(args.rows)]
    cpu0, t0, book = time.process_time(), time.perf_counter(), 0.0
    for step in range(args.forwards):
        if rec is not None:
            rec.forward_batch = SimpleNamespace(rids=rids, forward_mode=_Decode(), input_ids=ids,
                                                positions=torch.full((args.rows,), step, dtype=torch.int64,
                                                                     device=args.device),
                                                extend_seq_lens_cpu=None)
            for slot in range(N_AUX):
                rec.aux(slot, (states[slot], None))
            rec.final(states[N_AUX])
        b0 = time.perf_counter()
        for _ in range(args.bookkeeping):
            _bookkeeping(reqs)
        book += time.perf_counter() - b0
    record_s = time.perf_counter() - t0
    result = {"transport": mode, "bookkeeping_ms_per_step": 1e3 * book / args.forwards,
              "steps_s": record_s, "this_process_cpu_s": time.process_time() - cpu0}
    if child is not None:
        child.join(timeout=600)
        result.update(json.loads(out.read_text()))
        result["recorder"] = rec.costs()
        rec.close()
    shutil.rmtree(folder, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forwards", type=int, default=30, help="decode steps recorded")
    ap.add_argument("--rows", type=int, default=1024, help="requests in the running batch (a row each per step)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--ring-gib", type=float, default=1.0)
    ap.add_argument("--bookkeeping", type=int, default=300,
                    help="passes of per-request bookkeeping per step (a step of tens of ms, as on the GPU)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cuda: states on the GPU, copied off by the writer as in SGLang "
                    "(into pinned staging, or by DMA into the pinned ring)")
    args = ap.parse_args()
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="eaglenest-transport-", dir=shm if shm.is_dir() else None))
    per_step_mb = args.rows * (N_AUX + 1) * args.hidden * 2 / 1e6
    print(f"{args.forwards} forwards of {args.rows} rows at H {args.hidden}: {per_step_mb:.0f} MB of states per "
          f"step; {args.writers} writer(s); ring {args.ring_gib} GiB; in {base}")
    rows = []
    try:
        for rep in range(args.repeats):
            for mode in ("none", "files", "ring"):
                r = run(mode, args, base)
                r["repeat"] = rep
                rows.append(r)
                print(json.dumps(r))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n| transport | scheduler bookkeeping per step | vs no recording | recorder process CPU | sink placing |")
    print("|---|---|---|---|---|")
    for mode in ("none", "files", "ring"):
        mine = [r for r in rows if r["transport"] == mode]
        none = [r for r in rows if r["transport"] == "none"]
        ms = sum(r["bookkeeping_ms_per_step"] for r in mine) / len(mine)
        ref = sum(r["bookkeeping_ms_per_step"] for r in none) / len(none)
        cpu = sum(r["this_process_cpu_s"] for r in mine) / len(mine)
        place = ("" if mode == "none" else
                 f"{sum(r['gb'] for r in mine) / max(sum(r['placing_s'] for r in mine), 1e-9):.2f} GB/s")
        print(f"| {mode} | {ms:.1f} ms | {ms / ref:.2f}x | {cpu:.2f} s | {place} |")


if __name__ == "__main__":
    main()
