"""Online training vs offline (regen to shards, then train): accept length, throughput and back-pressure, one run.

    python benchmarks/online_train.py [--chats 300] [--epochs 6] [--seeds 0,1,2] [--out out/bench/online]

The tiny target's chats go through both paths with one config: offline = ``run_regen`` (shards on disk) and then
``train_drafter`` on them, once per seed; online = ``train_drafter(online=True)`` per seed (regen streamed into Ray
Train; each sample's answer generated once and cached, later epochs capture only). Greedy regeneration on CPU in
float32 gives both paths the same samples. Every export is evaluated on the same held-out prompts with the reference
decoder (greedy, chain 3-1-4).

Printed and written to ``online_train.json``:
- accept length per seed, offline vs online, and the hidden-state bytes each left on disk (online: and the bytes of
  its answers cache, ids and masks);
- throughput in trained samples per second (whole command, and steady state between the trainer's first and last
  records) of offline regen, offline training and online training; the target is online >= 90% of the slower side;
  also against offline end to end (regen + training wall);
- online engine rows: generated vs captured only, per epoch, and the engines' generate / capture seconds;
- back-pressure: two more online runs with engines faster than the trainer, at the default ``online_buffer_mb``
  (256) and at ``--tight-buffer-mb``: the trainer's data-wait share, the engines' busy share, and the peak number of
  rows regenerated but not yet trained (engine batch ends minus trainer steps, over time).
Both sides run on one thread each (engine actor, training worker), so on a 2-core machine they can overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

for _k, _v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)


def config(src: Path, *, seed: int, epochs: int, max_new_tokens: int, run: str, buffer_mb: int = 256,
           ttt_steps: int = 4, intermediate_size: int | None = None) -> Any:
    from eaglenest.config import EaglenestConfig

    return EaglenestConfig.model_validate({
        "target": {"model": "tiny", "device": "cpu", "dtype": "float32", "cpu_threads": 1},
        "regen": {"sources": [{"name": "chats", "domain": "chat", "adapter": "openai", "path": str(src)}],
                  "sampling": {"temperature": 0.0, "max_new_tokens": max_new_tokens}, "batch_size": 8,
                  "num_actors": 1, "num_cpus_per_actor": 0.5, "min_tokens": 4, "max_tokens": 512,
                  "rows_per_shard": 32, "storage_dtype": "bfloat16"},
        "train": {"drafter": {"draft_vocab_size": 256, "intermediate_size": intermediate_size},
                  "ttt_steps": ttt_steps, "batch_size": 8, "epochs": epochs,
                  "learning_rate": 3e-3, "warmup_ratio": 0.05, "eval_fraction": 0.1, "eval_every": 100_000,
                  "eval_max_samples": 32, "log_every": 1, "checkpoint_every": 100_000, "num_workers": 1,
                  "cpus_per_worker": 1, "seed": seed, "run_name": run, "online_buffer_mb": buffer_mb},
    })


def train_records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r["kind"] == "train"]


def steady_train_rate(out: Path, batch: int) -> float:
    """Samples per second between the trainer's first and last step records (start-up excluded)."""
    recs = train_records(out)
    if len(recs) < 2:
        return float("nan")
    return (recs[-1]["step"] - recs[0]["step"]) * batch / (recs[-1]["time"] - recs[0]["time"])


def steady_wait(out: Path) -> float:
    """The trainer's mean data-wait share over its step records after the first."""
    recs = train_records(out)[1:]
    return statistics.mean(r["data_wait_fraction"] for r in recs) if recs else float("nan")


