"""Regen on a large ShareGPT JSON-array dump: time to the first sample written and peak worker memory, next to the
old whole-file parse of the same file, in one run.

- ``generate``: a deterministic (seeded) ShareGPT-format JSON array of about ``--size-mb`` MB, like the V3
  "unfiltered cleaned split" dumps (``[{"id", "conversations": [{"from", "value"}, ...]}, ...]``).
- ``whole-file parse (old)``: ``json.load`` of that file in a fresh subprocess (what the old reader did inside one
  Ray worker before ``max_samples`` applied): seconds and the process's peak RSS (``ru_maxrss``).
- ``streaming reader (new), alone``: ``regen.readers.iter_file(path, cap=N)`` in a fresh subprocess: seconds to the
  N records and peak RSS.
- ``regen``: ``run_regen`` with the source capped at ``max_samples: N`` on the tiny target, on a local Ray started by
  this script: seconds from the call to the first shard file in the output folder, seconds to the end of planning
  (all reading done), and the peak RSS of the Ray worker that ran the read task (``ReadSource``), sampled from /proc
  every 50 ms, next to the peak of any Ray worker (the engine actor, with torch and the model loaded).

The file and the output folder go to a temporary folder (``--workdir`` to choose; deleted unless ``--keep``).

    python benchmarks/regen_large_json.py --size-mb 100 --max-samples 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

for _k, _v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "alice", "bob", "paris", "books", "river", "number", "seven", "garden", "train", "table", "window", "python",
    "function", "list", "answer", "question", "explain", "step", "because", "however", "small", "large", "count",
    "value", "result", "think", "first", "second", "third",
)


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def generate(path: Path, size_mb: float, seed: int = 0) -> int:
    """Write a ShareGPT JSON array of about ``size_mb`` MB, element by element; returns the number of records."""
    rng = random.Random(seed)
    target = int(size_mb * (1 << 20))
    n = written = 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("[\n")
        while written < target:
            turns = []
            for k in range(rng.choice((2, 2, 4, 6))):
                who = "human" if k % 2 == 0 else "gpt"
                words = rng.randint(6, 20) if who == "human" else rng.randint(80, 700)
                turns.append({"from": who, "value": " ".join(sentence(rng, 10) for _ in range(words // 10 + 1))})
            text = json.dumps({"id": f"bench_{n}", "conversations": turns}, ensure_ascii=False)
            fh.write(("" if n == 0 else ",\n") + text)
            written += len(text) + 2
            n += 1
        fh.write("\n]\n")
    return n


SUBPROCESS_OLD = """
import json, resource, sys, time
t = time.perf_counter()
with open(sys.argv[1], "rb") as fh:
    data = json.load(fh)
