"""Per-kernel breakdown of a training step (``benchmarks/train_step.py --profile``): torch.profiler over a few steps,
time grouped by op category, in ms per step and as a share of the step's wall time.

Categories (:data:`CATEGORIES`): ``matmul`` (the projection, MLP, ``lm_head``, ``fc`` and teacher GEMMs, forward and
backward), ``attention`` (everything inside the TTT attention call: SDPA / FlexAttention kernels, or the manual
path's score and value matmuls and its masked softmax), ``softmax+CE`` (the soft cross-entropy head and the teacher's
softmax / argmax over its logits), ``norms`` (the RMSNorms), ``elementwise`` (every other tensor op: RoPE, SiLU,
residuals, casts, concatenations, the gradient sums of weights used by every TTT step), ``optimizer`` (gradient
clipping + AdamW) and ``other`` (host-side time on the CPU; copies and unattributed kernels on a GPU).

How an op is attributed. The step labels its phases (``eaglenest:teacher``, ``…:forward``, ``…:backward``,
``…:optimizer``) and, while profiling, :func:`regions` labels the drafter's RMSNorm modules (forward hooks), the TTT
attention call and the loss-head call (wrapped where ``drafters.eagle3.ttt`` looks them up) with ``record_function``
ranges; nothing in the training code changes. A forward op takes the innermost label around it; a backward op takes
the labels of the forward op that created its autograd node (matched by the autograd sequence number the profiler
records on both), so the backward of an RMSNorm counts as ``norms`` and that of the attention as ``attention``.
Ops outside any region are classified by name (``aten::mm`` … → matmul, ``*softmax*`` → softmax+CE, …).

Also reported: each category's backward part (``backward_ms``) and, inside ``elementwise``, the time autograd spends
summing the gradients of a weight over the TTT steps that each used it (``weight_grad_sums_ms``: the ``add`` ops of
the weights' ``TBackward0`` nodes; K - 1 weight-sized bf16 sums per weight and step under autocast, whose one cached
bf16 copy of each weight all K steps read).

Times: on CUDA the device time of the kernels each op launched (GPU user-annotation spans dropped, so nothing is
counted twice, nor the runtime's "Command Buffer Full" stall markers); ``idle`` is the step's wall time not covered by
kernels (the GPU waiting on the host). On the CPU each op's self CPU time; ``idle`` is then time outside any recorded
op (Python between ops).
"""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

CATEGORIES = ("matmul", "attention", "softmax+CE", "norms", "elementwise", "optimizer", "other")
LABEL = "eaglenest:"
PHASES = ("teacher", "forward", "backward", "optimizer")
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
                        "aten::linear", "aten::einsum", "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::dot"})
MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma")
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# CUDA activity records that are not kernels: "Command Buffer Full" is the host blocking on a full launch queue (it
# spans the wait, hundreds of ms under a fused optimizer, and counting it made "optimizer" > 100% of the step)
NOT_KERNELS = frozenset({"Command Buffer Full"})


