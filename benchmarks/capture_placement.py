"""Where a batch's recorded states are copied into place, and into what memory: the engine actor's side of capture
during generation, at a real target's width, side by side in one run.

- ``at-capture``: the sink keeps each forward's chunk and places every row when the batch is captured (after its
  generation ends: the engine has nothing else to do meanwhile unless other batches are in flight);
- ``on-arrival``: the batch is reserved before it is submitted and the sink's reader places rows as chunks arrive
  (during generation), into fresh memory;
- ``on-arrival-prewarmed``: the same into memory touched beforehand (``CaptureSink.prewarm``, which the engine actor
  runs while its engine starts).

Each variant reads the same chunk files, written the way the scheduler writes them (prefill chunks, then a decode
chunk per step with a row per request). Printed: seconds and GB/s of placing, and the seconds left after generation
(what a batch waits for once its last chunk is read). Example (BENCHMARKS.md):

    python benchmarks/capture_placement.py --sequences 512 --prompt-tokens 40 --answer-tokens 160 --hidden 4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from capture_host_path import add_batch_args, chunk_folder, write_batch  # noqa: E402

from eaglenest.engines.sglang.capture_sink import CaptureSink  # noqa: E402


def run(variant: str, folder: Path, seqs: list[list[int]], a: argparse.Namespace) -> dict:
    """Place one batch's rows by ``variant``; returns the seconds spent placing and the seconds after the last chunk."""
    sink = CaptureSink(folder, hidden_size=a.hidden)
    rids = [f"r{i}" for i in range(len(seqs))]
    masks = [[0] * a.prompt_tokens + [1] * a.answer_tokens for _ in seqs]
    wanted = list(zip(rids, seqs, masks, strict=True))
    if variant == "on-arrival-prewarmed":
        sink.prewarm(sum(len(s) for s in seqs), 1)
    if variant != "at-capture":
        assert sink.reserve(rids, [len(s) for s in seqs])
    t = time.perf_counter()
    sink.poll()  # on arrival: placing happens here, while the engine would still be generating
    reading = time.perf_counter() - t
    t = time.perf_counter()
    got = sink.assemble_many(wanted)  # after the last chunk: what the batch waits for
    after = time.perf_counter() - t
    assert all(c is not None for c, _ in got), got[0][1]
    del got
    sink.close()
    return {"while_generating_s": round(reading, 3), "after_generation_s": round(after, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap, sequences=512, prompt=40, answer=160)
    a = ap.parse_args()
    res: dict = {"sequences": a.sequences, "hidden": a.hidden}
    for variant in ("at-capture", "on-arrival", "on-arrival-prewarmed"):
        folder = chunk_folder("eaglenest-placement-")
        try:
            seqs = write_batch(folder, a.sequences, a.prompt_tokens, a.answer_tokens, a.hidden)
            gb = sum(len(s) for s in seqs) * 8 * a.hidden / 1e9
            r = run(variant, folder, seqs, a)
            total = r["while_generating_s"] + r["after_generation_s"]
            r["placing_gb_per_s"] = round(gb / max(total, 1e-9), 2)
            res[variant] = r
            res["gb"] = round(gb, 2)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