print(json.dumps({"seconds": time.perf_counter() - t, "records": len(data),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

SUBPROCESS_NEW = """
import json, resource, sys, time
t = time.perf_counter()
from eaglenest.regen.readers import iter_file
n = sum(1 for _ in iter_file(sys.argv[1], cap=int(sys.argv[2])))
print(json.dumps({"seconds": time.perf_counter() - t, "records": n,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def in_subprocess(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


class WorkerMemory:
    """Peak RSS of the Ray worker processes below this one, per process title (from /proc, sampled on a thread).

    The value is the process's high-water mark (VmHWM) seen while it carried the title; every measurement runs in a
    fresh local Ray, so a worker's mark comes from its start-up and the task being measured.
    """

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak: dict[str, int] = {}  # process title (ray::<task or actor>) -> peak RSS in KiB while titled so
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(self.interval):
            parent, procs = {}, {}
            for p in Path("/proc").iterdir():
                if not p.name.isdigit():
                    continue
                try:
                    stat = (p / "stat").read_text()
                    parent[int(p.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
                    procs[int(p.name)] = p
                except (OSError, ValueError):
                    continue
            todo, mine = [me], []
            while todo:
                cur = todo.pop()
                kids = [pid for pid, pp in parent.items() if pp == cur]
                mine += kids
                todo += kids
            for pid in mine:
                try:
                    cmd = (procs[pid] / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if not cmd.startswith("ray::"):
                        continue
                    # VmHWM: the kernel's own peak RSS of the process, so a short spike between samples counts
                    rss = next(int(line.split()[1]) for line in (procs[pid] / "status").read_text().splitlines()
                               if line.startswith("VmHWM:"))
                except (OSError, StopIteration, ValueError):
                    continue
                title = cmd.split()[0]
                self.peak[title] = max(self.peak.get(title, 0), rss)

    def peak_mb(self, title_part: str | None = None) -> float:
        """Peak RSS of the workers while their title contained ``title_part`` (any Ray worker: None)."""
        return max((v for t, v in self.peak.items() if title_part is None or title_part in t), default=0) / 1024


def _old_json_array_elements(row: dict) -> list[dict]:
    """The reader before issue #13, verbatim: the whole file is one blob, parsed at once, re-serialized per element."""
    data = json.loads(row["bytes"])
    items = data if isinstance(data, list) else [data]
    return [{"text": json.dumps(x, ensure_ascii=False)} for x in items]


def read_stage(source: Path, max_samples: int, old: bool) -> dict:
    """Only the read stage in Ray Data, old or new: seconds to the first row and to the cap, the read worker's peak."""
    import ray

    from eaglenest.config import SourceConfig
    from eaglenest.regen.sources import data_context, source_dataset

    with data_context(preserve_order=True, use_datasource_v2=False), WorkerMemory() as mem:
        t0 = time.monotonic()
        if old:
            ds = ray.data.read_binary_files(str(source), num_cpus=0.25, file_extensions=None)
            ds = ds.flat_map(_old_json_array_elements, num_cpus=0.25).limit(max_samples)
        else:
            src = SourceConfig(name="s", domain="chat", adapter="sharegpt", path=str(source))
            ds = source_dataset(src, max_samples)
        first = None
        n = 0
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            first = first if first is not None else time.monotonic() - t0
            n += batch.num_rows
        done = time.monotonic() - t0
    return {"first_row_s": first, "all_rows_s": done, "rows": n, "read_worker_peak_rss_mb": mem.peak_mb("Read"),
            "titles": sorted(mem.peak)}


def run_regen_timed(source: Path, out: Path, max_samples: int) -> dict:
    from eaglenest.config import EaglenestConfig
    from eaglenest.regen import run_regen

    cfg = EaglenestConfig.model_validate({
        "target": {"model": "tiny", "engine": "hf", "device": "cpu", "dtype": "float32"},
        "regen": {"sources": [{"name": "sharegpt_v3", "domain": "chat", "adapter": "sharegpt", "path": str(source),
                               "max_samples": max_samples}],
                  "sampling": {"temperature": 0.0, "max_new_tokens": 16}, "batch_size": 8, "num_actors": 1,
                  "num_cpus_per_actor": 1, "max_tokens": 1024, "rows_per_shard": 8}})
    marks: dict[str, float] = {}
    t0 = time.monotonic()

    def log(line: str) -> None:
        if line.startswith("regen: planned"):
            marks.setdefault("planned", time.monotonic() - t0)

    first = threading.Event()

    def watch() -> None:
        while not first.is_set():
            if any(not p.name.startswith(".") for p in (out / "shards").glob("*.parquet")):
                marks["first_sample"] = time.monotonic() - t0
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    with WorkerMemory() as mem:
        watcher.start()
        summary = run_regen(cfg, out, log=log, progress_interval_s=3600)
        first.set()
    return {"first_sample_s": marks.get("first_sample"), "planned_s": marks.get("planned"),
            "wall_s": time.monotonic() - t0, "samples": summary["num_samples"],
            "inputs": summary["inputs_per_source"]["sharegpt_v3"],
            "read_worker_peak_rss_mb": mem.peak_mb("ReadSource"), "any_worker_peak_rss_mb": mem.peak_mb(),
            "titles": sorted(mem.peak)}


def with_ray(fn, *args, **kwargs):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        return fn(*args, **kwargs)
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--max-samples", type=int, default=50)
    ap.add_argument("--workdir", help="folder for the dump and the output (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="regen-large-json-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        dump = work / "sharegpt_v3_unfiltered.json"
        t = time.perf_counter()
        n = generate(dump, args.size_mb)
        print(f"generated {dump.stat().st_size / (1 << 20):.1f} MB, {n} records in {time.perf_counter() - t:.1f} s",
              flush=True)
        old = in_subprocess(SUBPROCESS_OLD, str(dump))
        new = in_subprocess(SUBPROCESS_NEW, str(dump), str(args.max_samples))
        # each in a fresh local Ray: a reused worker would carry another task's memory into the measurement
        stage_new = with_ray(read_stage, dump, args.max_samples, old=False)
        stage_old = with_ray(read_stage, dump, args.max_samples, old=True)
        run = with_ray(run_regen_timed, dump, work / "out", args.max_samples)
        rows = [
            (f"Ray Data read stage, old reader (whole file, then limit {args.max_samples})",
             f"first row {stage_old['first_row_s']:.1f} s, {stage_old['rows']} rows {stage_old['all_rows_s']:.1f} s",
             f"read worker {stage_old['read_worker_peak_rss_mb']:.0f} MB"),
            (f"Ray Data read stage, new reader (streaming, cap {args.max_samples})",
             f"first row {stage_new['first_row_s']:.1f} s, {stage_new['rows']} rows {stage_new['all_rows_s']:.1f} s",
             f"read worker {stage_new['read_worker_peak_rss_mb']:.0f} MB"),
            ("whole-file json.load (old reader's parse), subprocess", f"{old['seconds']:.2f} s to parse all "
             f"{old['records']} records", f"{old['peak_rss_mb']:.0f} MB (process)"),
            (f"streaming reader, cap {args.max_samples}, subprocess", f"{new['seconds']:.3f} s to "
             f"{new['records']} records", f"{new['peak_rss_mb']:.0f} MB (process)"),
            (f"regen, max_samples {args.max_samples}, tiny target", f"first sample written {run['first_sample_s']:.1f}"
             f" s; reading+planning done {run['planned_s']:.1f} s; wall {run['wall_s']:.1f} s",
             f"read worker {run['read_worker_peak_rss_mb']:.0f} MB; any worker "
             f"{run['any_worker_peak_rss_mb']:.0f} MB"),
        ]
        print("\n| what | time | peak RSS |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
        print(f"\nregen: {run['inputs']} records read, {run['samples']} samples written")
        print(json.dumps({"old": old, "new_reader": new, "regen": run, "stage_old": stage_old, "stage_new": stage_new,
                          "file_mb": dump.stat().st_size / (1 << 20),
                          "records_in_file": n}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
