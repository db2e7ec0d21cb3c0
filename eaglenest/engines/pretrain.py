"""The one next-token pre-training loop of the stand-in targets (Llama and DeepseekV3) and the speedup benchmark.

Random windows of one token stream, AdamW, linear warm-up then cosine down to 10% (``eaglenest.lr_schedule``),
gradient clipping at 1.0, bf16 autocast on CUDA, a fixed number of steps from a seed. ``max_seconds`` stops the run
where a time budget ends, mid-descent when the plan's cosine is longer than what fits; fitting the cosine to the
steps that fit instead (annealing to the floor by the last step) was measured worse for these under-trained
models: +0.11 held-out loss at equal steps on all three seeds (``benchmarks/pretrain_schedule.py``, BENCHMARKS.md).
The report gives the LR the run ended at. The embedded tiny target keeps its own loop (``engines.tiny._pretrain``):
it trains in float64 through a plain-ops forward and snaps weights to a grid every step so that its build is
bit-identical on every CPU, which none of the models trained here needs.
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
    """where the cosine reaches its floor (default ``train_steps``): a larger value stops the run mid-descent, as a
    ``max_seconds`` cut does (``benchmarks/pretrain_schedule.py`` compares the two)"""


def lm_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's own next-token cross entropy (transformers shifts the labels)."""
    return model(input_ids=batch, labels=batch).loss


def pretrain_lm(model: Any, stream: torch.Tensor, plan: PretrainPlan, device: str | torch.device, *,
                loss_fn: LossFn = lm_loss, log: Callable[[str], None] = print, name: str = "pretrain"
                ) -> dict[str, Any]:
    """Train ``model`` in place on random ``plan.seq_len`` windows of ``stream`` (1-D token ids); returns a report."""
    g = torch.Generator().manual_seed(plan.seed)
    cuda = str(device).startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=plan.learning_rate, betas=plan.betas,
                            weight_decay=plan.weight_decay, fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(plan.schedule_steps or plan.train_steps, plan.warmup_steps, floor=0.1))
    n = stream.numel() - plan.seq_len - 1
    if n <= 0:
        raise ValueError(f"the corpus ({stream.numel()} tokens) is shorter than one window of {plan.seq_len}")
    offsets = torch.arange(plan.seq_len, dtype=torch.long)
    model.train()
    losses: list[float] = []
    window = torch.zeros((), device=device)  # the losses since the last log, summed where they are (no sync per step)
    window_n = done = 0
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
        window += loss.detach().float()
        window_n += 1
        done = step + 1
        over_time = plan.max_seconds is not None and time.perf_counter() - t0 > plan.max_seconds
        if step % plan.log_every == 0 or done == plan.train_steps or over_time:
            losses.append(round(window.item() / window_n, 4))
            window.zero_()
            window_n = 0
            el = time.perf_counter() - t0
            log(f"{name} step {done}/{plan.train_steps}: loss {losses[-1]:.3f}, "
                f"{done * plan.batch_size * plan.seq_len / max(el, 1e-9):,.0f} tok/s")
        if over_time:
            log(f"{name}: stopped after {done} of {plan.train_steps} steps (max_seconds {plan.max_seconds}); "
                "these weights depend on the machine's speed")
            break
    if cuda:
        torch.cuda.synchronize()
    model.eval()
    secs = time.perf_counter() - t0
    tokens = done * plan.batch_size * plan.seq_len
    return {"steps": done, "planned_steps": plan.train_steps, "stopped_early": done < plan.train_steps,
            "tokens": tokens, "epochs": round(tokens / stream.numel(), 2),
            "seconds": round(secs, 1), "tokens_per_s": round(tokens / max(secs, 1e-9)),
            "lr_at_end": round(sched.get_last_lr()[0] / plan.learning_rate, 4),  # of the peak; the floor is 0.1
            "loss_curve": losses, "final_loss": losses[-1] if losses else None}  # mean losses between two logs
