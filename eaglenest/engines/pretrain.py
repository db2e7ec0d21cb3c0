"""The one next-token pre-training loop of the stand-in targets (Llama and DeepseekV3) and the speedup benchmark.

Random windows of one token stream, AdamW, linear warm-up then cosine down to 10%, gradient clipping at 1.0, bf16
autocast on CUDA, a fixed number of steps from a seed. Under ``max_seconds`` the cosine ends where the time does: the
loop measures its pace (every ``PACE_EVERY`` steps after the first ``PACE_SKIP``, which compile and allocate) and
fits the schedule to the steps that will fit, so the weights always come out of an annealed run. Cutting a planned
400-step cosine at the time limit instead stopped the GPU stand-ins near step 246 with the LR still at 48% of its
peak: weights mid-descent, whose quality varied between runs of one recipe (last losses 4.93 and 5.18; drafters
trained on them simulated 3.13 and 3.00). The report gives the steps the schedule was fitted to. The embedded tiny
target keeps its own loop (``engines.tiny._pretrain``): it trains in float64 through a plain-ops forward and snaps
weights to a grid every step so that its build is bit-identical on every CPU, which none of the models trained here
needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eaglenest.lr_schedule import warmup_cosine

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
    schedule_steps: int | None = None
    """where the cosine reaches its floor (default ``train_steps``; ``max_seconds`` fits it to the time): a larger
    value stops the run mid-descent, which ``benchmarks/pretrain_schedule.py`` measures against an annealed run"""


def lm_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's own next-token cross entropy (transformers shifts the labels)."""
    return model(input_ids=batch, labels=batch).loss


def steps_that_fit(plan: PretrainPlan, done: int, elapsed_s: float, paced_steps: int, paced_s: float) -> int:
    """The steps the run will have made when ``plan.max_seconds`` is up, at the pace of ``paced_steps`` steps in
    ``paced_s`` seconds (at most ``plan.train_steps``; never fewer than ``done``)."""
    if plan.max_seconds is None or paced_steps <= 0 or paced_s <= 0:
        return plan.train_steps
    more = int((plan.max_seconds - elapsed_s) / (paced_s / paced_steps))
    return max(done, min(plan.train_steps, done + more))


PACE_SKIP = 3
"""steps left out of the pace (the first ones compile kernels and allocate)"""
PACE_EVERY = 10
"""steps between two fits of the schedule to the time left"""


def pretrain_lm(model: Any, stream: torch.Tensor, plan: PretrainPlan, device: str | torch.device, *,
                loss_fn: LossFn = lm_loss, log: Callable[[str], None] = print, name: str = "pretrain"
                ) -> dict[str, Any]:
    """Train ``model`` in place on random ``plan.seq_len`` windows of ``stream`` (1-D token ids); returns a report."""
    g = torch.Generator().manual_seed(plan.seed)
    cuda = str(device).startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=plan.learning_rate, betas=plan.betas,
                            weight_decay=plan.weight_decay, fused=cuda)
    horizon = plan.schedule_steps or plan.train_steps  # the cosine's floor; fitted to max_seconds as the pace goes
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(horizon, plan.warmup_steps, 0.1)(s))
    n = stream.numel() - plan.seq_len - 1
    if n <= 0:
        raise ValueError(f"the corpus ({stream.numel()} tokens) is shorter than one window of {plan.seq_len}")
    offsets = torch.arange(plan.seq_len, dtype=torch.long)
    model.train()
    losses: list[float] = []
    window = torch.zeros((), device=device)  # the losses since the last log, summed where they are (no sync per step)
    window_n = done = 0
    t0 = time.perf_counter()
    pace_t0 = t0
    for step in range(plan.train_steps):
        if step >= horizon:
            break
        starts = torch.randint(0, n, (plan.batch_size,), generator=g)
        batch = stream[starts[:, None] + offsets].long().to(device, non_blocking=True)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window += loss.detach().float()
        window_n += 1
        done = step + 1
        if plan.max_seconds is not None and (done == PACE_SKIP or (done > PACE_SKIP and done % PACE_EVERY == 0)):
            if cuda:
                torch.cuda.synchronize()  # the host runs ahead of the GPU; the pace is the GPU's
            now = time.perf_counter()
            if done == PACE_SKIP:
                pace_t0 = now
            else:
                horizon = steps_that_fit(plan, done, now - t0, done - PACE_SKIP, now - pace_t0)
        over_time = (plan.max_seconds is not None and done < horizon
                     and time.perf_counter() - t0 > plan.max_seconds)  # the fit was off: the safety net
        if step % plan.log_every == 0 or done in (plan.train_steps, horizon) or over_time:
            losses.append(round(window.item() / window_n, 4))
            window.zero_()
            window_n = 0
            el = time.perf_counter() - t0
            log(f"{name} step {done}/{horizon}: loss {losses[-1]:.3f}, "
                f"{done * plan.batch_size * plan.seq_len / max(el, 1e-9):,.0f} tok/s")
        if over_time:
            log(f"{name}: stopped after {done} of {horizon} steps (max_seconds {plan.max_seconds}); "
                "these weights depend on the machine's speed")
            break
    if cuda:
        torch.cuda.synchronize()
    model.eval()
    secs = time.perf_counter() - t0
    tokens = done * plan.batch_size * plan.seq_len
    return {"steps": done, "planned_steps": plan.train_steps, "schedule_steps": horizon,
            "stopped_early": done < plan.train_steps,
            "tokens": tokens, "epochs": round(tokens / stream.numel(), 2),
            "seconds": round(secs, 1), "tokens_per_s": round(tokens / max(secs, 1e-9)),
            "lr_at_end": round(sched.get_last_lr()[0] / plan.learning_rate, 4),  # of the peak; the floor is 0.1
            "loss_curve": losses, "final_loss": losses[-1] if losses else None}  # mean losses between two logs
