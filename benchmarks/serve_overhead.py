"""What HTTP + Ray Serve add on top of the engine: the same backend called in-process vs through the OpenAI API.

Both sides use the same decoder, the same batching scheduler and the same greedy requests (streamed, so time to
first token is measured the same way); they run side by side in one process, one after the other, at 1 and 16
concurrent streams. In-process = the decoder on a thread of this process, fed by client threads; HTTP = the served
replica as configured (by default its decoder runs in a process of its own, ``serve.decoder_process``). Reported
per level: wall time, throughput (completion tokens/s), mean/p50/p95 request latency and TTFT, and the HTTP
overhead in % of the in-process figure, paired run by run (median of ``--repeats`` pairs).
Target: <= 5 % throughput loss at 16 streams.

    OMP_NUM_THREADS=1 python benchmarks/serve_overhead.py [--config configs/demo.yaml] [--drafter DIR]
        [--requests 32] [--max-tokens 64] [--levels 1 16] [--stop-at-eos] [--out F.json]
        [--set target.tiny.hidden_size=512 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Hello! Who are you?",
    "Write a short poem about the sea.",
    "What is 12 times 7? Explain briefly.",
    "List three colors.",
    "Tell me a fact about the moon.",
    "How do I sort a list in Python?",
    "Name a large city.",
    "Why is the sky blue?",
]


@dataclass
class Sample:
    latency_s: float
    ttft_s: float
    tokens: int


@dataclass
class Level:
    side: str
    concurrency: int
    requests: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p95_s: float
    ttft_mean_s: float
    ttft_p50_s: float


def summarize(side: str, concurrency: int, wall: float, samples: list[Sample]) -> Level:
    lat = sorted(s.latency_s for s in samples)
    ttft = sorted(s.ttft_s for s in samples)
    tokens = sum(s.tokens for s in samples)
    return Level(side, concurrency, len(samples), wall, tokens, tokens / wall, statistics.fmean(lat),
                 statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))], statistics.fmean(ttft),
                 statistics.median(ttft))


def in_process(backend, prompt_ids: list[list[int]], max_tokens: int, concurrency: int,
               ignore_eos: bool) -> tuple[float, list[Sample]]:
    """``concurrency`` client threads submitting streamed jobs to the backend (no HTTP, no Ray)."""
    from eaglenest.engines.base import SamplingParams
    from eaglenest.serve.backends import Job

    sp = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=ignore_eos)
    samples: list[Sample] = []
    lock = threading.Lock()
    todo = list(range(len(prompt_ids)))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            done = threading.Event()
            first: list[float] = []
            count = [0]

            def sink(ev, done=done, first=first, count=count) -> None:
                if ev.token_ids:
                    if not first:
                        first.append(time.perf_counter())
                    count[0] += len(ev.token_ids)
                if ev.final:
                    done.set()

            t0 = time.perf_counter()
            backend.submit(Job(list(prompt_ids[i]), sp, sink))
            done.wait()
            t1 = time.perf_counter()
            with lock:
                samples.append(Sample(t1 - t0, (first[0] if first else t1) - t0, count[0]))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, samples


def over_http(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
              ignore_eos: bool) -> tuple[float, list[Sample]]:
    """``concurrency`` concurrent streaming chat requests with the official openai client."""
    import openai

    async def run() -> tuple[float, list[Sample]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        samples: list[Sample] = []

        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                t0 = time.perf_counter()
                first, tokens = None, 0
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True} if ignore_eos else None)
                async for c in stream:
                    if c.choices and c.choices[0].delta.content and first is None:
                        first = time.perf_counter()
                    if c.usage is not None:
                        tokens = c.usage.completion_tokens
                t1 = time.perf_counter()
                samples.append(Sample(t1 - t0, (first or t1) - t0, tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        await client.close()
        return wall, samples

    return asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--drafter", default=None, help="exported drafter (default: serve.drafter; none = baseline)")
    ap.add_argument("--requests", type=int, default=32, help="requests per level and side")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="let requests end at EOS (default: ignore_eos, every request decodes exactly --max-tokens, "
                         "as serving benchmarks do, so both sides do the same work)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="in-process/HTTP pairs per level (the median pair is reported: the machine may be shared)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (YAML value), e.g. target.tiny.hidden_size=512 target.tiny.train_steps=0")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)

    import yaml

    from eaglenest.config import load_config
    from eaglenest.serve.backends import make_local_backend
    from eaglenest.serve.cli import start_serve, stop_serve
    from eaglenest.serve.deployment import resolve_drafter

    overrides = {"serve.max_tokens_limit": max(args.max_tokens, 16), "serve.max_batch_size": max(args.levels)}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    cfg = load_config(args.config, overrides)
    drafter = resolve_drafter(cfg, args.drafter)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]

    backend = make_local_backend(cfg, drafter)  # the engine called in-process: decoder thread, no HTTP, no Ray
    prompt_ids = [backend.render_chat([{"role": "user", "content": p}]) for p in prompts]
    fixed = not args.stop_at_eos
    in_process(backend, prompt_ids[:4], args.max_tokens, 4, fixed)  # warm-up
    url = start_serve(cfg, drafter, port=free_port(), num_cpus=4)
    over_http(url, cfg.serve.model_name, prompts[:4], args.max_tokens, 4, fixed)  # warm-up

    results: list[Level] = []
    try:
        for c in args.levels:
            for _ in range(args.repeats):
                wall, s = in_process(backend, prompt_ids, args.max_tokens, c, fixed)
                results.append(summarize("in-process", c, wall, s))
                wall, s = over_http(url, cfg.serve.model_name, prompts, args.max_tokens, c, fixed)
                results.append(summarize("http", c, wall, s))
    finally:
        stop_serve()
        backend.close()

    load = os.getloadavg()
    print(f"\nserve overhead: {cfg.target.model} ({cfg.target.engine}), drafter {drafter or 'none (baseline)'}, "
          f"{args.requests} requests x {args.max_tokens} {'max ' if args.stop_at_eos else ''}tokens per level, greedy, "
          f"streamed; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    head = f"{'side':<11} {'conc':>4} {'wall s':>7} {'tok/s':>8} {'lat mean':>9} {'lat p50':>8} {'lat p95':>8} " \
           f"{'ttft mean':>9} {'ttft p50':>8}"
    print(head)
    for r in results:
        print(f"{r.side:<11} {r.concurrency:>4} {r.wall_s:>7.2f} {r.tokens_per_s:>8.1f} {r.latency_mean_s:>9.3f} "
              f"{r.latency_p50_s:>8.3f} {r.latency_p95_s:>8.3f} {r.ttft_mean_s:>9.3f} {r.ttft_p50_s:>8.3f}")
    summary = []
    for c in args.levels:
        inp = [r for r in results if r.concurrency == c and r.side == "in-process"]
        htp = [r for r in results if r.concurrency == c and r.side == "http"]
        # paired: each HTTP run against the in-process run just before it (the machine's load drifts between pairs)
        loss = sorted(100 * (1 - h.tokens_per_s / i.tokens_per_s) for i, h in zip(inp, htp, strict=True))
        added = sorted(100 * (h.latency_mean_s / i.latency_mean_s - 1) for i, h in zip(inp, htp, strict=True))
        row = {"concurrency": c, "throughput_loss_pct_median": statistics.median(loss),
               "throughput_loss_pct_pairs": loss, "latency_added_pct_median": statistics.median(added),
               "latency_added_pct_pairs": added}
        summary.append(row)
        print(f"concurrency {c:>2}: HTTP + Ray Serve cost {row['throughput_loss_pct_median']:+.1f}% throughput "
              f"(median of {len(loss)} pairs: {', '.join(f'{x:+.1f}' for x in loss)}), "
              f"{row['latency_added_pct_median']:+.1f}% mean latency"
              + ("  [target <= 5%: " + ("met" if row["throughput_loss_pct_median"] <= 5 else "MISSED") + "]"
                 if c == max(args.levels) else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "loadavg": load,
                                              "levels": [asdict(r) for r in results],
                                              "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
