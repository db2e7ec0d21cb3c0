"""What the traffic log (serve.traffic_log) costs serving: the same application with the log off and on, side by side.

Two applications on one Ray Serve, identical but for ``serve.traffic_log`` (off at ``/off``; on at ``/on`` with
``sample_rate`` 1.0, every request written, redaction on: the log's worst case); the same greedy streamed requests
with the official openai client at each concurrency level, the two sides alternating (off-on, then on-off, ...) so
that the machine's drift falls on both. Reported: throughput (completion tokens/s) and mean latency per run, and the
log's cost in % of the off side's throughput, paired run by run (median of ``--repeats`` pairs), with the records the
log wrote and dropped. Target (issue #31): <= 2 % at 16 streams.

On a shared 2-core machine two identical runs can differ by several percent, more than the 2 % target; so each cost
is the median of many pairs with its distribution-free 95% interval, and the verdict is 'met' or 'MISSED' only when
the interval lies wholly on one side of the target ('unresolved' otherwise). Two measures, both paired: throughput,
and the CPU seconds the replica's process tree used per completion token (/proc; the two sides generate the same
greedy tokens, and a CPU-bound server's throughput is the inverse of it). ``--control`` runs the same with the log off
on both sides (an A/A run: the method's own bias and spread). Also printed: the writer thread's own CPU seconds
(``/health``'s ``traffic_log.writer_cpu_s``) per record and as a share of the on side's serving time. The request path
itself adds one random draw and a non-blocking queue put.

    OMP_NUM_THREADS=1 python benchmarks/traffic_log_overhead.py [--config configs/demo.yaml] [--drafter DIR]
        [--requests 64] [--max-tokens 64] [--levels 16] [--repeats 41] [--control] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import PROMPTS, Level, free_port, over_http, summarize  # noqa: E402

TARGET_PCT = 2.0
"""issue #31: the log may cost at most this share of serve throughput at 16 streams"""


def replica_tree_cpu_s(app: str) -> float:
    """CPU seconds (user + system) used so far by ``app``'s Serve replica process and every process under it (the
    decoder process, where ``serve.decoder_process`` is on), read from /proc. Per completion token, side by side,
    this is the log's cost in serving capacity, free of the wall-clock noise of a shared machine: the two sides
    generate the same greedy tokens, and a CPU-bound server's throughput is the inverse of its CPU per token."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU s)
    roots = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        stats[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
        if f"ServeReplica:{app}:" in cmdline:
            roots.append(int(d.name))
    if not roots:
        raise RuntimeError(f"no Serve replica process of app {app!r} found in /proc (its title names the app)")
    tree, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(stats[pid][1] for pid in tree)


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (order statistics, the binomial sign-test
    bound): no assumption on how a shared machine's noise is distributed. Fewer than 6 values bound nothing at 95%."""
    xs, n = sorted(values), len(values)
    alpha = 1.0 - confidence
    k = -1  # the largest 0-based rank whose tail P(Binomial(n, 1/2) <= k) stays within alpha / 2
    tail = 0.0
    for i in range(n):
        tail += math.comb(n, i) / 2**n
        if tail > alpha / 2:
            break
        k = i
    if k < 0:
        return -math.inf, math.inf
    return xs[k], xs[n - 1 - k]


def verdict(ci: tuple[float, float]) -> str:
    """'met' when the whole 95% interval of the median pair is within the target, 'MISSED' when it is wholly above,
    else 'unresolved' (the pairs do not decide it: more of them, or a quieter machine)."""
    lo, hi = ci
    if hi <= TARGET_PCT:
        return "met"
    if lo > TARGET_PCT:
        return "MISSED"
    return f"unresolved (95% interval of the median {lo:+.2f} .. {hi:+.2f})"


