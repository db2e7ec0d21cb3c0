"""Regen efficiency: generated tokens/s through the Ray Data pipeline vs the same engine in a plain loop, and the
stored bytes per token vs 8*H.

All measurements come from one run of this script, side by side on the same samples:

- ``loop``: one engine in this process; for each batch: regenerate + capture (``Regenerator.run``), serialize and
  write the shard file (the same work the pipeline does, without Ray).
- ``loop-xN`` (N > 1): N such loops at once, each in its own process over 1/N of the samples, started together:
  what N engines get from this machine with no pipeline at all. The per-engine reference for ``pipeline-N``: on a
  2-core box two engines already slow each other down (shared cores, caches, memory bandwidth), and that is not
  pipeline overhead.
- ``pipeline-N``: ``run_regen`` with an actor pool of N engines (fresh output folder).
  ``wall`` includes Ray Data start-up, normalization and actor start.

"generated tokens" = tokens the engines generated (greedy decoding, same samples: identical work in every mode).
``steady`` = the engine batches finished after every actor completed its first batch, over the time from then to the
last batch (batch timestamps reported by the actors); ``engine busy`` = the share of that window the engines spent
inside batches (1.0 = the pipeline never makes an engine wait). Per-engine efficiency = steady tokens/s per actor /
loop tokens/s (the loop runs before and after the pipelines; their mean is the reference, their spread shows how
much other load on the machine moved the numbers), and for N > 1 also / the per-engine tokens/s of ``loop-xN``.

Example (2-core CPU box, tiny target):
    OMP_NUM_THREADS=1 python benchmarks/regen_efficiency.py --samples 384 --batch-size 16 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)


def write_source(path: Path, n: int) -> int:
    """The first ``n`` distinct prompts of the tiny target's corpus, as an OpenAI-messages jsonl source."""
    from eaglenest.engines.tiny import corpus_chats
    from eaglenest.regen.formats import normalize_record

    seen, rows = set(), []
    for chat in corpus_chats():
        row = normalize_record({"messages": chat["messages"], "tools": chat.get("tools")}, "openai", source="s",
                               domain="chat")
        if row["status"] == "ok" and row["id"] not in seen:
            seen.add(row["id"])
            rows.append({"messages": chat["messages"], "tools": chat.get("tools")})
        if len(rows) == n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def make_config(source: Path, args: argparse.Namespace, actors: int):
    from eaglenest.config import EaglenestConfig

    return EaglenestConfig.model_validate({
        "target": {"model": "tiny", "engine": "hf", "device": "cpu", "dtype": "float32", "cpu_threads": 1},
        "regen": {"sources": [{"name": "bench", "domain": "chat", "adapter": "openai", "path": str(source)}],
                  "sampling": {"temperature": 0.0, "max_new_tokens": args.max_new_tokens},
                  "batch_size": args.batch_size, "num_actors": actors, "num_cpus_per_actor": args.cpus_per_actor,
                  "max_tokens": 2048, "rows_per_shard": args.batch_size, "storage_dtype": "bfloat16"},
    })


