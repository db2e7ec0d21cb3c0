"""Issue 29's acceptance on the GPU: tune a schedule, bench it side by side, and ramp the served load (gpu_e2e steps).

Run as three more steps of ``benchmarks/gpu_e2e.sh`` with ``E2E_TUNE=1`` (after ``serve``, on the drafter it served):

- ``tune``: ``eaglenest tune`` on the serving config (SGLang: the baseline engine, "off" (an adaptive engine pinned to
  steps 0), every chain of ``E2E_TUNE_STEPS`` at ``E2E_TUNE_BATCHES``) -> ``results/tune/schedule.{json,md,png}``.
- ``bench_schedule``: the baseline, the best static config per batch size and the schedule as serve launches it
  (SGLang's adaptive mode), side by side in one run at the same batch sizes; checks: schedule >= 0.98x the baseline
  at every batch size, within 5% of the best static config at each, >= 1.5x at batch 1. By default the tune's own
  run measures the schedule (``eaglenest tune --verify``: every candidate is a static config, one engine start more,
  ``results/tune/verify/bench-sweep.{json,md,png}``); ``E2E_TUNE_VERIFY=0``: a second run, ``eaglenest bench
  --schedule`` (the baseline, the chosen shapes and the schedule started again, ``results/bench-schedule/``).
- ``ramp``: ``eaglenest serve`` twice (the schedule; no drafter), each under a ramp of concurrent streams
  (``E2E_RAMP_LEVELS``, ``E2E_RAMP_STEP_S`` seconds a level) from the official ``openai`` client: output tok/s and
  TTFT p99 per level (a level runs past its seconds, up to 3x, until ``E2E_RAMP_MIN_TTFT`` requests (60) started in
  its window); checks: tok/s never more than 3% below the plain server's, TTFT p99 not worse by more than 10%.

On the CPU (``bash benchmarks/gpu_e2e.sh --cpu`` with ``E2E_TUNE=1``) the same steps run at toy sizes on the hf engine
(what is checked there is the plumbing, not the figures). Estimated device time on the H200 with the Llama stand-in
(8B, ~70 s an engine start): tune ~(3 + chains) x (start + ~40 s of measuring at 9 batch sizes, 2 repeats) ~ 13 min
for 4 chains and one temperature (each temperature in ``E2E_TUNE_TEMPERATURES`` adds as much), its --verify one start
and measuring more (~2 min; the separate bench it replaces: ~(3 + chosen shapes) starts, ~7 min); ramp 2 x (serve
start ~110 s + 9 levels x (E2E_RAMP_STEP_S + ~8 s)) ~ 12 min; engine starts shorter by what E2E_TUNE_GRAPHS saves
(not measured). With the base loop cut to what the tune needs (E2E_STEPS_SKIP=offline_ref,offline_recording,
eagle_forced,bench,serve; E2E_TRAIN_PROMPTS=1600 E2E_EPOCHS=2: ~8 min), E2E_TUNE_STEPS=2,3 and E2E_RAMP_STEP_S=12
the whole run is estimated at ~28 min. Measured on an H100 in a rehearsal (BENCHMARKS.md, twelfth session: batch 1
and 256, one chain): five engine starts and their measuring in 244.8 s (~44 s a start with E2E_TUNE_GRAPHS); that
rehearsal found the tune measuring adaptive plans on the plain engine and SGLang's 48-request cap on speculative
engines; the thirteenth session's rehearsal ran both fixes (287.2 s for the five starts, graphs up to 256) and the two
ramps of 2 levels in 210.4 s.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import gpu_e2e as e2e

TUNE_BATCHES = e2e.knob("E2E_TUNE_BATCHES", gpu="1,2,4,8,16,32,64,128,256", cpu="1,2")
TUNE_STEPS = e2e.knob("E2E_TUNE_STEPS", gpu="1,2,3,5", cpu="1,2")
TUNE_TEMPERATURES = e2e.knob("E2E_TUNE_TEMPERATURES", gpu="0", cpu="0")
TUNE_PROMPTS = int(e2e.knob("E2E_TUNE_PROMPTS", gpu=16, cpu=4))
TUNE_MAX_NEW_TOKENS = int(e2e.knob("E2E_TUNE_MAX_NEW_TOKENS", gpu=96, cpu=12))
TUNE_REPEATS = int(e2e.knob("E2E_TUNE_REPEATS", gpu=2, cpu=2))
RAMP_LEVELS = [int(x) for x in e2e.knob("E2E_RAMP_LEVELS", gpu="1,2,4,8,16,32,64,128,256", cpu="1,2,4").split(",")]
RAMP_STEP_S = float(e2e.knob("E2E_RAMP_STEP_S", gpu=20, cpu=6))
RAMP_WARM_S = float(e2e.knob("E2E_RAMP_WARM_S", gpu=3, cpu=1))
RAMP_MAX_TOKENS = int(e2e.knob("E2E_RAMP_MAX_TOKENS", gpu=128, cpu=16))
RAMP_MIN_TTFT = int(e2e.knob("E2E_RAMP_MIN_TTFT", gpu=60, cpu=0))
"""a level's window runs past E2E_RAMP_STEP_S (up to 3x) until this many requests started in it: with 8 s at one
stream (14 requests) the TTFT p99 was the maximum, and two identical servers differed by 1.33x (thirteenth session)"""
TUNE_VERIFY = e2e.knob("E2E_TUNE_VERIFY", gpu=1, cpu=1) == "1"
"""``eaglenest tune --verify``: the schedule measured in the tune's own run beside the measurements that chose it (one
engine start: the schedule's, then the baseline's drift run), and ``bench_schedule`` reads that sweep; 0: a second
run, ``eaglenest bench --schedule``, which starts the baseline, the chosen shapes and the schedule again"""
TUNE_OUT = e2e.RESULTS / "tune"
SCHEDULE = TUNE_OUT / "schedule.json"
TUNE_GRAPHS = e2e.knob("E2E_TUNE_GRAPHS", gpu=1, cpu=0) == "1"
"""the tune's, the bench's and the ramp's SGLang engines capture decode graphs at the tuned batch sizes (powers of two
up to the largest: :func:`gpu_e2e.graph_batch_sizes`) and build no prefill graphs (:data:`gpu_e2e.NO_PREFILL_GRAPHS`),
where SGLang's own ladder to 256 is ~36 sizes captured for the target and every draft step and its piecewise prefill
graphs compile per engine start: the tune starts (3 + chains) engines and the ramp two servers. The same settings
everywhere, so the schedule's engine identity (which records them) matches the servers the ramp starts"""
ROUTE = e2e.knob("E2E_ROUTE", gpu=0, cpu=0) == "1"
"""``serve.route.by_load`` in the tuned config: where no one configuration is safe from batch 1 to the largest (SGLang's
adaptive "off" measured 0.28x at 256 on the H100), serve runs a speculative engine for the loads the schedule found
a drafter safe over beside a plain engine for the rest, and the tune's --verify measures the schedule that way"""
ROUTE_PLAIN_MEM = float(e2e.knob("E2E_ROUTE_PLAIN_MEM", gpu=0.5, cpu=0.5))
"""with E2E_ROUTE=1, every engine's ``mem_fraction_static`` (the tune's, the bench's and the plain servers'): the plain
engine starts first and must leave room for the speculative one (8B: 14.5 GB of weights each)"""
TUNE_CONFIG = e2e.WORK / "e2e-tune.yaml"
SERVE_SCHEDULE_CONFIG = e2e.WORK / "e2e-serve-schedule.yaml"
SERVE_PLAIN_CONFIG = e2e.WORK / "e2e-serve-plain.yaml"


