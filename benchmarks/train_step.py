#!/usr/bin/env python3
"""Throughput of one EAGLE-3 TTT training step, as a fraction of a plain matmul measured in the same run.

The step is exactly what ``eaglenest train`` runs per batch: teacher logits from the frozen target ``lm_head``, the
K-step TTT forward (drafter.ttt), backward, gradient clipping and a fused AdamW update over fp32 master weights,
under bf16 autocast on GPU. Inputs are synthetic (random hidden states); throughput does not depend on the values.

    # the GPU acceptance run: both draft shapes at Kimi-K2.5 widths, side by side, with the per-kernel breakdown
    # (~2-3 min on an H200, most of it torch.compile; peak ~40 GB, see "Memory" below)
    python benchmarks/train_step.py --device cuda --preset kimi --draft-shape both --profile --json train_step.json
    # the Llama-shaped head alone (the figure BENCHMARKS.md tracks; reference/training.md §3.5)
    python benchmarks/train_step.py --device cuda --preset kimi --json train_step.json
    # the same, measuring both attention kernels and both loss-head kernels side by side in one process
    python benchmarks/train_step.py --device cuda --preset kimi --attention both --loss both --json train_step.json
    # fp8 hidden states (as fp8 shards reach the trainer) vs bf16, side by side in one process
    python benchmarks/train_step.py --device cuda --preset kimi --hidden-storage both --json train_step_fp8.json
    # the same code at small dimensions on a CPU (both shapes, breakdown included)
    python benchmarks/train_step.py --device cpu --preset small --draft-shape both --profile

Draft shapes (``--draft-shape``): ``llama`` (q/k/v heads; SGLang's ``LlamaForCausalLMEagle3``), ``mla`` (DeepSeek
multi-head latent attention, drafters.eagle3.mla; SGLang's ``Eagle3DeepseekV2ForCausalLM``) or ``both``: each shape
is built, measured in every kernel configuration and freed before the next (peak memory is the larger shape's, not
the sum), with the same teacher and batch. The ``kimi`` preset has Kimi-K2.5's widths: H 7168, 64 heads, vocab
163840, draft vocab 32000, MLP 18432 (the target's, as ``eaglenest train`` defaults it); the Llama shape has 64 KV
heads of 128 (SpecForge's kimi-k25-eagle3 config), the MLA shape the target's own MLA widths (q_lora_rank 1536,
kv_lora_rank 512, qk_nope 128 + qk_rope 64 per query/key head, v_head 128; tests/unit/test_train_step_bench.py checks
them against what ``eaglenest train`` builds for Kimi-K2.5).

Kernel choices (drafter.ttt): ``--attention`` manual (materialised scores) or flex (compiled FlexAttention), ``--loss``
eager or compiled soft cross-entropy; ``auto`` is what training uses (flex + compiled on CUDA, manual + eager on CPU),
``both`` measures each. Every configuration first runs one forward/backward on the same initial weights and batch
(this is also where torch.compile compiles; its time is reported as ``first_step_s``), compared with the first
configuration's loss and gradients; then ``--warmup`` untimed steps, then the timed steps. A recompilation during the
timed steps is reported (``recompiled_while_timed``). A configuration that raises is reported (``failed``) and the
others still run (the exit status is then 1). The top-level results describe the first shape's ``auto``
configuration when it was measured (else its last one); ``runs`` holds every shape and configuration.

Hidden-state storage (``--hidden-storage``): ``bf16`` starts each step from bf16 hidden states on the device (as
bf16 shards reach the trainer); ``fp8`` from the shard contract's fp8 payload + int8 exponents on the device (as fp8
shards reach it, ``contracts.shards.fp8_parts`` of the same random states), and the step includes the dequantisation
(``Batch.to``, the training loop's own code; phase ``dequant``); ``both`` measures each, per kernel configuration
back to back, and reports fp8's fraction of the matmul minus bf16's in points (``fp8_vs_bf16``) with the two
first-step losses on the same initial weights.

RMSNorm (``--rmsnorm``, a candidate measured without touching the training code): ``eager`` is the drafter's own
RMSNorm (fp32 ops, ~10 passes over each [T, H] input forward and more backward); ``fused`` patches every RMSNorm's
forward, for this run only, to one ``F.rms_norm`` over the same fp32 values (torch's fused CUDA kernel, forward and
backward), rounded once to the input dtype as before; ``both`` measures each, and the first-step comparison on the
same initial weights shows how far the two agree.

Per-kernel breakdown (``--profile``, benchmarks/step_profile.py): after the timed steps, torch.profiler over
``--profile-steps`` more steps of each configuration; time per op category (matmul / attention / softmax+CE / norms
/ elementwise / optimizer / other, plus the GPU's idle time) in ms and % of the step, the top ops, the GEMMs' and the
attention's own TFLOP/s, and the step time 70% of the matmul reference would need. Printed and under ``profile``.

Model FLOPs counted (``step_flops``, read off the drafter's own ``nn.Linear`` shapes, so both shapes are counted
from the modules they run): every Linear of the decoder layer on every token of every TTT step, ``lm_head`` on the
rows each step scores (T - 1 - k at step k), fwd x1 + bwd x2; ``fc`` once per token, fwd + weight gradient (its
input, the target's states, needs no gradient); the attention score/value matmuls over the causal step-0 keys plus
the diagonal keys (query/key width for the scores, value width for the values: 192 and 128 per head in Kimi's MLA),
fwd x1 + bwd x2; and the teacher head (fwd only). tests/unit/test_train_step_bench.py checks the matmul part against
torch's FlopCounterMode on a real step. The reference is a square GEMM in the same dtype (bf16 on GPU, fp32 on CPU);
the "model-shaped" GEMM (tokens x 2H @ 2H x the attention input projections' outputs) is reported per shape.

Memory at the kimi preset (B 1 x T 2048, K 7; estimate, the run prints the measured peak): Llama shape 1.19B
trainable parameters: fp32 masters + gradients + AdamW moments 19.1 GB, frozen fp32 embedding 4.7 GB, teacher head
(bf16) 2.3 GB, autocast's bf16 weight copies 2.4 GB; tensors saved for the backward of the 7 TTT steps ~8.8 GB
(counted on the meta device with saved-tensor hooks: ~5.5 GB outside the attention with the compiled loss, plus
FlexAttention's q, packed keys/values, output and log-sum-exp, 3.4 GB); transients (the teacher's [T, 163840]
logits, bf16 gradient sums) ~3 GB: ~40 GB peak. MLA shape (0.90B trainable): ~36 GB. Both fit one H200 (141 GB)
several times over, so the preset's batch stays 1 x 2048 (the figures stay comparable with BENCHMARKS.md's);
``both`` frees the first shape before building the second. Activations grow linearly with B x T: T 8192 (the Kimi
training config's max_seq_len) adds ~27 GB.

Needs torch, pydantic (the eaglenest package imports its config) and this repository; no Ray, no transformers. On the
H200 image, which lacks pydantic, source `.gpu/bin/install.sh` first.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import CATEGORIES, format_breakdown, label, profile_step  # noqa: E402

from eaglenest.drafter.batch import Batch  # noqa: E402
from eaglenest.drafters.eagle3.config import DRAFT_SHAPES, DrafterModelConfig  # noqa: E402
from eaglenest.drafters.eagle3.model import Eagle3Drafter  # noqa: E402
from eaglenest.drafters.eagle3.norm import RMSNorm  # noqa: E402
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective, resolve_attention, resolve_loss  # noqa: E402
from eaglenest.drafters.vocab import VocabMapping  # noqa: E402

PRESETS = {
    # Kimi-K2.5 drafter (SpecForge kimi-k25-eagle3 config): H 7168, 64 x 128 heads, 64 KV heads, I 18432; the MLA
    # shape takes Kimi-K2.5's own MLA widths (text_config: q_lora_rank, kv_lora_rank, qk_nope/rope, v_head_dim)
    "kimi": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, draft_vocab=32000,
                 vocab=163840, seq_len=2048, batch=1,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    # small enough for a laptop CPU, same structure (GQA in the Llama shape, q/kv LoRA and a RoPE split in MLA)
    "small": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, draft_vocab=2000, vocab=8000,
                  seq_len=128, batch=2,
                  q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64),
}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


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


def drafter_config(p: dict, shape: str) -> DrafterModelConfig:
    """The benchmark's drafter of ``shape`` at preset ``p`` (a Kimi-K2.5-like 61-layer target, taps 2/30/58)."""
    if shape == "mla":
        heads = {"num_key_value_heads": p["heads"], "head_dim": p["qk_nope_head_dim"] + p["qk_rope_head_dim"],
                 "draft_shape": "mla", **{k: p[k] for k in MLA_KEYS}}
    else:
        heads = {"num_key_value_heads": p["kv_heads"], "head_dim": p["head_dim"]}
    return DrafterModelConfig(
        hidden_size=p["hidden"], num_attention_heads=p["heads"], intermediate_size=p["intermediate"],
        vocab_size=p["vocab"], draft_vocab_size=p["draft_vocab"], aux_layer_ids=[2, 30, 58],
        target_hidden_size=p["hidden"], target_num_layers=61, rope_theta=50000.0, rms_norm_eps=1e-6,
        max_position_embeddings=262144, **heads,
    )


