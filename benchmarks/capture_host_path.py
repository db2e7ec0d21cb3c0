"""The host side of regen's capture during generation, at a real target's width: how fast do a batch's states get from
the scheduler's chunk files into the Arrow block the engine actor hands to Ray Data?

For each batch the engine actor (1) maps the chunk files the hooks wrote and assembles every sequence's rows
(``CaptureSink.assemble_many``), (2) turns each sequence's states into its storage blob, (3) builds the block
(``stage.results_table``) and (4) puts it into Ray's object store. At H = 4096 that is ~32 KiB per token, ~1 GB/s at
the rate SGLang generates an 8B model on an H200, so every pass over the bytes counts. This script writes one
batch's chunk files the way the scheduler does (a prefill chunk per group of prompts, then one decode chunk per step
with a row per live request) and times (2)+(3) both ways side by side, in one run:

- ``bytes``: the earlier path, ``tensor_to_bytes`` per sequence (a copy) and ``Table.from_pylist`` (another copy);
- ``buffer``: ``tensor_to_buffer`` (a view of the assembled memory) and ``blob_column`` (the assembled memory becomes
  the column's buffer: no copy);

and (1) ``--repeats`` times: the first assembly fills fresh memory, later ones reuse it through the sink's
``HostBufferPool`` (the previous batch's captures are gone by then, as in the actor); (4) once, for scale.
Example (the numbers in BENCHMARKS.md):

    python benchmarks/capture_host_path.py --sequences 256 --prompt-tokens 64 --answer-tokens 128 --hidden 4096 \
        --repeats 3 --object-store
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglenest.contracts.shards import tensor_to_buffer, tensor_to_bytes  # noqa: E402
from eaglenest.engines.sglang.capture_sink import CaptureSink  # noqa: E402
from eaglenest.engines.sglang.hooks import write_chunk  # noqa: E402
from eaglenest.regen.regenerate import Regenerated, Sample  # noqa: E402
from eaglenest.regen.stage import RESULT_SCHEMA, results_table  # noqa: E402


def write_batch(folder: Path, n: int, prompt: int, answer: int, hidden: int, group: int = 16) -> list[list[int]]:
    """Chunk files for ``n`` requests: prefill chunks of ``group`` prompts, then ``answer - 1`` decode steps."""
    width = 4 * hidden
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 30000, (prompt + answer,), generator=g).tolist() for _ in range(n)]
    seq = 0
    for a in range(0, n, group):
        rids = [f"r{i}" for i in range(a, min(n, a + group))]
        rows = prompt * len(rids)
        ids = torch.tensor([t for i in range(a, a + len(rids)) for t in seqs[i][:prompt]])
        pos = torch.arange(prompt).repeat(len(rids))
        write_chunk(folder, seq, rids, [prompt] * len(rids), ids, pos, torch.randn(rows, width).to(torch.bfloat16))
        seq += 1
    for step in range(answer - 1):
        p = prompt + step
        ids = torch.tensor([s[p] for s in seqs])
        write_chunk(folder, seq, [f"r{i}" for i in range(n)], [1] * n, ids, torch.full((n,), p),
                    torch.randn(n, width).to(torch.bfloat16))
        seq += 1
    return seqs


def add_batch_args(ap: argparse.ArgumentParser, *, sequences: int, prompt: int, answer: int) -> None:
    """The shape of the batch :func:`write_batch` writes, as command-line options (with these defaults)."""
    ap.add_argument("--sequences", type=int, default=sequences)
    ap.add_argument("--prompt-tokens", type=int, default=prompt)
    ap.add_argument("--answer-tokens", type=int, default=answer)
    ap.add_argument("--hidden", type=int, default=4096)


def chunk_folder(prefix: str) -> Path:
    """A fresh folder for chunk files where the scheduler writes them: /dev/shm when there is one."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def blobs_table(seqs: list[list[int]], caps: list, blob) -> tuple[float, float, pa.Table]:
    """Seconds for the storage blobs and for the block, and the block, with ``blob`` = tensor_to_bytes or
    tensor_to_buffer."""
    t = time.perf_counter()
    results = []
    for i, (s, c) in enumerate(zip(seqs, caps, strict=True)):
        results.append(Regenerated(Sample(id=f"s{i}", source="bench", domain="chat", messages=[]), s, [1] * len(s),
                                   blob(c.aux_hidden_states, "bfloat16", states=3),
                                   blob(c.last_hidden_state, "bfloat16")))
    t_blobs = time.perf_counter() - t
    t = time.perf_counter()
    table = results_table(results)
    assert table.schema == RESULT_SCHEMA and table.num_rows == len(seqs)
    return t_blobs, time.perf_counter() - t, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap, sequences=256, prompt=64, answer=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--object-store", action="store_true", help="also time ray.put of the block (starts Ray)")
    a = ap.parse_args()
    folder = chunk_folder("eaglenest-hostpath-")
    try:
        seqs = write_batch(folder, a.sequences, a.prompt_tokens, a.answer_tokens, a.hidden)
        stored = sum(len(s) for s in seqs)
        gib = stored * 8 * a.hidden / 2**30
        sink = CaptureSink(folder, hidden_size=a.hidden)
        t = time.perf_counter()
        sink.poll()
        t_read = time.perf_counter() - t
        wanted = [(f"r{i}", s, [0] * a.prompt_tokens + [1] * a.answer_tokens) for i, s in enumerate(seqs)]
        assemble_s = []
        for _ in range(a.repeats):  # the first fills fresh memory; later ones reuse it (the previous batch is gone)
            caps = caps_why = None  # noqa: F841 - the previous batch's captures go, as after a block is put
            t = time.perf_counter()
            caps_why = sink.assemble_many(wanted)
            assemble_s.append(round(time.perf_counter() - t, 3))
            caps = [c for c, _ in caps_why]
            assert all(c is not None for c in caps), caps_why[0][1]
        res: dict = {"sequences": a.sequences, "stored_tokens": stored, "hidden_gib": round(gib, 2),
                     "read_s": round(t_read, 3), "assemble_s": assemble_s,
                     "assemble_fresh_over_reused": round(assemble_s[0] / max(min(assemble_s[1:] or [1e-9]), 1e-9),
                                                         1),
                     "buffers_reused": sink.buffers.reused}
        for name, blob in (("bytes", tensor_to_bytes), ("buffer", tensor_to_buffer)) * a.repeats:
            tb, tt, table = blobs_table(seqs, caps, blob)
            r = res.setdefault(name, {"blobs_s": [], "table_s": []})
            r["blobs_s"].append(round(tb, 3))
            r["table_s"].append(round(tt, 3))
            del table
        for name in ("bytes", "buffer"):
            r = res[name]
            r["best_total_s"] = round(min(b + t for b, t in zip(r["blobs_s"], r["table_s"], strict=True)), 3)
            r["gib_per_s"] = round(gib / max(r["best_total_s"], 1e-9), 2)
        res["bytes_over_buffer_time"] = round(res["bytes"]["best_total_s"] / max(res["buffer"]["best_total_s"], 1e-9),
                                              1)
        if a.object_store:
            import os

            import ray

            for k, v in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                         ("RAY_USAGE_STATS_ENABLED", "0")):
                os.environ.setdefault(k, v)

            ray.init(num_cpus=1, include_dashboard=False, object_store_memory=int(gib * 1.5 * 2**30) + (1 << 30))
            _, _, table = blobs_table(seqs, caps, tensor_to_buffer)
            t = time.perf_counter()
            ref = ray.put(table)
            res["object_store_put_s"] = round(time.perf_counter() - t, 3)
            del ref
            ray.shutdown()
        sink.close()
        print(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