def tune_config() -> Path:
    """The run's config with :data:`TUNE_GRAPHS`' engine settings (every tune step writes and reads the same)."""
    import yaml

    cfg = yaml.safe_load(e2e.CONFIG.read_text())
    if TUNE_GRAPHS:
        sg = cfg["target"].setdefault("sglang", {})
        sg["extra_args"] = {**(sg.get("extra_args") or {}), **e2e.NO_PREFILL_GRAPHS,
                            "cuda_graph_bs_decode": e2e.graph_batch_sizes(TUNE_BATCHES)}
    if ROUTE:
        cfg.setdefault("serve", {})["route"] = {"by_load": True}
        cfg["target"].setdefault("sglang", {})["mem_fraction_static"] = ROUTE_PLAIN_MEM
    TUNE_CONFIG.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return TUNE_CONFIG


def step_tune() -> dict[str, Any]:
    """``eaglenest tune`` on the served drafter, with the serving config."""
    drafter = e2e.served_export()
    res = e2e.sh([sys.executable, "-m", "eaglenest.cli", "tune", "--config", str(tune_config()), "--drafter",
                  str(drafter), "--batch-sizes", TUNE_BATCHES, "--steps", TUNE_STEPS, "--temperatures",
                  TUNE_TEMPERATURES, "--repeats", str(TUNE_REPEATS), "--max-new-tokens", str(TUNE_MAX_NEW_TOKENS),
                  "--num-prompts", str(TUNE_PROMPTS), "--output", str(TUNE_OUT), "--no-progress",
                  *(["--verify"] if TUNE_VERIFY else [])],
                 timeout=5400, log_name="tune")
    rec: dict[str, Any] = {"status": "ok" if res.returncode == 0 and SCHEDULE.is_file() else "error",
                           "rc": res.returncode, "drafter": str(drafter), "stdout_tail": res.stdout[-3000:]}
    if rec["status"] != "ok":
        rec["error"] = (res.stderr or res.stdout)[-3000:]
        return rec
    s = json.loads(SCHEDULE.read_text())
    rec["buckets"] = {b["label"]: {"runs": b["choice"]["label"], "x_baseline": b["choice"]["median_ratio"],
                                   "noise": b["noise"], "sglang_candidates": b["chain_steps"]} for b in s["buckets"]}
    rec["drift"] = s.get("drift")
    return rec


