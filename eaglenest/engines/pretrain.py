"""The one next-token pre-training loop of the stand-in targets (Llama and DeepseekV3) and the speedup benchmark.

Random windows of one token stream, AdamW, linear warm-up then cosine down to 10%, gradient clipping at 1.0, bf16
autocast on CUDA, a fixed number of steps from a seed (``max_seconds`` is a time budget's safety net; the report says
when it cut the run short). The embedded tiny target keeps its own loop (``engines.tiny._pretrain``): it trains in
float64 through a plain-ops forward and snaps weights to a grid every step so that its build is bit-identical on
every CPU, which none of the models trained here needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""(model, batch of token ids) -> scalar loss; the default is the model's own next-token loss"""


@dataclass(frozen=True)
class PretrainPlan:
    """What decides a pre-training run (with the model's initial weights and the token stream)."""

    train_steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    seed: int = 0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_seconds: float | None = None
    log_every: int = 50


def lm_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's own next-token cross entropy (transformers shifts the labels)."""
    return model(input_ids=batch, labels=batch).loss


def warmup_cosine(step: int, plan: PretrainPlan) -> float:
    """The learning-rate multiplier at ``step``: linear warm-up, then cosine down to 10%."""
    if step < plan.warmup_steps:
        return (step + 1) / plan.warmup_steps
    frac = (step - plan.warmup_steps) / max(1, plan.train_steps - plan.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def pretrain_lm(model: Any, stream: torch.Tensor, plan: PretrainPlan, device: str | torch.device, *,
                loss_fn: LossFn = lm_loss, log: Callable[[str], None] = print, name: str = "pretrain"
                ) -> dict[str, Any]:
    """Train ``model`` in place on random ``plan.seq_len`` windows of ``stream`` (1-D token ids); returns a report."""
    g = torch.Generator().manual_seed(plan.seed)
    cuda = str(device).startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=plan.learning_rate, betas=plan.betas,
                            weight_decay=plan.weight_decay, fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, plan))
    n = stream.numel() - plan.seq_len - 1
    if n <= 0:
        raise ValueError(f"the corpus ({stream.numel()} tokens) is shorter than one window of {plan.seq_len}")
    offsets = torch.arange(plan.seq_len, dtype=torch.long)
    model.train()
    losses: list[float] = []
    done = 0
    t0 = time.perf_counter()
    for step in range(plan.train_steps):
        starts = torch.randint(0, n, (plan.batch_size,), generator=g)
        batch = stream[starts[:, None] + offsets].long().to(device, non_blocking=True)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        over_time = plan.max_seconds is not None and time.perf_counter() - t0 > plan.max_seconds
        if step % plan.log_every == 0 or step == plan.train_steps - 1 or over_time:
            losses.append(round(loss.detach().item(), 4))
            el = time.perf_counter() - t0
            log(f"{name} step {step + 1}/{plan.train_steps}: loss {losses[-1]:.3f}, "
                f"{(step + 1) * plan.batch_size * plan.seq_len / max(el, 1e-9):,.0f} tok/s")
        if over_time:
            log(f"{name}: stopped after {step + 1} of {plan.train_steps} steps (max_seconds {plan.max_seconds}); "
                "these weights depend on the machine's speed")
            break
    if cuda:
        torch.cuda.synchronize()
    model.eval()
    secs = time.perf_counter() - t0
    tokens = done * plan.batch_size * plan.seq_len
    return {"steps": done, "planned_steps": plan.train_steps, "stopped_early": done < plan.train_steps,
            "tokens": tokens, "epochs": round(tokens / stream.numel(), 2),
            "seconds": round(secs, 1), "tokens_per_s": round(tokens / max(secs, 1e-9)), "loss_curve": losses,
            "final_loss": losses[-1] if losses else None}