def step_flops(drafter: Eagle3Drafter, teacher_weight: torch.Tensor, batch: int, t: int, k_steps: int
               ) -> dict[str, float]:
    """Model FLOPs of one training step, from the drafter's own Linear shapes (see the module docstring)."""
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn

    def macs(m: nn.Linear) -> int:
        return m.in_features * m.out_features

    tokens = batch * t
    layer_macs = sum(macs(m) for m in layer.modules() if isinstance(m, nn.Linear))  # q/k/v/o or MLA's five + MLP
    head_rows = batch * sum(max(t - 1 - k, 0) for k in range(k_steps))
    linear = 3 * 2 * (tokens * k_steps * layer_macs + head_rows * macs(drafter.lm_head))
    fc = 2 * 2 * tokens * macs(drafter.fc)
    # QK^T over the query/key width, PV over the value width: causal half of T x T per head, plus k diagonal keys
    qk = attn.head_dim
    v = attn.o_proj.in_features // attn.num_heads
    attention = 3 * sum(batch * attn.num_heads * 2 * (qk + v) * (t * (t + 1) / 2 + t * k) for k in range(k_steps))
    teacher = 2 * tokens * teacher_weight.shape[0] * teacher_weight.shape[1]
    return {"linear": linear + fc, "attention": attention, "teacher": teacher,
            "total": linear + fc + attention + teacher}