def loop(cfg, source: Path, out: Path, start_at: float | None = None) -> dict:
    """The same engine driven by a plain Python loop over the same samples (no Ray); with ``start_at`` (a
    ``time.time()``), the timed part waits for that moment so that concurrent loops overlap."""
    import pyarrow.compute as pc
    import torch

    from eaglenest.engines import SamplingParams, load_engine
    from eaglenest.regen.formats import normalize_record
    from eaglenest.regen.output import write_quarantine, write_shard
    from eaglenest.regen.regenerate import Regenerator, Sample
    from eaglenest.regen.stage import results_table

    torch.set_num_threads(1)
    rows = [normalize_record(line, "openai", source="bench", domain="chat")
            for line in source.read_text().splitlines()]
    samples = [Sample(r["id"], r["source"], r["domain"], r["messages"], r["tools"], raw=r["raw"]) for r in rows]
    t_load = time.perf_counter()
    engine = load_engine(cfg.target)
    t_load = time.perf_counter() - t_load
    rc = cfg.regen
    regen = Regenerator(engine, min_tokens=rc.min_tokens, max_tokens=rc.max_tokens, storage_dtype=rc.storage_dtype)
    sp = SamplingParams(max_new_tokens=rc.sampling.max_new_tokens)
    regen.run(samples[: rc.batch_size], lambda s: sp)  # warm-up batch (not timed, not written)
    if start_at is not None:
        time.sleep(max(start_at - time.time(), 0.0))
    tokens = loss = seq_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(samples), rc.batch_size):
        table = results_table(regen.run(samples[i:i + rc.batch_size], lambda s: sp))
        ok = table.filter(pc.equal(table.column("status"), "ok"))
        bad = table.filter(pc.not_equal(table.column("status"), "ok"))
        if ok.num_rows:
            write_shard(ok, out)
        if bad.num_rows:
            write_quarantine(bad, out, "regen")
        loss += sum(sum(m) for m in ok.column("loss_mask").to_pylist())
        tokens += regen.stats.generated_tokens
        seq_tokens += sum(ok.column("num_tokens").to_pylist())
    wall = time.perf_counter() - t0
    return {"mode": "loop", "engines": 1, "samples": len(samples), "loss_tokens": loss, "generated_tokens": tokens,
            "sequence_tokens": seq_tokens, "seconds": round(wall, 2), "load_seconds": round(t_load, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def concurrent_loops(cfg, source: Path, out: Path, engines: int) -> dict:
    """``engines`` plain loops at once, one process each, over 1/engines of the samples, timed together."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    lines = source.read_text().splitlines(keepends=True)
    parts = []
    for k in range(engines):
        part = out / f"part-{k}.jsonl"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text("".join(lines[k::engines]))
        parts.append(part)
    start_at = time.time() + 30.0  # after every process has loaded its engine and run its warm-up batch
    with ProcessPoolExecutor(engines, mp_context=mp.get_context("spawn")) as pool:
        runs = list(pool.map(loop, [cfg] * engines, parts, [out / f"loop-{k}" for k in range(engines)],
                             [start_at] * engines))
    if any(r["load_seconds"] > 25 for r in runs):
        print("warning: an engine loaded for > 25 s; the concurrent loops may not have started together")
    tokens = sum(r["generated_tokens"] for r in runs)
    wall = max(r["seconds"] for r in runs)
    return {"mode": f"loop-x{engines}", "engines": engines, "samples": sum(r["samples"] for r in runs),
            "generated_tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "per_engine_tokens_per_s": round(sum(r["tokens_per_s"] for r in runs) / engines, 1)}


def pipeline(cfg, out: Path, actors: int) -> dict:
    import pyarrow.parquet as pq

    from eaglenest.contracts.shards import shard_files
    from eaglenest.regen.pipeline import run_regen
    from eaglenest.regen.progress import steady_state

    t0 = time.time()
    summary = run_regen(cfg, out, log=lambda m: None, timeline=True)
    wall = time.time() - t0
    shards = shard_files(out)
    tokens = summary["last_run"]["generated_tokens"]
    st = steady_state(summary["timeline"], actors)
    steady_s, steady_tokens, busy = st["seconds"], st["tokens"], st["engine_busy"]
    return {"mode": f"pipeline-{actors}", "engines": actors, "samples": summary["num_samples"],
            "generated_tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "steady_seconds": round(steady_s, 2),
            "steady_tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s else None,
            "engine_busy_fraction": round(busy, 3),
            "batches": len(summary["timeline"]), "engine_pids": len({b[2] for b in summary["timeline"]}),
            "shards": len(shards), "bytes_per_token": summary["bytes_per_token"],
            "file_bytes_per_token": summary["file_bytes_per_token"],
            "disk_bytes_per_token": round(sum(f.stat().st_size for f in shards) / summary["num_tokens"], 1),
            "loss_tokens": sum(sum(m) for f in shards
                               for m in pq.read_table(f, columns=["loss_mask"]).column("loss_mask").to_pylist()),
            "hidden_size": summary["hidden_size"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cpus-per-actor", type=float, default=0.5)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()

    import ray

    work = args.work or Path(tempfile.mkdtemp(prefix="regen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        source = work / "bench.jsonl"
        n = write_source(source, args.samples)
        ray.init(include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
        results = [loop(make_config(source, args, 1), source, work / "loop")]
        for a in args.actors:
            if a > 1:
                results.append(concurrent_loops(make_config(source, args, 1), source, work / f"loops-{a}", a))
            results.append(pipeline(make_config(source, args, a), work / f"pipeline-{a}", a))
        results.append(loop(make_config(source, args, 1), source, work / "loop-again"))  # drift check
        ray.shutdown()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    base = (results[0]["tokens_per_s"] + results[-1]["tokens_per_s"]) / 2
    print(f"dataset: {n} conversations (tiny target corpus), batch {args.batch_size}, max_new_tokens "
          f"{args.max_new_tokens}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{'mode':<12}{'engines':>8}{'gen tok':>9}{'wall s':>9}{'tok/s':>9}{'steady s':>10}{'steady tok/s':>14}"
          f"{'per engine vs loop':>20}{'vs N loops':>12}{'engine busy':>13}")
    together = {r["engines"]: r["per_engine_tokens_per_s"] for r in results if r["mode"].startswith("loop-x")}
    together[1] = base
    for r in results:
        steady = r.get("steady_tokens_per_s")
        eff = f"{steady / r['engines'] / base:.0%}" if steady else "-"
        eff_n = f"{steady / r['engines'] / together[r['engines']]:.0%}" if steady and r["engines"] in together else "-"
        if r["mode"].startswith("loop-x"):
            eff = f"{r['per_engine_tokens_per_s'] / base:.0%}"
        busy = f"{r['engine_busy_fraction']:.0%}" if "engine_busy_fraction" in r else "-"
        print(f"{r['mode']:<12}{r['engines']:>8}{r['generated_tokens']:>9}{r['seconds']:>9}{r['tokens_per_s']:>9}"
              f"{r.get('steady_seconds', '-'):>10}{steady or '-':>14}{eff:>20}{eff_n:>12}{busy:>13}")
    pl = next(r for r in results if r["mode"].startswith("pipeline"))
    h = pl["hidden_size"]
    print(f"storage: {pl['bytes_per_token']:.0f} bytes/token of hidden states (8*H = {8 * h}), "
          f"{pl['file_bytes_per_token']} in the parquet blob columns, {pl['disk_bytes_per_token']} on disk in total "
          "(incl. ids, masks, parquet metadata)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "samples": n,
                                         "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
