"""Fit an EAGLE-3 drafter in-process, without Ray: tests, benchmarks and GPU boxes that have torch but no Ray.

Same model (:class:`~eaglenest.drafters.eagle3.model.Eagle3Drafter`), model config (:mod:`eaglenest.drafter.shape`),
draft vocab (:mod:`eaglenest.drafters.vocab`), collation (:func:`eaglenest.drafter.batch.pad_batch`) and loop
(:func:`eaglenest.drafter.loop.train_loop`, non-finite-loss guard included) as ``eaglenest train``; only what the loop
is handed differs: samples are captured from an in-memory target engine and held in memory instead of streaming
parquet shards through Ray Data into DDP workers, and the records go to a history list (no checkpoints, no held-out
evaluation).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.batch import Batch, pad_batch
from eaglenest.drafter.loop import Cadence, Parts, TrainState, train_loop
from eaglenest.drafter.shape import drafter_model_config
from eaglenest.drafter.steps import compute_dtype_for, init_drafter, make_optimizer
from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective
from eaglenest.drafters.vocab import VocabMapping, build_vocab_mapping, count_tokens
from eaglenest.lr_schedule import warmup_cosine

HISTORY_EVERY = 25
"""steps between the records :attr:`FitResult.history` keeps"""
METRIC_KEYS = ("sim_accept_length", "tokens")
"""a history record's fields besides step, loss and the per-step ``loss_k`` / ``acc_k``"""
Sample = tuple[list[int], list[int]]
"""(input_ids, loss_mask): the mask marks tokens the drafter learns to predict (the answer)."""


@dataclass
class FitConfig:
    """Training budget and shape of an in-process drafter fit."""

    steps: int = 300
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    ttt_steps: int = 5
    step_weight_decay: float = 0.8
    draft_vocab_size: int = 32000
    max_seq_len: int = 512
    aux_layer_ids: list[int] | None = None
    """physical ids; None: the engine's (default [2, N//2, N-3])"""
    intermediate_size: int | None = None
    """the drafter's MLP width; None: the target's"""
    seed: int = 0
    max_grad_norm: float = 0.5


@dataclass
class FitResult:
    drafter: Eagle3Drafter
    mapping: VocabMapping
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Captured:
    ids: torch.Tensor
    mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor


def drafter_config_for(engine: Any, aux_layer_ids: Sequence[int], draft_vocab_size: int,
                       intermediate_size: int | None = None) -> DrafterModelConfig:
    """A drafter shaped like one decoder layer of the target (EAGLE-3's default), built as ``eaglenest train`` builds
    it (:func:`~eaglenest.drafter.shape.drafter_model_config`) from the engine's target folder."""
    facts = TargetSpec.read(str(engine.info.model), hub=True)
    return drafter_model_config(facts, aux_layer_ids, draft_vocab_size, intermediate_size=intermediate_size)


def capture_samples(engine: Any, samples: Sequence[Sample], layer_ids: Sequence[int], *, batch_size: int = 16,
                    max_seq_len: int = 512, store_dtype: torch.dtype = torch.bfloat16) -> list[_Captured]:
    """Teacher-forced capture of every sample (aux states + final normed state), kept on the engine's device."""
    out: list[_Captured] = []
    for i in range(0, len(samples), batch_size):
        chunk = [(ids[:max_seq_len], m[:max_seq_len]) for ids, m in samples[i:i + batch_size]]
        caps = engine.capture([c[0] for c in chunk], list(layer_ids))
        for (ids, m), cap in zip(chunk, caps, strict=True):
            out.append(_Captured(torch.tensor(ids), torch.tensor(m, dtype=torch.bool),
                                 cap.aux_hidden_states.to(engine.device, store_dtype),
                                 cap.last_hidden_state.to(engine.device, store_dtype)))
    return out


def _collate(items: list[_Captured]) -> Batch:
    """The training loop's collation (:func:`~eaglenest.drafter.batch.pad_batch`) over in-memory captures."""
    return pad_batch([(x.ids, x.mask, x.aux, x.last) for x in items])


