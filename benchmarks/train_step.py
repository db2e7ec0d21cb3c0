#!/usr/bin/env python3
"""Throughput of one EAGLE-3 TTT training step, as a fraction of a plain matmul measured in the same run.

The step is exactly what ``eaglenest train`` runs per batch: teacher logits from the frozen target ``lm_head``, the
K-step TTT forward (drafter.ttt), backward, gradient clipping and a fused AdamW update over fp32 master weights,
under bf16 autocast on GPU. Inputs are synthetic (random hidden states); throughput does not depend on the values.

    # the GPU acceptance run (Kimi-K2.5 drafter dimensions, reference/training.md §3.5)
    python benchmarks/train_step.py --device cuda --preset kimi --json train_step.json
    # the same, measuring both attention kernels and both loss-head kernels side by side in one process
    python benchmarks/train_step.py --device cuda --preset kimi --attention both --loss both --json train_step.json
    # fp8 hidden states (as fp8 shards reach the trainer) vs bf16, side by side in one process
    python benchmarks/train_step.py --device cuda --preset kimi --hidden-storage both --json train_step_fp8.json
    # the same code at small dimensions on a CPU
    python benchmarks/train_step.py --device cpu --preset small

Kernel choices (drafter.ttt): ``--attention`` manual (materialised scores) or flex (compiled FlexAttention), ``--loss``
eager or compiled soft cross-entropy; ``auto`` is what training uses (flex + compiled on CUDA, manual + eager on CPU),
``both`` measures each. Every configuration first runs one forward/backward on the same initial weights and batch
(this is also where torch.compile compiles; its time is reported as ``first_step_s``), compared with the first
configuration's loss and gradients; then ``--warmup`` untimed steps, then the timed steps. A recompilation during the
timed steps is reported (``recompiled_while_timed``). The top-level results describe the ``auto`` configuration when
it was measured (else the last one); ``runs`` holds every configuration.

Hidden-state storage (``--hidden-storage``): ``bf16`` starts each step from bf16 hidden states on the device (as
bf16 shards reach the trainer); ``fp8`` from the shard contract's fp8 payload + int8 exponents on the device (as fp8
shards reach it, ``contracts.shards.fp8_parts`` of the same random states), and the step includes the dequantisation
(``Batch.to``, the training loop's own code; phase ``dequant``); ``both`` measures each, per kernel configuration
back to back, and reports fp8's fraction of the matmul minus bf16's in points (``fp8_vs_bf16``) with the two
first-step losses on the same initial weights.

Model FLOPs counted: every matmul of the drafter over the K steps (fwd x1 + bwd x2), the attention score/value
matmuls over the causal step-0 keys plus the diagonal keys (fwd x1 + bwd x2), and the teacher head (fwd only).
The reference is a square GEMM in the same dtype (bf16 on GPU, fp32 on CPU); the "model-shaped" GEMM (tokens x
2H @ 2H x (q+k+v)) is reported too. Needs torch, pydantic (the eaglenest package imports its config) and this
repository; no Ray, no transformers. On the H200 image, which lacks pydantic, source `.gpu/bin/install.sh` first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.drafter.batch import Batch  # noqa: E402
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter  # noqa: E402
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective, resolve_attention, resolve_loss  # noqa: E402
from eaglenest.drafters.vocab import VocabMapping  # noqa: E402

PRESETS = {
    # Kimi-K2.5 drafter (SpecForge kimi-k25-eagle3 config): H 7168, 64 x 128 heads, 64 KV heads, I 18432
    "kimi": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, draft_vocab=32000,
                 vocab=163840, seq_len=2048, batch=1),
    # small enough for a laptop CPU, same structure (GQA included)
    "small": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, draft_vocab=2000, vocab=8000,
                  seq_len=128, batch=2),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, iters: int) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * m * k * n * iters / (time.perf_counter() - t) / 1e12


def step_flops(cfg: DrafterModelConfig, batch: int, t: int, k_steps: int) -> dict[str, float]:
    """Model FLOPs of one training step (see the module docstring)."""
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    tokens = batch * t
    per_tok = 2 * (2 * h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * cfg.intermediate_size + h * cfg.draft_vocab_size)
    linear = tokens * (k_steps * per_tok + 2 * 3 * cfg.target_hidden_size * h)
    # QK^T and PV: causal half of T x T per head, plus k diagonal keys per row at step k
    attn = sum(batch * nh * d * 2 * 2 * (t * (t + 1) / 2 + t * k) for k in range(k_steps))
    teacher = 2 * tokens * cfg.target_hidden_size * cfg.vocab_size
    return {"linear": 3 * linear, "attention": 3 * attn, "teacher": teacher,
            "total": 3 * linear + 3 * attn + teacher}


def build(p: dict, k_steps: int, device: torch.device, seed: int):
    torch.manual_seed(seed)
    cfg = DrafterModelConfig(
        hidden_size=p["hidden"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"], intermediate_size=p["intermediate"], vocab_size=p["vocab"],
        draft_vocab_size=p["draft_vocab"], aux_layer_ids=[2, 30, 58], target_hidden_size=p["hidden"],
        target_num_layers=61, rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=262144,
    )
    with torch.device(device):
        drafter = Eagle3Drafter(cfg)
    draft_ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    mapping = VocabMapping(draft_ids, cfg.vocab_size, torch.zeros(cfg.vocab_size, dtype=torch.long))
    drafter.set_vocab_mapping(mapping.d2t.to(device), mapping.t2d.to(device))
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=compute) * 0.02
    head[draft_ids.to(device)] *= 3.0  # most teacher argmaxes fall inside the draft vocab, as with real data
    teacher = TeacherHead(head, mapping).to(device)
    return cfg, drafter, teacher, compute


def fp8_stored(x: torch.Tensor, states: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([B, T, width]) as an fp8 shard stores it: e4m3 payload and int8 exponents, moved to ``device``."""
    from eaglenest.contracts.shards import FP8, fp8_parts, tensor_to_bytes  # pyarrow: only for fp8

    b, t, width = x.shape
    values, exps = fp8_parts(tensor_to_bytes(x.reshape(b * t, width), FP8, states), width, states)
    return values.view(b, t, width).to(device), exps.view(b, t, states).to(device)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: kimi on cuda, small on cpu")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--attention", choices=["auto", "manual", "flex", "both"], default="auto",
                    help="TTT attention kernel; both = manual and flex, each measured")
    ap.add_argument("--loss", choices=["auto", "eager", "compiled", "both"], default="auto",
                    help="loss-head kernel; both = eager and compiled, each measured")
    ap.add_argument("--hidden-storage", choices=["bf16", "fp8", "both"], default="bf16",
                    help="hidden states the step starts from: bf16, or fp8 payload + exponents dequantised in the "
                         "step; both = each, measured side by side")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6 on cuda, 3 on cpu)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) step")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    p = dict(PRESETS[args.preset or ("kimi" if device.type == "cuda" else "small")])
    p["seq_len"] = args.seq_len or p["seq_len"]
    p["batch"] = args.batch or p["batch"]
    k_steps, t, b = args.ttt_steps, p["seq_len"], p["batch"]
    steps = args.steps or (6 if device.type == "cuda" else 3)
    attentions = ["manual", "flex"] if args.attention == "both" else [resolve_attention(args.attention, device)]
    losses = ["eager", "compiled"] if args.loss == "both" else [resolve_loss(args.loss, device)]
    storages = ["bf16", "fp8"] if args.hidden_storage == "both" else [args.hidden_storage]
    configs = list(itertools.product(attentions, losses, storages))
    default_config = (resolve_attention("auto", device), resolve_loss("auto", device), storages[0])

    cfg, drafter, teacher, compute = build(p, k_steps, device, seed=0)
    objective = TTTObjective(drafter, k_steps, 0.8)
    named = [(n, q) for n, q in drafter.named_parameters() if q.requires_grad]
    params = [q for _, q in named]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), **fused)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(device)
    aux_f = torch.randn(b, t, 3 * cfg.hidden_size, generator=g)
    last_f = torch.randn(b, t, cfg.hidden_size, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    lengths = torch.full((b,), t, device=device)
    stored: dict[str, Batch] = {}  # what the training step receives, already on the device
    if "bf16" in storages:
        stored["bf16"] = Batch(ids, mask, aux_f.to(device, compute), last_f.to(device, compute), lengths)
    if "fp8" in storages:
        (aux_q, aux_e), (last_q, last_e) = fp8_stored(aux_f, 3, device), fp8_stored(last_f, 1, device)
        stored["fp8"] = Batch(ids, mask, aux_q, last_q, lengths, aux_e, last_e)
    del aux_f, last_f
    storage = storages[0]

    def one_step(timing: dict[str, float] | None, update: bool = True) -> torch.Tensor:
        marks = [time.perf_counter()]

        def mark() -> None:
            if timing is not None:
                sync(device)
                marks.append(time.perf_counter())

        x = stored[storage].to(device, compute)  # fp8: dequantised here, as in the training loop
        mark()
        with autocast:
            targets = teacher(x.last, x.loss_mask, x.lengths)
            mark()
            out = objective(x.input_ids, x.aux, targets)
            mark()
        out.loss.backward()
        mark()
        if update:
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
        mark()
        if timing is not None:
            for key, a, z in zip(timing, marks[:-1], marks[1:], strict=True):
                timing[key] += z - a
        return out.loss.detach()

    # 1. per configuration, one forward/backward on the initial weights (compiles; checks the kernels agree)
    # (kernels are compared with the first configuration of the same storage: same inputs)
    first: dict[tuple[str, str, str], dict] = {}
    ref_loss: dict[str, torch.Tensor] = {}
    ref_grads: dict[str, list[torch.Tensor]] = {}
    for attention, loss_kernel, storage in configs:
        objective.attention, objective.loss_kernel = attention, loss_kernel
        opt.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        try:
            loss0 = one_step(None, update=False)
        except NotImplementedError as e:  # e.g. FlexAttention has no backward on CPU
            first[(attention, loss_kernel, storage)] = {"skipped": str(e)}
            print(f"  {attention} attention + {loss_kernel} loss ({storage}): skipped ({e})")
            opt.zero_grad(set_to_none=True)
            continue
        sync(device)
        info: dict = {"first_step_s": time.perf_counter() - t0, "first_loss": float(loss0)}
        grads = [q.grad.detach().clone() for q in params]
        if storage not in ref_grads:
            ref_loss[storage], ref_grads[storage] = loss0, grads
        else:
            diffs = [rel_diff(a, r) for a, r in zip(grads, ref_grads[storage], strict=True)]
            worst = max(range(len(diffs)), key=diffs.__getitem__)
            info["vs_first_config"] = {"loss_rel_diff": rel_diff(loss0, ref_loss[storage]),
                                       "max_grad_rel_diff": diffs[worst], "max_grad_rel_diff_param": named[worst][0]}
            del grads
        first[(attention, loss_kernel, storage)] = info
    opt.zero_grad(set_to_none=True)
    del ref_grads
    ok_configs = [c for c in configs if "skipped" not in first[c]]
    if not ok_configs:
        print("error: no configuration could run", file=sys.stderr)
        return 1

    # 2. per configuration: warm-up, timed steps, one synchronised step for the phase breakdown
    flops = step_flops(cfg, b, t, k_steps)
    runs = []
    for attention, loss_kernel, storage in ok_configs:
        objective.attention, objective.loss_kernel = attention, loss_kernel
        for _ in range(args.warmup):
            one_step(None)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = one_step(None)
        sync(device)
        step_s = (time.perf_counter() - t0) / steps
        timing = {"dequant": 0.0, "teacher": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        one_step(timing)  # not in the throughput
        runs.append({
            "attention": attention,
            "loss_kernel": loss_kernel,
            "hidden_storage": storage,
            **first[(attention, loss_kernel, storage)],
            "step_s": step_s,
            "tokens_per_s": b * t / step_s,
            "achieved_tflops": flops["total"] / step_s / 1e12,
            "phase_s": timing,
            "loss": float(loss),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "recompiled_while_timed": counters["stats"]["unique_graphs"] != graphs,
        })

    ref_iters = 20 if device.type == "cuda" else 5
    ref_n = 8192 if device.type == "cuda" else 1024
    ref = matmul_tflops(device, compute, ref_n, ref_n, ref_n, ref_iters)
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shaped = matmul_tflops(device, compute, b * t, 2 * cfg.hidden_size, qkv_out, ref_iters)
    for run in runs:
        run["fraction_of_matmul"] = run["achieved_tflops"] / ref
    main_run = next((r for r in runs if (r["attention"], r["loss_kernel"], r["hidden_storage"]) == default_config),
                    runs[-1])
    fp8_vs_bf16 = []
    for r8 in (r for r in runs if r["hidden_storage"] == "fp8"):
        r16 = next((r for r in runs if r["hidden_storage"] == "bf16"
                    and (r["attention"], r["loss_kernel"]) == (r8["attention"], r8["loss_kernel"])), None)
        if r16 is not None:
            fp8_vs_bf16.append({
                "attention": r8["attention"], "loss_kernel": r8["loss_kernel"],
                "bf16_fraction": r16["fraction_of_matmul"], "fp8_fraction": r8["fraction_of_matmul"],
                "points": 100 * (r8["fraction_of_matmul"] - r16["fraction_of_matmul"]),
                "step_ms": {"bf16": 1e3 * r16["step_s"], "fp8": 1e3 * r8["step_s"]},
                "dequant_ms": 1e3 * r8["phase_s"]["dequant"],
                "first_loss": {"bf16": r16["first_loss"], "fp8": r8["first_loss"]},
                "first_loss_rel_diff": abs(r8["first_loss"] - r16["first_loss"]) / max(abs(r16["first_loss"]), 1e-30),
            })
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "dtype": str(compute).removeprefix("torch."),
        "dims": {**p, "ttt_steps": k_steps, "trainable_params": drafter.num_trainable_parameters()},
        "attention": main_run["attention"],
        "loss_kernel": main_run["loss_kernel"],
        "hidden_storage": main_run["hidden_storage"],
        "step_s": main_run["step_s"],
        "tokens_per_s": main_run["tokens_per_s"],
        "model_tflop_per_step": flops["total"] / 1e12,
        "flop_split": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
        "achieved_tflops": main_run["achieved_tflops"],
        "matmul_reference": {"shape": [ref_n, ref_n, ref_n], "tflops": ref},
        "matmul_model_shaped": {"shape": [b * t, 2 * cfg.hidden_size, qkv_out], "tflops": shaped},
        "fraction_of_matmul": main_run["fraction_of_matmul"],
        "phase_s": main_run["phase_s"],
        "loss": main_run["loss"],
        "peak_memory_gib": main_run["peak_memory_gib"],
        "runs": runs,
        "fp8_vs_bf16": fp8_vs_bf16,
        "skipped": {f"{a}+{lk}+{st}": first[(a, lk, st)]["skipped"] for a, lk, st in configs
                    if "skipped" in first[(a, lk, st)]},
    }
    print(f"TTT train step on {res['device']}, {res['dtype']}: H {p['hidden']}, {p['heads']}x{p['head_dim']} heads "
          f"(kv {p['kv_heads']}), I {p['intermediate']}, Vd {p['draft_vocab']}, V {p['vocab']}, B {b} x T {t}, "
          f"K {k_steps}, {res['dims']['trainable_params'] / 1e6:.1f}M trainable params, "
          f"{res['model_tflop_per_step']:.2f} TFLOP/step")
    print(f"  matmul {ref_n}^3: {ref:.2f} TFLOP/s   (model-shaped GEMM {shaped:.2f} TFLOP/s)")
    for run in runs:
        star = "*" if run is main_run else " "
        print(f" {star}{run['attention']:>6} attention + {run['loss_kernel']:>8} loss, {run['hidden_storage']} hidden: "
              f"step {run['step_s'] * 1e3:.1f} ms   {run['tokens_per_s']:.0f} tokens/s"
              f"   {run['achieved_tflops']:.2f} TFLOP/s   fraction {run['fraction_of_matmul']:.1%}"
              f"   first step {run['first_step_s']:.1f} s")
        print("      phases (one synced step): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in run["phase_s"].items())
              + (f"   peak memory {run['peak_memory_gib']:.1f} GiB" if run["peak_memory_gib"] is not None else ""))
        if "vs_first_config" in run:
            v = run["vs_first_config"]
            print(f"      vs first config on the initial weights: loss rel diff {v['loss_rel_diff']:.2e}, "
                  f"max grad rel diff {v['max_grad_rel_diff']:.2e} ({v['max_grad_rel_diff_param']})")
            tol = 5e-2 if compute == torch.bfloat16 else 1e-4
            if v["loss_rel_diff"] > tol or v["max_grad_rel_diff"] > tol:
                print(f"warning: {run['attention']}+{run['loss_kernel']} ({run['hidden_storage']}) disagrees with "
                      f"the first configuration beyond {tol:g}", file=sys.stderr)
        if run["recompiled_while_timed"]:
            print(f"warning: torch.compile recompiled during the timed steps of {run['attention']}+"
                  f"{run['loss_kernel']}; its time includes compilation", file=sys.stderr)
        if not math.isfinite(run["loss"]):
            print("warning: the loss is not finite", file=sys.stderr)
    for c in fp8_vs_bf16:
        print(f"  fp8 vs bf16 hidden states, {c['attention']} attention + {c['loss_kernel']} loss: fraction "
              f"{c['fp8_fraction']:.1%} vs {c['bf16_fraction']:.1%} = {c['points']:+.2f} points; step "
              f"{c['step_ms']['fp8']:.1f} vs {c['step_ms']['bf16']:.1f} ms (dequant {c['dequant_ms']:.2f} ms); "
              f"first-step loss {c['first_loss']['fp8']:.5f} vs {c['first_loss']['bf16']:.5f} "
              f"(rel diff {c['first_loss_rel_diff']:.1e})")
        if c["first_loss_rel_diff"] > 1e-2:
            print("warning: the fp8 and bf16 losses differ by more than 1% (fp8's rounding alone is <= 2^-4 per "
                  "value)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