def judged(cost: list[float]) -> dict[str, Any]:
    """The paired costs (%), their median, its 95% interval and the verdict against :data:`TARGET_PCT`."""
    ci = median_ci(cost)
    return {"median_pct": statistics.median(cost), "ci95_pct": list(ci), "pairs": sorted(cost), "verdict": verdict(ci)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--drafter", default=None, help="exported drafter (default: serve.drafter; none = baseline)")
    ap.add_argument("--requests", type=int, default=64, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", type=int, nargs="+", default=[16])
    ap.add_argument("--repeats", type=int, default=41, help="off/on pairs per level (the median pair is reported)")
    ap.add_argument("--log-dir", default=None, help="where the on side writes (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--control", action="store_true",
                    help="an A/A run: the log off on both sides, so the pairs show the method's own bias and spread")
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
    on = load_config(args.config, base if args.control else
                     {**base, "serve.traffic_log": {"path": log_dir, "sample_rate": 1.0}})
    drafter = resolve_drafter(off, args.drafter)
    url_off, url_on = start_apps([AppSpec(off, drafter, "off", "/off"), AppSpec(on, drafter, "on", "/on")],
                                 port=free_port(), num_cpus=4)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    model = off.serve.model_name
    for url in (url_off, url_on):
        over_http(url, model, prompts[:4], args.max_tokens, 4, True)  # warm-up
    results: list[Level] = []
    cpu_per_token: list[tuple[str, int, float]] = []  # (side, concurrency, replica tree's CPU ms per token)
    try:
        for c in args.levels:
            for r in range(args.repeats):
                order = [("off", url_off), ("on", url_on)] if r % 2 == 0 else [("on", url_on), ("off", url_off)]
                for side, url in order:
                    cpu0 = replica_tree_cpu_s(side)
                    wall, samples = over_http(url, model, prompts, args.max_tokens, c, True)
                    results.append(summarize(side, c, wall, samples))
                    cpu_per_token.append((side, c, 1000 * (replica_tree_cpu_s(side) - cpu0)
                                          / max(1, results[-1].tokens)))
        log_stats = httpx.get(f"{url_on}/health", timeout=30).json().get("traffic_log") or {
            "writer_cpu_s": 0.0, "logged": 0, "control": "the log is off on both sides"}
    finally:
        stop_serve()
    load = os.getloadavg()
    print(f"\ntraffic log overhead: {off.target.model} ({off.target.engine}), drafter {drafter or 'none'}, "
          f"{args.requests} requests x {args.max_tokens} tokens per run, greedy, streamed; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; log {log_dir}: {log_stats}"
          + ("\nA/A CONTROL: the log is off on both sides; every 'cost' below is the method's own" if args.control
             else ""))
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
        throughput = judged([100 * (1 - o.tokens_per_s / f.tokens_per_s) for f, o in zip(offs, ons, strict=True)])
        cpu_off = [ms for side, cc, ms in cpu_per_token if cc == c and side == "off"]
        cpu_on = [ms for side, cc, ms in cpu_per_token if cc == c and side == "on"]
        cpu = judged([100 * (n / f - 1) for f, n in zip(cpu_off, cpu_on, strict=True)])
        cpu["ms_per_token"] = {"off": statistics.median(cpu_off), "on": statistics.median(cpu_on)}
        summary.append({"concurrency": c, "throughput_cost": throughput, "cpu_per_token_cost": cpu})
        for name, row in (("throughput", throughput), ("the replica's CPU per token", cpu)):
            lo, hi = row["ci95_pct"]
            print(f"concurrency {c:>2}: the traffic log costs {row['median_pct']:+.2f}% {name} (median of "
                  f"{len(row['pairs'])} pairs, 95% interval {lo:+.2f} .. {hi:+.2f})"
                  + (f"  [target <= {TARGET_PCT:g}%: {row['verdict']}]" if c == 16 else ""))
        print(f"   CPU per token: off {cpu['ms_per_token']['off']:.3f} ms, on {cpu['ms_per_token']['on']:.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "loadavg": load, "log": log_stats,
                                              "runs": [asdict(r) for r in results], "summary": summary,
                                              "writer": writer}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