def _shuffled(data: list[_Captured], batch_size: int, seed: int) -> Iterator[list[_Captured]]:
    """Batches without end: every capture once per pass, each pass in a fresh shuffled order."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(len(data)))
            rng.shuffle(fresh)
            order += fresh
        pick, order = order[:batch_size], order[batch_size:]
        yield [data[i] for i in pick]


@dataclass
class _History:
    """The loop's sinks here: every 25th step's train record (the first and last too) kept as history; no eval, no
    checkpoints."""

    total_steps: int
    progress: Callable[[int, dict[str, float]], None] | None = None
    records: list[dict[str, float]] = field(default_factory=list)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"] - 1  # the history counts steps from 0: the step the record follows
        if step % HISTORY_EVERY and record["step"] != self.total_steps:
            return
        rec = {"step": float(step), "loss": record["loss"],
               **{k: v for k, v in record.items() if k.startswith(("loss_", "acc_")) or k in METRIC_KEYS}}
        self.records.append(rec)
        if self.progress is not None:
            self.progress(step, rec)

    def checkpoint(self, state: TrainState) -> None:
        pass

    def nonfinite(self) -> None:
        pass


def fit_drafter(
    engine: Any,
    samples: Sequence[Sample],
    cfg: FitConfig | None = None,
    *,
    captured: list[_Captured] | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> FitResult:
    """Train a drafter for ``engine``'s target on ``samples`` (captured here unless ``captured`` is given)."""
    cfg = cfg or FitConfig()
    t0 = time.perf_counter()
    layers = list(cfg.aux_layer_ids or engine.aux_layer_ids)
    if not samples:
        raise ValueError("no training samples: fit_drafter needs (input_ids, loss_mask) pairs")
    counts = count_tokens(samples, engine.info.vocab_size)
    if int(counts.sum()) == 0:
        raise ValueError("no loss-masked tokens in the samples: the drafter would learn nothing")
    model_cfg = drafter_config_for(engine, layers, cfg.draft_vocab_size, cfg.intermediate_size)
    mapping = build_vocab_mapping(counts, model_cfg.draft_vocab_size)
    device = engine.device
    dtype = compute_dtype_for(device)
    torch.manual_seed(cfg.seed)
    lm_head = engine.lm_head_weight().detach().float().cpu()
    drafter = init_drafter(model_cfg, engine.embed_weight(), lm_head, mapping)
    drafter.to(device).train()
    teacher = TeacherHead(lm_head.to(dtype), mapping).to(device)
    data = captured if captured is not None else capture_samples(
        engine, samples, layers, max_seq_len=cfg.max_seq_len)
    objective = TTTObjective(drafter, cfg.ttt_steps, cfg.step_weight_decay)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = make_optimizer(params, lr=cfg.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.steps, cfg.warmup_steps, floor=0.05))
    parts = Parts(model=objective, objective=objective, teacher=teacher, params=params, optimizer=opt,
                  scheduler=sched, device=device, dtype=dtype)
    # a record every step (one step's metrics each), of which the history keeps every HISTORY_EVERY-th
    cadence = Cadence(total_steps=cfg.steps, stop_at_total=True, log_every=1, eval_every=0, checkpoint_every=0,
                      max_grad_norm=cfg.max_grad_norm)
    history = _History(cfg.steps, progress)
    train_loop(parts, _shuffled(data, cfg.batch_size, cfg.seed), _collate, TrainState(), cadence, history)
    drafter.eval()
    return FitResult(drafter=drafter, mapping=mapping, history=history.records, seconds=time.perf_counter() - t0)


def untrained_like(drafter: Eagle3Drafter, target_lm_head: torch.Tensor, *, seed: int = 0) -> Eagle3Drafter:
    """The same drafter before training: same shape, vocab mapping and frozen embedding, ``lm_head`` started from
    the target's rows (as training starts), ``fc`` and the decoder layer freshly initialised (a demo's baseline)."""
    torch.manual_seed(seed)
    fresh = Eagle3Drafter(drafter.config)
    fresh.init_from_target(drafter.embed_tokens.weight.detach().float().cpu(), target_lm_head.detach().float().cpu(),
                           drafter.d2t.cpu(), drafter.t2d.cpu())
    p = next(drafter.parameters())
    return fresh.to(p.device, p.dtype).eval()


def chat_prompt_answer(engine: Any, chats: Sequence[dict[str, Any]], *, regenerate: bool, max_new_tokens: int = 96,
                       batch_size: int = 16) -> list[Sample]:
    """(ids, loss_mask) per chat: the last assistant turn regenerated by the target (greedy) or kept as written.

    Prompt = everything before the last assistant turn, mask = the answer. Lives here, not in
    ``eaglenest.drafter.quick_shards`` (which wraps it), so that GPU images without pyarrow can run the benchmarks.
    """
    from eaglenest.engines.base import SamplingParams, render_chat_ids

    prompts, answers = [], []
    for chat in chats:
        msgs = chat["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            raise ValueError("each chat must end with an assistant turn")
        prompt = engine.render_prompt(msgs[:-1], chat.get("tools"))
        prompts.append(prompt)
        if not regenerate:
            full = render_chat_ids(engine.tokenizer, msgs, tools=chat.get("tools"), add_generation_prompt=False)
            if full[: len(prompt)] != prompt:
                raise ValueError("the chat template is not append-only; cannot split prompt and answer")
            answers.append(full[len(prompt):])
    if regenerate:
        sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        for i in range(0, len(prompts), batch_size):
            answers += [g.token_ids for g in engine.generate_ids(prompts[i:i + batch_size], sp)]
    return [(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers, strict=True)]