def in_flight(out: Path, batch: int) -> dict[str, Any]:
    """Rows regenerated but not yet trained on, over the run: engine batch ends minus trainer steps.

    Counts every row between an engine's output and the optimizer: Ray Data's queues, the object store, and the
    worker's own prefetch and local-shuffle buffer (4 batches).
    """
    summary = json.loads((out / "summary.json").read_text())["online"]
    timeline = json.loads((out / "online" / "engine_timeline.json").read_text())
    recs = train_records(out)
    stream = [b for b in timeline if b[1] >= summary["stream_started"]]  # not the held-out split's batches
    events = sorted([(b[1], +int(b[4])) for b in stream] + [(r["time"], -batch) for r in recs])
    level, peak = 0, 0
    for _, n in events:
        level += n
        peak = max(peak, level)
    window = max(b[1] for b in stream) - min(b[0] for b in stream) if stream else 0.0
    # between the stream's first engine batch and its last: time an engine spent waiting is back-pressure
    return {"peak_rows": peak, "engine_busy_share": round(sum(b[1] - b[0] for b in stream) / window, 3)
            if window > 0 else float("nan"), "engine_window_s": round(window, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=300)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--tight-buffer-mb", type=int, default=1, help="0: skip the back-pressure runs")
    p.add_argument("--slow-intermediate-size", type=int, default=16384,
                   help="back-pressure runs: the drafter's MLP width, which makes the trainer slower than the engines")
    p.add_argument("--backpressure-only", action="store_true", help="run only the back-pressure part")
    p.add_argument("--out", default=str(REPO / "out" / "bench" / "online"))
    a = p.parse_args(argv)
    import shutil

    import ray
    import torch

    torch.set_num_threads(1)
    from eaglenest.config import SpecConfig, TargetConfig
    from eaglenest.drafters.eagle3.model import load_drafter
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import corpus_chats
    from eaglenest.speculative.evaluate import evaluate_acceptance, load_prompts

    out = Path(a.out)
    if not a.backpressure_only:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in corpus_chats()[: a.chats]))
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    engine = HFEngine.from_config(TargetConfig(model="tiny", device="cpu", dtype="float32"))
    heldout = load_prompts(REPO / "tests" / "fixtures" / "prompts" / "heldout.jsonl", limit=a.num_prompts)
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)

    def accept(export: str) -> float:
        rep = evaluate_acceptance(engine, load_drafter(export), heldout, spec,
                                  sampling=SamplingParams(max_new_tokens=48))
        return rep["accept_length"]

    doc: dict[str, Any] = {"command": " ".join(["python", "benchmarks/online_train.py"] + sys.argv[1:]),
                           "chats": a.chats, "epochs": a.epochs, "seeds": seeds, "heldout_prompts": len(heldout)}
    if not a.backpressure_only:
        compare(a, doc, src, out, seeds, accept)
    if a.tight_buffer_mb:
        backpressure(a, doc, src, out)
    name = "online_train_backpressure.json" if a.backpressure_only else "online_train.json"
    (out / name).write_text(json.dumps(doc, indent=2) + "\n")
    ray.shutdown()
    return 0