def chosen_shapes() -> list[str]:
    """Every speculative shape some bucket of the schedule runs (the bench's static configs)."""
    s = json.loads(SCHEDULE.read_text())
    out = []
    for b in s["buckets"]:
        for o in (b["choice"], b.get("chain_choice") or b["choice"]):
            if o["num_steps"] > 0 and o["label"] not in out:
                out.append(o["label"])
    return out


def step_bench_schedule() -> dict[str, Any]:
    """Baseline, the best static config per batch size and the schedule, side by side: the tune's --verify sweep
    (every candidate a static config), or with E2E_TUNE_VERIFY=0 a second run over the chosen shapes."""
    if not SCHEDULE.is_file():
        return {"status": "error", "error": "no schedule: the tune step failed"}
    if TUNE_VERIFY:
        sweep = TUNE_OUT / "verify" / "bench-sweep.json"
        if not sweep.is_file():
            return {"status": "error", "error": f"no {sweep}: the tune's --verify did not finish (see the tune log)"}
        return {"status": "ok", "measured_by": "eaglenest tune --verify (the schedule beside the tune's measurements, "
                "every candidate a static config)", **sweep_checks(json.loads(sweep.read_text()))}
    out = e2e.RESULTS / "bench-schedule"
    shapes = chosen_shapes() or [f"{TUNE_STEPS.split(',')[0]}-1-{int(TUNE_STEPS.split(',')[0]) + 1}"]
    res = e2e.sh([sys.executable, "-m", "eaglenest.cli", "bench", "--config", str(tune_config()), "--drafter",
                  str(e2e.served_export()), "--schedule", str(SCHEDULE), "--sweep", ",".join(shapes),
                  "--batch-size", TUNE_BATCHES, "--num-prompts", str(TUNE_PROMPTS), "--max-new-tokens",
                  str(TUNE_MAX_NEW_TOKENS), "--repeats", str(TUNE_REPEATS), "--output", str(out)],
                 timeout=5400, log_name="bench_schedule")
    sweep = out / "bench-sweep.json"
    if not sweep.is_file():
        return {"status": "error", "rc": res.returncode, "error": (res.stderr or res.stdout)[-3000:]}
    return {"status": "ok" if res.returncode == 0 else "error", "rc": res.returncode, "shapes": shapes,
            **sweep_checks(json.loads(sweep.read_text())),
            **({"error": (res.stderr or res.stdout)[-3000:]} if res.returncode else {})}