def label(name: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    """A ``record_function`` range ``eaglenest:<name>`` (a no-op context when not ``enabled``)."""
    return record_function(LABEL + name) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def regions(drafter: nn.Module) -> Iterator[None]:
    """Label the drafter's RMSNorms, the TTT attention and the loss head while the context is open."""
    from eaglenest.drafters.eagle3 import ttt
    from eaglenest.drafters.eagle3.norm import RMSNorm

    handles, open_ranges = [], []

    def enter(_module, _args) -> None:
        rf = record_function(LABEL + "norm")
        rf.__enter__()
        open_ranges.append(rf)

    def leave(_module, _args, _out) -> None:
        open_ranges.pop().__exit__(None, None, None)

    for mod in drafter.modules():
        if isinstance(mod, RMSNorm):
            handles += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    attention, loss_fn = ttt.ttt_attention, ttt.soft_cross_entropy_fn

    def labelled_attention(*args, **kwargs):
        with record_function(LABEL + "attention"):
            return attention(*args, **kwargs)

    def labelled_loss_fn(impl, device):
        fn = loss_fn(impl, device)

        def labelled(logits, probs):
            with record_function(LABEL + "loss"):
                return fn(logits, probs)

        return labelled

    ttt.ttt_attention, ttt.soft_cross_entropy_fn = labelled_attention, labelled_loss_fn
    try:
        yield
    finally:
        ttt.ttt_attention, ttt.soft_cross_entropy_fn = attention, loss_fn
        for h in handles:
            h.remove()


def category(name: str, region: str | None, phase: str | None) -> str:
    """The category of an op named ``name`` inside label ``region`` (norm / attention / loss) of step ``phase``."""
    if name.startswith((LABEL, "ProfilerStep")):  # a range's own time: the host between ops (CPU only)
        return "other"
    if phase == "optimizer":
        return "optimizer"
    if region == "attention":
        return "attention"
    if region == "norm":
        return "norms"
    if region == "loss":
        return "softmax+CE"
    low = name.lower()
    if name in MATMUL_OPS or any(k in low for k in MATMUL_KERNELS):
        return "matmul"
    if any(k in low for k in ("softmax", "cross_entropy", "nll_loss", "logsumexp")):
        return "softmax+CE"
    if any(k in low for k in ("attention", "flash", "fmha")):
        return "attention"
    if phase == "teacher":  # the teacher's argmax, draft-vocab gather and masks: the loss targets
        return "softmax+CE"
    if name.startswith("aten::") or low.startswith("triton_"):
        return "elementwise"
    return "other"


def _labels(evt) -> tuple[str | None, str | None, str | None, int]:
    """(innermost region label, outermost phase label, backward node name, its sequence number) above ``evt``."""
    region = phase = node = None
    seq = -1
    e = evt
    while e is not None:
        name = e.name
        if name.startswith(LABEL):
            tag = name[len(LABEL):]
            if tag in PHASES:
                phase = tag
            elif region is None:
                region = tag
        elif node is None and name.startswith(BACKWARD_NODE):
            node, seq = name[len(BACKWARD_NODE):], e.sequence_nr
        e = e.cpu_parent
    return region, phase, node, seq


def breakdown(events, steps: int, step_s: float, cuda: bool) -> dict:
    """Group the profiled ``events`` (``prof.events()`` over ``steps`` steps of ``step_s`` seconds each)."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    # GPU user-annotation spans (one per record_function range) reach the CPU ranges' kernel lists too: drop them
    annotations = collections.Counter((e.name, round(e.time_range.elapsed_us(), 3)) for e in events
                                      if e.device_type != DeviceType.CPU and e.is_user_annotation)
    info = {id(e): _labels(e) for e in cpu}
    # forward labels by autograd sequence number (the node an op created carries the same number)
    fwd_by_seq: dict[int, tuple[str | None, str | None]] = {}
    for e in cpu:
        region, phase, node, _ = info[id(e)]
        if node is None and e.sequence_nr >= 0 and phase == "forward":
            prev = fwd_by_seq.get(e.sequence_nr)
            if prev is None or (prev[0] is None and region is not None):
                fwd_by_seq[e.sequence_nr] = (region, phase)
    per_cat: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    per_cat_bwd: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    weight_sums = 0.0
    ops: dict[tuple[str, str, str], list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for e in cpu:
        region, phase, node, seq = info[id(e)]
        if node is not None and region is None:
            region = fwd_by_seq.get(seq, (None, None))[0]
        if cuda:
            us = 0.0
            for k in () if e.name.startswith((LABEL, "ProfilerStep")) else e.kernels:  # ranges launch nothing
                key = (k.name, round(k.duration, 3))
                if k.name in NOT_KERNELS:
                    continue
                if annotations[key] > 0:
                    annotations[key] -= 1
                    continue
                us += k.duration
                slot = kernels.setdefault(k.name, [0.0, 0])
                slot[0] += k.duration
                slot[1] += 1
        else:
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        cat = category(e.name, region, phase)
        per_cat[cat] += us
        if node is not None:
            per_cat_bwd[cat] += us
            if node == "TBackward0" and e.name in ("aten::add", "aten::add_"):
                weight_sums += us
        slot = ops.setdefault((cat, e.name, f"bwd {node}" if node else (phase or "-")), [0.0, 0])
        slot[0] += us
        slot[1] += 1
    step_ms = 1e3 * step_s
    scale = 1e-3 / steps  # us over all steps -> ms per step
    accounted = sum(per_cat.values()) * scale
    out = {
        "steps": steps,
        "timer": "CUDA kernel time" if cuda else "CPU op self time",
        "step_ms": step_ms,
        "categories": {c: {"ms": v * scale, "pct": 100 * v * scale / step_ms} for c, v in per_cat.items()},
        "backward_ms": {c: v * scale for c, v in per_cat_bwd.items()},
        "weight_grad_sums_ms": weight_sums * scale,
        "accounted_ms": accounted,
        "idle_ms": step_ms - accounted,
        "idle_pct": 100 * (step_ms - accounted) / step_ms,
        "top_ops": [{"category": c, "name": n, "where": w, "ms": v[0] * scale, "calls": v[1] / steps}
                    for (c, n, w), v in sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]],
    }
    if cuda:
        out["top_kernels"] = [{"name": n, "ms": v[0] * scale, "calls": v[1] / steps}
                              for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]]
    return out


def profile_step(step: Callable[[], object], drafter: nn.Module, device: torch.device, steps: int = 2) -> dict:
    """Run ``step`` once untimed (the profiler's warm-up) then ``steps`` times under torch.profiler; the breakdown."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    walls, traces = [], []
    with warnings.catch_warnings(), regions(drafter), \
            profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps),
                    on_trace_ready=lambda p: traces.append(p.events())) as prof:
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        for i in range(steps + 1):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i:
                walls.append(time.perf_counter() - t0)
            prof.step()
    return breakdown(traces[-1], steps, sum(walls) / len(walls), cuda)


def format_breakdown(res: dict) -> list[str]:
    """The printed lines of one breakdown."""
    cats = res["categories"]
    lines = [f"      per-kernel breakdown ({res['timer']}, {res['steps']} profiled steps of {res['step_ms']:.1f} ms):"]
    lines.append("        " + "   ".join(f"{c} {cats[c]['ms']:.1f} ms ({cats[c]['pct']:.1f}%)" for c in CATEGORIES))
    lines.append(f"        idle / not in any op {res['idle_ms']:.1f} ms ({res['idle_pct']:.1f}%); of the backward: "
                 + ", ".join(f"{c} {v:.1f}" for c, v in res["backward_ms"].items() if v > 0)
                 + f" ms; summing weights' per-TTT-step gradients (elementwise) {res['weight_grad_sums_ms']:.1f} ms")
    lines.append("        top ops: " + "; ".join(f"{o['name']} [{o['category']}, {o['where']}] {o['ms']:.2f} ms"
                                                for o in res["top_ops"][:6]))
    return lines
