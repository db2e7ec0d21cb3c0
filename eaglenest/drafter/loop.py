"""The training loop: batch -> forward -> backward -> clip -> step -> log / eval / checkpoint, in one function.

:func:`train_loop` is the one loop of every drafter fit: the Ray Train workers of ``eaglenest train``
(:mod:`eaglenest.drafter.worker`, offline and online alike) and the in-process fitter
(:mod:`eaglenest.drafter.spec_fit`). They differ only in what they hand it: the batch iterator (shard tables of an
epoch, the online stream, in-memory captures), the collation of one item, the cadence (:class:`Cadence`) and the
sinks of its records and checkpoints (:class:`Sinks`). No Ray here: the world size comes in with :class:`Parts` and
collectives are plain ``torch.distributed`` calls that do nothing on one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from eaglenest.drafter.batch import Batch
from eaglenest.drafter.steps import autocast_for, ttt_forward, window_sums
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective, step_metrics

MAX_CONSECUTIVE_NONFINITE = 20


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint and restored on resume (data position included)."""

    step: int = 0
    epoch: int = 0
    epoch_batches: int = 0
    """batches of the current epoch already trained on by each worker (skipped when a resumed run replays the
    epoch)"""
    nonfinite_steps: int = 0
    world: int = 1
    """training workers when the state was saved: a run resumed with another count rescales ``epoch_batches``"""

    def rescale_world(self, world: int) -> int | None:
        """Resume with ``world`` workers: keep the current epoch's position in samples (each of ``self.world``
        workers trained ``epoch_batches`` batches: the new workers skip as many batches between them, rounded up, so
        no sample is seen twice in the epoch for want of a batch). Returns the saved position when it changed."""
        if world == self.world:
            return None
        before = self.epoch_batches
        self.epoch_batches = -(-before * self.world // world)
        self.world = world
        return before

    def restore(self, saved: dict[str, Any]) -> None:
        for k, v in asdict(self).items():
            setattr(self, k, int(saved.get(k, v)))


@dataclass
class Parts:
    """What the loop steps: the objective (``model``: as trained, maybe DDP-wrapped; ``objective``: unwrapped, for
    evaluation), the teacher head, the trainable parameters, optimizer and LR schedule, where batches go."""

    model: Any
    objective: TTTObjective
    teacher: TeacherHead
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    dtype: torch.dtype
    """``aux``/``last`` of a batch on the device (bf16 on GPUs)"""
    world: int = 1


@dataclass
class Cadence:
    """When the loop stops, logs, evaluates and checkpoints (every N steps; 0: only at the last step)."""

    total_steps: int
    stop_at_total: bool
    """stop at ``total_steps``; False: run until the batch iterator ends (an online stream)"""
    log_every: int
    eval_every: int
    checkpoint_every: int
    max_grad_norm: float


class Sinks(Protocol):
    """Where the loop's records and checkpoints go (a Ray Train worker: metrics.jsonl and Ray Train; the in-process
    fitter: a history list)."""

    def log(self, record: dict[str, Any]) -> None:
        """A ``kind: train`` or ``kind: eval`` record."""

    def checkpoint(self, state: TrainState) -> None:
        """Save everything a resume needs at ``state`` (every worker calls it)."""

    def nonfinite(self) -> None:
        """A step was skipped: some worker's loss was not finite."""


def train_loop(parts: Parts, batches: Iterable[Any], collate: Callable[[Any], Batch], state: TrainState,
               cadence: Cadence, sinks: Sinks, eval_batches: Iterable[Any] | None = None) -> None:
    """Train from ``state`` over ``batches`` (each made a :class:`Batch` by ``collate``) until ``cadence`` says stop.

    A step whose loss is not finite on some worker updates nothing (every worker skips it together); too many in a
    row raise. When the iterator ends before the last step (an online stream shortened by engine rejects) the loop
    logs, evaluates and checkpoints where it stopped.
    """
    if state.step == 0:
        _log_eval(sinks, evaluate(parts, eval_batches, collate), state)
    opt, objective = parts.optimizer, parts.objective
    window = Window(objective.ttt_steps, parts.device, parts.world)
    autocast = autocast_for(parts.device)
    consecutive_bad, checkpointed = 0, state.step
    objective.drafter.train()
    ready = time.perf_counter()
    for item in batches:
        window.wait_s += time.perf_counter() - ready  # data starvation: the regen side (or the reader) was slower
        # forward
        batch = collate(item).to(parts.device, parts.dtype)
        out = ttt_forward(batch, parts.teacher, parts.model, autocast)
        # backward, clip, step: skipped by every worker when any worker's loss is not finite
        finite = all_reduce(torch.isfinite(out.loss.detach()).double().reshape(1), parts.world).item() == parts.world
        opt.zero_grad(set_to_none=True)
        if finite:
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(parts.params, cadence.max_grad_norm)
            opt.step()
            window.sums += window_sums(out)
            consecutive_bad = 0
        else:
            state.nonfinite_steps += 1
            consecutive_bad += 1
            sinks.nonfinite()
            if consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
                raise FloatingPointError(
                    f"{consecutive_bad} consecutive non-finite losses at step {state.step}: training diverged "
                    "(lower train.learning_rate or check the shards for NaN hidden states)")
        parts.scheduler.step()
        state.step += 1
        window.tokens += batch.num_tokens
        # log, eval, checkpoint
        step = state.step
        last = cadence.stop_at_total and step >= cadence.total_steps
        if _due(step, cadence.log_every, last):
            sinks.log(window.record(state, parts.scheduler.get_last_lr()[0], objective.decay))
        if _due(step, cadence.eval_every, last):
            _log_eval(sinks, evaluate(parts, eval_batches, collate), state)
        if _due(step, cadence.checkpoint_every, last):
            sinks.checkpoint(state)
            checkpointed = step
        if last:
            break
        ready = time.perf_counter()
    if state.step > checkpointed:  # the iterator ended before the last step: log, evaluate, keep where it stopped
        sinks.log(window.record(state, parts.scheduler.get_last_lr()[0], objective.decay))
        _log_eval(sinks, evaluate(parts, eval_batches, collate), state)
        sinks.checkpoint(state)


def _due(step: int, every: int, last: bool) -> bool:
    return last or (every > 0 and step % every == 0)


def evaluate(parts: Parts, eval_batches: Iterable[Any] | None,
             collate: Callable[[Any], Batch]) -> dict[str, float] | None:
    """Held-out metrics over every worker's eval batches (None without a held-out split; every worker calls it)."""
    if eval_batches is None:
        return None
    objective = parts.objective
    sums = torch.zeros(3, objective.ttt_steps, dtype=torch.float64, device=parts.device)
    autocast = autocast_for(parts.device)
    objective.drafter.eval()
    with torch.no_grad():
        for item in eval_batches:
            batch = collate(item).to(parts.device, parts.dtype)
            sums += window_sums(ttt_forward(batch, parts.teacher, objective, autocast))
    objective.drafter.train()
    all_reduce(sums, parts.world)
    return step_metrics(sums[0].cpu(), sums[1].cpu(), sums[2].cpu())


def _log_eval(sinks: Sinks, metrics: dict[str, float] | None, state: TrainState) -> None:
    if metrics is not None:
        sinks.log({"kind": "eval", "step": state.step, "epoch": state.epoch, "time": time.time(), **metrics})


def all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    """Sum ``t`` over the workers in place (a no-op on one process)."""
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


class Window:
    """Per-step sums (ce, correct, count), tokens and data wait since the last train record, reduced over workers
    on read."""

    def __init__(self, ttt_steps: int, device: torch.device, world: int) -> None:
        self.sums = torch.zeros(3, ttt_steps, dtype=torch.float64, device=device)
        """finite steps' :func:`~eaglenest.drafter.steps.window_sums` (skipped steps add none)"""
        self.device, self.world = device, world
        self.tokens, self.t0 = 0, time.time()
        self.wait_s = 0.0
        """time this worker waited for its batches"""

    def record(self, state: TrainState, lr: float, step_weight_decay: float) -> dict[str, Any]:
        """The train record of the window (every worker must call it: it all-reduces), then start a new window."""
        w = all_reduce(self.sums.clone(), self.world)
        toks = all_reduce(torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.device), self.world)
        m = step_metrics(w[0].cpu(), w[1].cpu(), w[2].cpu())
        elapsed = max(1e-9, time.time() - self.t0)
        rec = {"kind": "train", "step": state.step, "epoch": state.epoch, "lr": lr,
               "tokens_per_s": float(toks.item()) / elapsed, "data_wait_fraction": min(1.0, self.wait_s / elapsed),
               "nonfinite_steps": state.nonfinite_steps, "time": time.time(), **m}
        rec["loss"] = sum(step_weight_decay ** k * rec[f"loss_{k}"] for k in range(self.sums.shape[1]))
        self.sums.zero_()
        self.tokens, self.t0, self.wait_s = 0, time.time(), 0.0
        return rec