def sweep_checks(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's three bench lines on a bench-sweep summary (rows, checks and the worst ratios)."""
    rows = summary["rows"]
    checks = {
        "schedule_ge_0.98x_baseline_everywhere": all((r["schedule_vs_baseline"] or 0) >= 0.98 for r in rows),
        "schedule_within_5pct_of_best_static_everywhere": all(
            r["schedule_vs_best_static"] is None or r["schedule_vs_best_static"] >= 0.95 for r in rows),
        "schedule_ge_1.5x_at_batch_1": any(r["batch_size"] == 1 and (r["schedule_vs_baseline"] or 0) >= 1.5
                                           for r in rows),
    }
    return {"rows": rows, "checks": checks, "worst_schedule_vs_baseline": summary["worst_schedule_vs_baseline"],
            "worst_schedule_vs_best_static": summary["worst_schedule_vs_best_static"]}


# ------------------------------------------------------------------------------------------------------ the ramp
def write_serve_configs() -> None:
    """The serving config twice: with the tuned schedule, and without a drafter (the server to beat)."""
    import yaml

    cfg = yaml.safe_load(tune_config().read_text())  # the engine settings the schedule was tuned with
    top = max(RAMP_LEVELS)
    serve = {**cfg["serve"], "max_concurrent_requests": top + 8, "expected_batch_size": [1, top],
             "max_batch_size": max(top, cfg["serve"].get("max_batch_size", 16))}
    serve.pop("spec", None)
    with_schedule = {**cfg, "serve": {**serve, "schedule": str(SCHEDULE)}}
    plain = {**cfg, "serve": {**serve, "drafter": None, "self_test_min_accept_length": 1.0}}  # no drafter: 1.0
    SERVE_SCHEDULE_CONFIG.write_text(yaml.safe_dump(with_schedule, sort_keys=False))
    SERVE_PLAIN_CONFIG.write_text(yaml.safe_dump(plain, sort_keys=False))


def _serve(job_id: str, config: Path, drafter: str | None) -> None:
    """``ray job submit -- eaglenest serve`` and wait until /health answers 200."""
    args = ["eaglenest", "serve", "--config", str(config), "--port", str(e2e.SERVE_PORT)]
    if drafter:
        args += ["--drafter", drafter]
    e2e.job_submit(job_id, *args, wait=False, timeout=300)
    t0 = time.time()
    while time.time() - t0 < 900:
        status = e2e.job_status(job_id)
        if status in ("FAILED", "STOPPED", "SUCCEEDED"):
            raise RuntimeError(f"{job_id} ended early: {status}\n{e2e.job_logs(job_id)[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{e2e.SERVE_PORT}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(3)
    raise RuntimeError(f"{job_id} never became healthy:\n{e2e.job_logs(job_id)[-3000:]}")


def _stop(job_id: str) -> None:
    e2e.sh(["ray", "job", "stop", "--address", e2e.DASHBOARD, job_id], timeout=300)
    time.sleep(5)


def ramp(url: str, prompts: list[list[dict]], levels: list[int], step_s: float, warm_s: float,
         max_tokens: int, min_ttft: int = 0) -> list[dict[str, Any]]:
    """Concurrent streams at each level for ``warm_s + step_s`` seconds, longer (up to ``3 x step_s``) until
    ``min_ttft`` requests started in the measured window (new requests stop at the end; running ones finish):
    output tok/s in the measured window (each request's tokens spread over its decode time) and TTFT."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    out = []
    lock = threading.Lock()
    for level in levels:
        done: list[dict[str, float]] = []
        errors: list[str] = []
        t0 = time.perf_counter()
        w0, earliest, latest = t0 + warm_s, t0 + warm_s + step_s, t0 + warm_s + 3 * step_s
        started = [0]  # requests started inside the window so far
        stop_at = [latest]  # fixed by the first worker that finds the window complete

        def window_open(now: float, started: list = started, stop_at: list = stop_at, w0: float = w0,
                        earliest: float = earliest) -> bool:
            with lock:
                if now >= stop_at[0]:
                    return False
                if now >= earliest and started[0] >= min_ttft:
                    stop_at[0] = now
                    return False
                if now >= w0:
                    started[0] += 1
                return True

        def worker(k: int, done: list = done, errors: list = errors, window_open=window_open) -> None:
            i = k
            while window_open(time.perf_counter()):
                start, first, usage = time.perf_counter(), None, None
                try:
                    stream = client.chat.completions.create(
                        model="eaglenest", messages=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0,
                        stream=True, stream_options={"include_usage": True})
                    for ch in stream:
                        if first is None and ch.choices and ch.choices[0].delta.content:
                            first = time.perf_counter()
                        if ch.usage is not None:
                            usage = ch.usage
                except Exception as e:  # noqa: BLE001 - counted per level; a failing stream must not end the ramp
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}"[:300])
                    time.sleep(0.5)
                    continue
                end = time.perf_counter()
                with lock:
                    done.append({"start": start, "first": first or end, "end": end,
                                 "tokens": usage.completion_tokens if usage else 0})
                i += 7  # the next prompt of this stream: streams start on different prompts and keep apart

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(level)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w1 = stop_at[0]
        tokens = 0.0
        for r in done:  # tokens decoded inside the window, each request's spread evenly over its decode time
            lo, hi = max(r["first"], w0), min(r["end"], w1)
            if hi > lo and r["end"] > r["first"]:
                tokens += r["tokens"] * (hi - lo) / (r["end"] - r["first"])
        ttfts = sorted(r["first"] - r["start"] for r in done if w0 <= r["start"] <= w1)
        out.append({"concurrency": level, "requests": len(done), "errors": len(errors),
                    "first_error": errors[0] if errors else None, "window_s": round(w1 - w0, 2),
                    "ttft_samples": len(ttfts), "tok_per_s": tokens / (w1 - w0),
                    "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                    "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None})
        print(f"ramp {url} concurrency {level}: {out[-1]}", flush=True)
    return out


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        return json.loads(r.read())


def step_ramp() -> dict[str, Any]:
    """The served load ramp, with the schedule and without a drafter, and the comparison per level."""
    if not SCHEDULE.is_file():
        return {"status": "error", "error": "no schedule: the tune step failed"}
    write_serve_configs()
    held = [json.loads(x)["messages"] for x in (e2e.PROMPTS / "heldout.jsonl").read_text().splitlines() if x.strip()]
    url = f"http://127.0.0.1:{e2e.SERVE_PORT}"
    runs: dict[str, Any] = {}
    for name, config, drafter in (("schedule", SERVE_SCHEDULE_CONFIG, str(e2e.served_export())),
                                  ("plain", SERVE_PLAIN_CONFIG, None)):
        job = f"e2e-ramp-{name}"
        try:
            _serve(job, config, drafter)
            if name == "schedule":
                runs["schedule_health"] = _health(url).get("schedule")
            runs[name] = ramp(url, held, RAMP_LEVELS, RAMP_STEP_S, RAMP_WARM_S, RAMP_MAX_TOKENS, RAMP_MIN_TTFT)
            if name == "schedule":  # serve.route: how many requests each engine took over the ramp
                runs["route"] = _health(url).get("route")
        finally:
            _stop(job)
    per_level = []
    for s, p in zip(runs["schedule"], runs["plain"], strict=True):
        tps = s["tok_per_s"] / p["tok_per_s"] if p["tok_per_s"] else None
        ttft = (s["ttft_p99_s"] / p["ttft_p99_s"]) if s["ttft_p99_s"] and p["ttft_p99_s"] else None
        per_level.append({"concurrency": s["concurrency"], "tok_per_s_vs_plain": tps, "ttft_p99_vs_plain": ttft})
    failed = [f"{name} at {x['concurrency']}: {x['errors']} failed request(s) ({x['first_error']})"
              if x["errors"] else f"{name} at {x['concurrency']}: no request finished"
              for name in ("schedule", "plain") for x in runs[name] if x["errors"] or not x["requests"]]
    checks = {"tok_per_s_never_3pct_below_plain": all((x["tok_per_s_vs_plain"] or 0) >= 0.97 for x in per_level),
              "ttft_p99_never_10pct_worse": all((x["ttft_p99_vs_plain"] or 0) <= 1.10 for x in per_level)}
    return {"status": "error" if failed else "ok", **({"error": "; ".join(failed)} if failed else {}),
            "levels": RAMP_LEVELS, "step_s": RAMP_STEP_S, "runs": runs, "per_level": per_level, "checks": checks}


def summary_lines() -> list[str]:
    """What gpu_e2e's summary prints for these steps."""
    lines = []
    t, b, r = e2e.load("tune"), e2e.load("bench_schedule"), e2e.load("ramp")
    if t.get("buckets"):
        lines.append("tuned schedule: " + "; ".join(f"{k}: {v['runs']} ({v['x_baseline']:.2f}x, SGLang "
                                                      f"{v['sglang_candidates']})" for k, v in t["buckets"].items()))
    for row in b.get("rows") or []:
        best = row["best_static"] or {}
        lines.append(f"bench --schedule batch {row['batch_size']}: baseline {row['baseline']:.1f}, best static "
                     f"{best.get('config')} {best.get('tok_per_s', 0):.1f}, schedule {row['schedule'] or 0:.1f} tok/s "
                     f"= {row['schedule_vs_baseline'] or 0:.3f}x baseline, "
                     f"{row['schedule_vs_best_static'] or 0:.3f}x best static")
    if b.get("checks"):
        lines.append(f"bench --schedule checks: {b['checks']}")
    for x in r.get("per_level") or []:
        lines.append(f"ramp concurrency {x['concurrency']}: tok/s {x['tok_per_s_vs_plain'] or 0:.3f}x the plain "
                     f"server, TTFT p99 {x['ttft_p99_vs_plain'] or 0:.3f}x")
    runs = r.get("runs") or {}
    if runs.get("schedule_health"):
        lines.append(f"served schedule mode: {runs['schedule_health'].get('mode')}"
                     + (f"; routed over the ramp: {runs['route']['routed']} (limit {runs['route']['limit']})"
                        if runs.get("route") else ""))
    if r.get("checks"):
        lines.append(f"ramp checks: {r['checks']}")
    return lines


STEPS = {"tune": step_tune, "bench_schedule": step_bench_schedule, "ramp": step_ramp}
