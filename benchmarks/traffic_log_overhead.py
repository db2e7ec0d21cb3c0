"""What the traffic log (serve.traffic_log) costs serving: the same application with the log off and on, side by side.

Two applications on one Ray Serve, identical but for ``serve.traffic_log`` (off at ``/off``; on at ``/on`` with
``sample_rate`` 1.0, every request written, redaction on: the log's worst case); the same greedy streamed requests
with the official openai client at each concurrency level, the two sides alternating (off-on, then on-off, ...) so
that the machine's drift falls on both. Reported: throughput (completion tokens/s) and mean latency per run, and the
log's cost in % of the off side's throughput, paired run by run (median of ``--repeats`` pairs), with the records the
log wrote and dropped. Target (issue #31): <= 2 % at 16 streams.

On a shared 2-core machine the throughput of two identical runs can differ by tens of percent, far above 2 %; so the
script also prints what the log costs in place, free of that noise: the writer thread's own CPU seconds (``/health``'s
``traffic_log.writer_cpu_s``, ``time.thread_time`` around each record) per record and as a share of the on side's
serving time. The request path itself adds one random draw and a non-blocking queue put.

    OMP_NUM_THREADS=1 python benchmarks/traffic_log_overhead.py [--config configs/demo.yaml] [--drafter DIR]
        [--requests 64] [--max-tokens 64] [--levels 16] [--repeats 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import PROMPTS, Level, free_port, over_http, summarize  # noqa: E402

TARGET_PCT = 2.0
"""issue #31: the log may cost at most this share of serve throughput at 16 streams"""


def pairs_iqr(cost: list[float]) -> float:
    """The spread of the paired differences (points): what identical runs differ by on this machine."""
    if len(cost) < 2:
        return float("inf")
    q1, _, q3 = statistics.quantiles(cost, n=4)
    return q3 - q1


def verdict(median: float, iqr: float) -> str:
    """'met' / 'MISSED' only when the pairs resolve the target: a spread wider than twice the target leaves the
    median's side of it to chance (the writer thread's CPU share, printed above, is then the figure to read)."""
    if iqr > 2 * TARGET_PCT:
        return f"unresolved (pairs spread {iqr:.1f} points > {2 * TARGET_PCT:g})"
    return "met" if median <= TARGET_PCT else "MISSED"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--drafter", default=None, help="exported drafter (default: serve.drafter; none = baseline)")
    ap.add_argument("--requests", type=int, default=64, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", type=int, nargs="+", default=[16])
    ap.add_argument("--repeats", type=int, default=3, help="off/on pairs per level (the median pair is reported)")
    ap.add_argument("--log-dir", default=None, help="where the on side writes (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
                 "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}.items():
        os.environ.setdefault(k, v)
    import httpx

    from eaglenest.config import load_config
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve
    from eaglenest.serve.deployment import resolve_drafter

    base = {"serve.max_tokens_limit": max(args.max_tokens, 16), "serve.max_batch_size": max(args.levels)}
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="eaglenest-traffic-")
    off = load_config(args.config, base)
    on = load_config(args.config, {**base, "serve.traffic_log": {"path": log_dir, "sample_rate": 1.0}})
    drafter = resolve_drafter(off, args.drafter)
    url_off, url_on = start_apps([AppSpec(off, drafter, "off", "/off"), AppSpec(on, drafter, "on", "/on")],
                                 port=free_port(), num_cpus=4)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    model = off.serve.model_name
    for url in (url_off, url_on):
        over_http(url, model, prompts[:4], args.max_tokens, 4, True)  # warm-up
    results: list[Level] = []
    try:
        for c in args.levels:
            for r in range(args.repeats):
                order = [("off", url_off), ("on", url_on)] if r % 2 == 0 else [("on", url_on), ("off", url_off)]
                for side, url in order:
                    wall, samples = over_http(url, model, prompts, args.max_tokens, c, True)
                    results.append(summarize(side, c, wall, samples))
        log_stats = httpx.get(f"{url_on}/health", timeout=30).json().get("traffic_log")
    finally:
        stop_serve()
    load = os.getloadavg()
    print(f"\ntraffic log overhead: {off.target.model} ({off.target.engine}), drafter {drafter or 'none'}, "
          f"{args.requests} requests x {args.max_tokens} tokens per run, greedy, streamed; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; log {log_dir}: {log_stats}")
    print(f"{'side':<5} {'conc':>4} {'wall s':>7} {'tok/s':>8} {'lat mean':>9} {'ttft p50':>8}")
    for r in results:
        print(f"{r.side:<5} {r.concurrency:>4} {r.wall_s:>7.2f} {r.tokens_per_s:>8.1f} {r.latency_mean_s:>9.3f} "
              f"{r.ttft_p50_s:>8.3f}")
    on_wall = sum(r.wall_s for r in results if r.side == "on")
    writer = {"cpu_s": log_stats["writer_cpu_s"], "records": log_stats["logged"],
              "ms_per_record": 1000 * log_stats["writer_cpu_s"] / max(1, log_stats["logged"]),
              "pct_of_one_core": 100 * log_stats["writer_cpu_s"] / on_wall}
    print(f"writer thread: {writer['cpu_s']:.3f} CPU s for {writer['records']} records "
          f"({writer['ms_per_record']:.3f} ms each) = {writer['pct_of_one_core']:.2f}% of one core over the on side's "
          f"{on_wall:.1f} s of serving (warm-up included in the records)")
    summary = []
    for c in args.levels:
        offs = [r for r in results if r.concurrency == c and r.side == "off"]
        ons = [r for r in results if r.concurrency == c and r.side == "on"]
        cost = sorted(100 * (1 - o.tokens_per_s / f.tokens_per_s) for f, o in zip(offs, ons, strict=True))
        row = {"concurrency": c, "throughput_cost_pct_median": statistics.median(cost), "pairs": cost,
               "pairs_iqr_pct": pairs_iqr(cost)}
        row["verdict"] = verdict(row["throughput_cost_pct_median"], row["pairs_iqr_pct"])
        summary.append(row)
        print(f"concurrency {c:>2}: the traffic log costs {row['throughput_cost_pct_median']:+.1f}% throughput "
              f"(median of {len(cost)} pairs: {', '.join(f'{x:+.1f}' for x in cost)}; interquartile range "
              f"{row['pairs_iqr_pct']:.1f} points)"
              + (f"  [target <= {TARGET_PCT:g}%: {row['verdict']}]" if c == 16 else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "loadavg": load, "log": log_stats,
                                              "runs": [asdict(r) for r in results], "summary": summary,
                                              "writer": writer}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