def input_projections(drafter: Eagle3Drafter) -> int:
    """Output width of the projections that read the 2H attention input (q+k+v, or MLA's q_a + kv_a)."""
    return sum(m.out_features for m in drafter.midlayer.self_attn.modules()
               if isinstance(m, nn.Linear) and m.in_features == 2 * drafter.config.hidden_size)


def build_teacher(p: dict, device: torch.device, seed: int) -> tuple[VocabMapping, TeacherHead, torch.dtype]:
    """The draft vocabulary and the frozen target head (shared by both draft shapes)."""
    vocab, draft = p["vocab"], p["draft_vocab"]
    draft_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft].sort().values
    mapping = VocabMapping(draft_ids, vocab, torch.zeros(vocab, dtype=torch.long))
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    head = torch.randn(vocab, p["hidden"], generator=g, device=device, dtype=compute) * 0.02
    head[draft_ids.to(device)] *= 3.0  # most teacher argmaxes fall inside the draft vocab, as with real data
    return mapping, TeacherHead(head, mapping).to(device), compute


def build_drafter(p: dict, shape: str, mapping: VocabMapping, device: torch.device, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = Eagle3Drafter(drafter_config(p, shape))
    drafter.set_vocab_mapping(mapping.d2t.to(device), mapping.t2d.to(device))
    return drafter


def fp8_stored(x: torch.Tensor, states: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([B, T, width]) as an fp8 shard stores it: e4m3 payload and int8 exponents, moved to ``device``."""
    from eaglenest.contracts.shards import FP8, fp8_parts, tensor_to_bytes  # pyarrow: only for fp8

    b, t, width = x.shape
    values, exps = fp8_parts(tensor_to_bytes(x.reshape(b * t, width), FP8, states), width, states)
    return values.view(b, t, width).to(device), exps.view(b, t, states).to(device)


_EAGER_RMSNORM = RMSNorm.forward


def _fused_rmsnorm(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward's function (fp32 in, one rounding to the input dtype) as one ``F.rms_norm`` call."""
    return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def use_rmsnorm(kind: str) -> None:
    """Every RMSNorm's forward from now on: ``eager`` (drafters.eagle3.norm's own) or ``fused``."""
    RMSNorm.forward = _EAGER_RMSNORM if kind == "eager" else _fused_rmsnorm


def run_name(r: dict) -> str:
    return "+".join([r["draft_shape"], r["attention"], r["loss_kernel"], r["hidden_storage"]]
                    + ([] if r["rmsnorm"] == "eager" else ["fused-rmsnorm"]))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure_shape(shape: str, p: dict, args: argparse.Namespace, device: torch.device, compute: torch.dtype,
                  mapping: VocabMapping, teacher: TeacherHead, stored: dict[str, Batch],
                  configs: list[tuple[str, str, str, str]], steps: int) -> tuple[list[dict], dict]:
    """Every kernel configuration of one draft shape: (runs, the shape's facts). The drafter and its optimizer are
    freed when this returns."""
    k_steps, t, b = args.ttt_steps, p["seq_len"], p["batch"]
    drafter = build_drafter(p, shape, mapping, device, seed=0)
    cfg = drafter.config
    objective = TTTObjective(drafter, k_steps, 0.8)
    named = [(n, q) for n, q in drafter.named_parameters() if q.requires_grad]
    params = [q for _, q in named]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), **fused)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)

    def one_step(storage: str, timing: dict[str, float] | None = None, update: bool = True,
                 labels: bool = False) -> torch.Tensor:
        marks = [time.perf_counter()]

        def mark() -> None:
            if timing is not None:
                sync(device)
                marks.append(time.perf_counter())

        x = stored[storage].to(device, compute)  # fp8: dequantised here, as in the training loop
        mark()
        with autocast:
            with label("teacher", labels):
                targets = teacher(x.last, x.loss_mask, x.lengths)
            mark()
            with label("forward", labels):
                out = objective(x.input_ids, x.aux, targets)
            mark()
        with label("backward", labels):
            out.loss.backward()
        mark()
        if update:
            with label("optimizer", labels):
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
        mark()
        if timing is not None:
            for key, a, z in zip(timing, marks[:-1], marks[1:], strict=True):
                timing[key] += z - a
        return out.loss.detach()

    def failed(where: str, e: Exception) -> str:
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        msg = f"{where}: {type(e).__name__}: {e}"
        return msg if len(msg) < 600 else msg[:600] + " ..."

    # 1. per configuration, one forward/backward on the initial weights (compiles; checks the kernels agree)
    # (kernels are compared with the first configuration of the same storage: same inputs)
    first: dict[tuple[str, str, str], dict] = {}
    ref_loss: dict[str, torch.Tensor] = {}
    ref_grads: dict[str, list[torch.Tensor]] = {}
    for attention, loss_kernel, storage, norm in configs:
        objective.attention, objective.loss_kernel = attention, loss_kernel
        use_rmsnorm(norm)
        opt.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        try:
            loss0 = one_step(storage, update=False)
            sync(device)
        except NotImplementedError as e:  # e.g. FlexAttention has no backward on CPU
            first[(attention, loss_kernel, storage, norm)] = {"skipped": str(e)}
            print(f"  {shape}: {attention} attention + {loss_kernel} loss ({storage}): skipped ({e})")
            opt.zero_grad(set_to_none=True)
            continue
        except Exception as e:  # reported; the other configurations still run
            first[(attention, loss_kernel, storage, norm)] = {"failed": failed("first step", e)}
            print(f"error: {shape} {attention}+{loss_kernel} ({storage}) failed: {e}", file=sys.stderr)
            continue
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
        first[(attention, loss_kernel, storage, norm)] = info
    opt.zero_grad(set_to_none=True)
    del ref_grads

    # 2. per configuration: warm-up, timed steps, one synchronised step for the phase breakdown, the profile
    flops = step_flops(drafter, teacher.weight, b, t, k_steps)
    runs = []
    for attention, loss_kernel, storage, norm in configs:
        head = {"draft_shape": shape, "attention": attention, "loss_kernel": loss_kernel, "hidden_storage": storage,
                "rmsnorm": norm, **first[(attention, loss_kernel, storage, norm)]}
        if "skipped" in head or "failed" in head:
            runs.append(head)
            continue
        objective.attention, objective.loss_kernel = attention, loss_kernel
        use_rmsnorm(norm)
        try:
            for _ in range(args.warmup):
                one_step(storage)
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = one_step(storage)
            sync(device)
            step_s = (time.perf_counter() - t0) / steps
            recompiled = counters["stats"]["unique_graphs"] != graphs
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            timing = {"dequant": 0.0, "teacher": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
            one_step(storage, timing)  # not in the throughput
        except Exception as e:  # reported; the other configurations still run
            runs.append({**head, "failed": failed("timed steps", e)})
            print(f"error: {shape} {attention}+{loss_kernel} ({storage}) failed: {e}", file=sys.stderr)
            continue
        prof = profile_error = None
        if args.profile:
            try:
                prof = profile_step(lambda s=storage: one_step(s, labels=True), drafter, device, args.profile_steps)
            except Exception as e:  # the timing stands; the breakdown is reported missing
                profile_error = failed("profile", e)
                print(f"error: the profile of {shape} {attention}+{loss_kernel} failed: {e}", file=sys.stderr)
        run = {
            **head,
            "step_s": step_s,
            "tokens_per_s": b * t / step_s,
            "model_tflop_per_step": flops["total"] / 1e12,
            "achieved_tflops": flops["total"] / step_s / 1e12,
            "phase_s": timing,
            "loss": float(loss),
            "peak_memory_gib": peak,
            "recompiled_while_timed": recompiled,
        }
        if profile_error is not None:
            run["profile_error"] = profile_error
        if prof is not None:
            cats = prof["categories"]
            for key, cat, part in (("matmul_tflops", "matmul", flops["linear"] + flops["teacher"]),
                                   ("attention_tflops", "attention", flops["attention"])):
                prof[key] = part / (cats[cat]["ms"] / 1e3) / 1e12 if cats[cat]["ms"] > 0 else None
            run["profile"] = prof
        runs.append(run)

    facts = {
        "config": {k: v for k, v in cfg.to_dict().items() if v is not None and k not in ("extra", "target")},
        "trainable_params": drafter.num_trainable_parameters(),
        "model_tflop_per_step": flops["total"] / 1e12,
        "flop_split": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
        "model_shaped_gemm": [b * t, 2 * cfg.hidden_size, input_projections(drafter)],
    }
    return runs, facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: kimi on cuda, small on cpu")
    ap.add_argument("--draft-shape", choices=[*DRAFT_SHAPES, "both"], default="llama",
                    help="llama (LlamaForCausalLMEagle3), mla (Eagle3DeepseekV2ForCausalLM) or both, side by side")
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
    ap.add_argument("--rmsnorm", choices=["eager", "fused", "both"], default="eager",
                    help="the drafter's RMSNorm: eager (the training code's) or fused (F.rms_norm on the same fp32 "
                         "values: a candidate, patched in for this run only); both = each, measured side by side")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6 on cuda, 3 on cpu)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) step")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel breakdown of each configuration (torch.profiler, benchmarks/step_profile.py)")
    ap.add_argument("--profile-steps", type=int, default=2, help="profiled steps (after one profiler warm-up step)")
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
    shapes = list(DRAFT_SHAPES) if args.draft_shape == "both" else [args.draft_shape]
    attentions = ["manual", "flex"] if args.attention == "both" else [resolve_attention(args.attention, device)]
    losses = ["eager", "compiled"] if args.loss == "both" else [resolve_loss(args.loss, device)]
    storages = ["bf16", "fp8"] if args.hidden_storage == "both" else [args.hidden_storage]
    norms = ["eager", "fused"] if args.rmsnorm == "both" else [args.rmsnorm]
    configs = list(itertools.product(attentions, losses, storages, norms))
    default_config = (resolve_attention("auto", device), resolve_loss("auto", device), storages[0], norms[0])

    mapping, teacher, compute = build_teacher(p, device, seed=0)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, p["vocab"], (b, t), generator=g).to(device)
    aux_f = torch.randn(b, t, 3 * p["hidden"], generator=g)
    last_f = torch.randn(b, t, p["hidden"], generator=g)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    lengths = torch.full((b,), t, device=device)
    stored: dict[str, Batch] = {}  # what the training step receives, already on the device
    if "bf16" in storages:
        stored["bf16"] = Batch(ids, mask, aux_f.to(device, compute), last_f.to(device, compute), lengths)
    if "fp8" in storages:
        (aux_q, aux_e), (last_q, last_e) = fp8_stored(aux_f, 3, device), fp8_stored(last_f, 1, device)
        stored["fp8"] = Batch(ids, mask, aux_q, last_q, lengths, aux_e, last_e)
    del aux_f, last_f

    runs: list[dict] = []
    facts: dict[str, dict] = {}
    try:
        for shape in shapes:
            shape_runs, facts[shape] = measure_shape(shape, p, args, device, compute, mapping, teacher, stored,
                                                     configs, steps)
            runs += shape_runs
            gc.collect()  # the shape's drafter, gradients and optimizer state go before the next shape is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        use_rmsnorm("eager")
    ok = [r for r in runs if "step_s" in r]
    if not ok:
        print("error: no configuration could run", file=sys.stderr)
        return 1

    ref_iters = 20 if device.type == "cuda" else 5
    ref_n = 8192 if device.type == "cuda" else 1024
    ref = matmul_tflops(device, compute, ref_n, ref_n, ref_n, ref_iters)
    for f in facts.values():
        f["model_shaped_gemm_tflops"] = matmul_tflops(device, compute, *f["model_shaped_gemm"], ref_iters)
    for run in ok:
        run["fraction_of_matmul"] = run["achieved_tflops"] / ref
        prof = run.get("profile")
        if prof is not None:
            prof["matmul_fraction_of_reference"] = prof["matmul_tflops"] / ref if prof["matmul_tflops"] else None
            prof["step_ms_for_70pct"] = 1e3 * run["model_tflop_per_step"] / (0.7 * ref)
    main_run = next((r for r in ok if r["draft_shape"] == shapes[0]
                     and (r["attention"], r["loss_kernel"], r["hidden_storage"], r["rmsnorm"]) == default_config),
                    [r for r in ok if r["draft_shape"] == ok[0]["draft_shape"]][-1])
    main_facts = facts[main_run["draft_shape"]]
    fp8_vs_bf16 = []
    for r8 in (r for r in ok if r["hidden_storage"] == "fp8"):
        r16 = next((r for r in ok if r["hidden_storage"] == "bf16" and (r["draft_shape"], r["attention"],
                    r["loss_kernel"], r["rmsnorm"]) == (r8["draft_shape"], r8["attention"], r8["loss_kernel"],
                                                        r8["rmsnorm"])), None)
        if r16 is not None:
            fp8_vs_bf16.append({
                "draft_shape": r8["draft_shape"], "attention": r8["attention"], "loss_kernel": r8["loss_kernel"],
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
        "draft_shapes": shapes,
        "draft_shape": main_run["draft_shape"],
        "dims": {**p, "ttt_steps": k_steps, "trainable_params": main_facts["trainable_params"]},
        "attention": main_run["attention"],
        "loss_kernel": main_run["loss_kernel"],
        "hidden_storage": main_run["hidden_storage"],
        "rmsnorm": main_run["rmsnorm"],
        "step_s": main_run["step_s"],
        "tokens_per_s": main_run["tokens_per_s"],
        "model_tflop_per_step": main_facts["model_tflop_per_step"],
        "flop_split": main_facts["flop_split"],
        "achieved_tflops": main_run["achieved_tflops"],
        "matmul_reference": {"shape": [ref_n, ref_n, ref_n], "tflops": ref},
        "matmul_model_shaped": {"shape": main_facts["model_shaped_gemm"],
                                "tflops": main_facts["model_shaped_gemm_tflops"]},
        "fraction_of_matmul": main_run["fraction_of_matmul"],
        "phase_s": main_run["phase_s"],
        "loss": main_run["loss"],
        "peak_memory_gib": main_run["peak_memory_gib"],
        "profile": main_run.get("profile"),
        "shapes": facts,
        "runs": runs,
        "fp8_vs_bf16": fp8_vs_bf16,
        "skipped": {run_name(r): r["skipped"] for r in runs if "skipped" in r},
        "failed": {run_name(r): r["failed"] for r in runs if "failed" in r},
    }
    print(f"TTT train step on {res['device']}, {res['dtype']}: H {p['hidden']}, {p['heads']} heads, "
          f"I {p['intermediate']}, Vd {p['draft_vocab']}, V {p['vocab']}, B {b} x T {t}, K {k_steps}")
    print(f"  matmul {ref_n}^3: {ref:.2f} TFLOP/s")
    for shape, f in facts.items():
        c = f["config"]
        attn = (f"MLA q_lora {c['q_lora_rank']}, kv_lora {c['kv_lora_rank']}, qk {c['qk_nope_head_dim']}+"
                f"{c['qk_rope_head_dim']}, v {c['v_head_dim']}" if shape == "mla" else
                f"{c['num_attention_heads']}x{c['head_dim']} heads (kv {c['num_key_value_heads']})")
        print(f"  {shape}: {attn}; {f['trainable_params'] / 1e6:.1f}M trainable params, "
              f"{f['model_tflop_per_step']:.2f} TFLOP/step; model-shaped GEMM {f['model_shaped_gemm']}: "
              f"{f['model_shaped_gemm_tflops']:.2f} TFLOP/s")
    for run in runs:
        star = "*" if run is main_run else " "
        name = f"{run['draft_shape']:>5}: {run['attention']:>6} attention + {run['loss_kernel']:>8} loss, " \
               f"{run['hidden_storage']} hidden" + (f", {run['rmsnorm']} RMSNorm" if len(norms) > 1 else "")
        if "step_s" not in run:
            print(f"  {name}: {'skipped' if 'skipped' in run else 'FAILED'} "
                  f"({run.get('skipped') or run.get('failed')})")
            continue
        print(f" {star}{name}: step {run['step_s'] * 1e3:.1f} ms   {run['tokens_per_s']:.0f} tokens/s"
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
                print(f"warning: {run_name(run)} disagrees with the first configuration beyond {tol:g}",
                      file=sys.stderr)
        prof = run.get("profile")
        if prof is not None:
            for line in format_breakdown(prof):
                print(line)
            mm, at = prof["matmul_tflops"], prof["attention_tflops"]
            print(f"        GEMMs alone {mm or 0:.3g} TFLOP/s ({(prof['matmul_fraction_of_reference'] or 0):.1%} of "
                  f"the reference), attention {at or 0:.3g} TFLOP/s; 70% of the reference needs a step of "
                  f"{prof['step_ms_for_70pct']:.1f} ms (now {run['step_s'] * 1e3:.1f} ms)")
        if run["recompiled_while_timed"]:
            print(f"warning: torch.compile recompiled during the timed steps of {run_name(run)}; its time includes "
                  "compilation", file=sys.stderr)
        if not math.isfinite(run["loss"]):
            print("warning: the loss is not finite", file=sys.stderr)
    for c in fp8_vs_bf16:
        print(f"  fp8 vs bf16 hidden states, {c['draft_shape']} {c['attention']} attention + {c['loss_kernel']} "
              f"loss: fraction {c['fp8_fraction']:.1%} vs {c['bf16_fraction']:.1%} = {c['points']:+.2f} points; step "
              f"{c['step_ms']['fp8']:.1f} vs {c['step_ms']['bf16']:.1f} ms (dequant {c['dequant_ms']:.2f} ms); "
              f"first-step loss {c['first_loss']['fp8']:.5f} vs {c['first_loss']['bf16']:.5f} "
              f"(rel diff {c['first_loss_rel_diff']:.1e})")
        if c["first_loss_rel_diff"] > 1e-2:
            print("warning: the fp8 and bf16 losses differ by more than 1% (fp8's rounding alone is <= 2^-4 per "
                  "value)", file=sys.stderr)
    print(summary_table(ok, ref))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["failed"] or any("profile_error" in r for r in runs) else 0


def summary_table(runs: list[dict], ref: float) -> str:
    """One line per measured run: the shapes side by side (and, with --profile, each one's op categories)."""
    profiled = all("profile" in r for r in runs)
    kernels = [r["attention"] + " + " + r["loss_kernel"] + ("" if r["rmsnorm"] == "eager" else " + fused norm")
               for r in runs]
    w = max(20, *(len(k) + 2 for k in kernels))
    head = (f"  {'shape':<6}{'attention + loss':<{w}}{'hidden':<8}{'step ms':>9}{'tokens/s':>10}{'TFLOP/step':>12}"
            f"{'TFLOP/s':>9}{'fraction':>10}")
    if profiled:
        head += "".join(f"{c[:7]:>9}" for c in (*CATEGORIES, "idle")) + "  (% of step)"
    lines = [f"summary (fraction of the {ref:.4g} TFLOP/s matmul reference):", head]
    for r, k in zip(runs, kernels, strict=True):
        line = (f"  {r['draft_shape']:<6}{k:<{w}}{r['hidden_storage']:<8}"
                f"{r['step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>10.0f}{r['model_tflop_per_step']:>12.3f}"
                f"{r['achieved_tflops']:>9.2f}{r['fraction_of_matmul']:>10.1%}")
        if profiled:
            cats = r["profile"]["categories"]
            line += "".join(f"{cats[c]['pct']:>9.1f}" for c in CATEGORIES) + f"{r['profile']['idle_pct']:>9.1f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