def compare(a: argparse.Namespace, doc: dict[str, Any], src: Path, out: Path, seeds: list[int], accept: Any) -> None:
    """Offline regen + training vs online training, per seed: accept length, throughput, bytes on disk."""
    from eaglenest.drafter.driver import train_drafter
    from eaglenest.drafter.online import hidden_state_files
    from eaglenest.regen.pipeline import run_regen

    mk = dict(epochs=a.epochs, max_new_tokens=a.max_new_tokens)
    t0 = time.perf_counter()
    regen = run_regen(config(src, seed=0, run="r", **mk), out / "regen", log=lambda m: None)
    t_regen = time.perf_counter() - t0
    n = regen["num_samples"]
    steady = regen["last_run"]["steady"]
    regen_rate_steady = steady["tokens_per_second"] / max(1, regen["last_run"]["generated_tokens"] / n) \
        if steady["seconds"] else float("nan")
    doc["offline_regen"] = {"samples": n, "seconds": round(t_regen, 1), "samples_per_s": round(n / t_regen, 3),
                            "steady_samples_per_s": round(regen_rate_steady, 3),
                            "hidden_state_bytes": sum(f.stat().st_size for f in hidden_state_files(out / "regen"))}
    print(f"[offline regen] {n} samples in {t_regen:.0f} s ({n / t_regen:.2f}/s; steady {regen_rate_steady:.2f}/s); "
          f"{doc['offline_regen']['hidden_state_bytes']} hidden-state bytes written", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {"offline": [], "online": []}
    for seed in seeds:
        for mode in ("offline", "online"):
            d = out / f"{mode}-{seed}"
            t0 = time.perf_counter()
            s = train_drafter(config(src, seed=seed, run=f"{mode}-{seed}", **mk), out / "regen" if mode == "offline"
                              else None, d, online=mode == "online")
            wall = time.perf_counter() - t0
            trained = s["train_samples"] * a.epochs if mode == "offline" else \
                sum(e["samples"] for e in s["online"]["epochs"])
            rec = {"seed": seed, "seconds": round(wall, 1), "trained_samples": trained,
                   "samples_per_s": round(trained / wall, 3), "steady_samples_per_s": round(steady_train_rate(d, 8), 3),
                   "data_wait_share": round(steady_wait(d), 3), "accept_length": accept(s["export"]),
                   "hidden_state_bytes": sum(f.stat().st_size for f in hidden_state_files(d))}
            if mode == "online":
                rec.update(in_flight(d, 8))
                led = s["online"]
                rec.update({k: led[k] for k in ("rows_per_epoch", "vocab_rows", "held_out_rows", "engine_seconds",
                                                "answers_bytes")})
                gen = sum(r["generated"] for r in led["rows_per_epoch"])
                cap = sum(r["capture_only"] for r in led["rows_per_epoch"])
                print(f"[online seed {seed}] engine rows: {gen} generated, {cap} captured only (vocab pass "
                      f"{led['vocab_rows']['generated']} generated); engine seconds {led['engine_seconds']}; answers "
                      f"cache {led['answers_bytes']} bytes", flush=True)
            runs[mode].append(rec)
            print(f"[{mode} seed {seed}] {wall:.0f} s, {trained} samples trained ({rec['samples_per_s']:.2f}/s, "
                  f"steady {rec['steady_samples_per_s']:.2f}/s, data wait {rec['data_wait_share']:.2f}); held-out "
                  f"accept length {rec['accept_length']:.3f}; hidden-state bytes on disk {rec['hidden_state_bytes']}",
                  flush=True)
    doc["runs"] = runs
    mean = {m: statistics.mean(r["accept_length"] for r in v) for m, v in runs.items()}
    doc["mean_accept_length"] = mean
    doc["online_vs_offline_accept"] = (mean["online"] - mean["offline"]) / mean["offline"]
    off_train = statistics.median(r["samples_per_s"] for r in runs["offline"])
    off_train_steady = statistics.median(r["steady_samples_per_s"] for r in runs["offline"])
    on = statistics.median(r["samples_per_s"] for r in runs["online"])
    on_steady = statistics.median(r["steady_samples_per_s"] for r in runs["online"])
    off_e2e = statistics.median(r["trained_samples"] / (doc["offline_regen"]["seconds"] + r["seconds"])
                                for r in runs["offline"])
    slower = min(doc["offline_regen"]["samples_per_s"], off_train)
    slower_steady = min(doc["offline_regen"]["steady_samples_per_s"], off_train_steady)
    doc["throughput"] = {"offline_regen": doc["offline_regen"]["samples_per_s"], "offline_train": off_train,
                         "online": on, "online_vs_slower_side": round(on / slower, 3),
                         "offline_end_to_end": round(off_e2e, 3),
                         "online_vs_offline_end_to_end": round(on / off_e2e, 3),
                         "steady": {"offline_regen": doc["offline_regen"]["steady_samples_per_s"],
                                    "offline_train": off_train_steady, "online": on_steady,
                                    "online_vs_slower_side": round(on_steady / slower_steady, 3)}}
    print(f"accept length: offline {mean['offline']:.3f}, online {mean['online']:.3f} "
          f"({100 * doc['online_vs_offline_accept']:+.1f}%)")
    print(f"throughput (samples/s, median over seeds): offline regen {doc['offline_regen']['samples_per_s']:.2f}, "
          f"offline train {off_train:.2f}, online {on:.2f} = {on / slower:.2f}x of the slower side "
          f"(steady: {doc['offline_regen']['steady_samples_per_s']:.2f} / {off_train_steady:.2f} / {on_steady:.2f} = "
          f"{on_steady / slower_steady:.2f}x); offline end to end (regen + training) {off_e2e:.2f} = "
          f"{on / off_e2e:.2f}x", flush=True)


def backpressure(a: argparse.Namespace, doc: dict[str, Any], src: Path, out: Path) -> None:
    """Engines much faster than the trainer: how far they run ahead at the default and at a small buffer."""
    import shutil

    from eaglenest.drafter.driver import train_drafter

    # short answers for fast engines; a wide drafter MLP and a 7-step unroll for a slow trainer
    doc["backpressure"] = []
    for mb in (256, a.tight_buffer_mb):
        d = out / f"backpressure-{mb}mb"
        shutil.rmtree(d, ignore_errors=True)
        cfg = config(src, seed=0, epochs=1, max_new_tokens=8, run=f"bp{mb}", buffer_mb=mb, ttt_steps=7,
                     intermediate_size=a.slow_intermediate_size)
        t0 = time.perf_counter()
        s = train_drafter(cfg, None, d, online=True)
        rows = s["online"]["epochs"][0]["samples"]
        bp = {"buffer_mb": mb, "seconds": round(time.perf_counter() - t0, 1), "samples": rows,
              "steady_samples_per_s": round(steady_train_rate(d, 8), 3),
              "data_wait_share": round(steady_wait(d), 3), **in_flight(d, 8)}
        doc["backpressure"].append(bp)
        print(f"[back-pressure] buffer {mb} MB: {rows} samples; trainer {bp['steady_samples_per_s']:.2f}/s, data "
              f"wait {bp['data_wait_share']:.2f}; engine busy {bp['engine_busy_share']:.2f} of its "
              f"{bp['engine_window_s']:.0f} s window; peak rows regenerated-not-trained {bp['peak_rows']}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
