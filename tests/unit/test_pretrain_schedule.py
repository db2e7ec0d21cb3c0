"""The stand-ins' pre-training schedule: the cosine spans ``schedule_steps`` (the plan's steps by default), so a run
stopped short of it, by a shorter plan or by ``max_seconds``, ends mid-descent at the LR the report gives."""

from __future__ import annotations

import time

import torch

from eaglenest.engines.pretrain import PretrainPlan, pretrain_lm
from eaglenest.lr_schedule import warmup_cosine

STREAM = torch.arange(4000) % 16  # a bigram any model can learn: next = this + 1 (mod 16)


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(16, 16)


def _loss(model: Bigram, batch: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model.table(batch[:, :-1]).reshape(-1, 16), batch[:, 1:].reshape(-1))


def _plan(**kw) -> PretrainPlan:
    return PretrainPlan(**{"batch_size": 4, "seq_len": 8, "learning_rate": 0.1, "warmup_steps": 5, **kw})


def _run(plan: PretrainPlan, loss_fn=_loss) -> dict:
    torch.manual_seed(0)
    return pretrain_lm(Bigram(), STREAM, plan, "cpu", loss_fn=loss_fn, log=lambda m: None)


def test_a_whole_plan_anneals_to_the_floor_and_learns() -> None:
    report = _run(_plan(train_steps=60))
    assert report["steps"] == 60 and not report["stopped_early"]
    assert abs(report["lr_at_end"] - 0.1) < 1e-6
    assert report["final_loss"] < report["loss_curve"][0] - 0.5, report  # window means, first vs last


def test_a_longer_schedule_stops_mid_descent_at_the_lr_its_cosine_gives() -> None:
    report = _run(_plan(train_steps=30, schedule_steps=60))
    assert report["steps"] == 30
    assert abs(report["lr_at_end"] - warmup_cosine(60, 5, floor=0.1)(30)) < 1e-4, report
    assert 0.4 < report["lr_at_end"] < 0.9


def test_max_seconds_cuts_the_run_and_says_so() -> None:
    def slow(model: Bigram, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return _loss(model, batch)

    report = _run(_plan(train_steps=10_000, max_seconds=0.5), loss_fn=slow)
    assert report["stopped_early"] and 3 <= report["steps"] < 10_000 and report["seconds"] < 0.5 + 1.0, report
    assert report["lr_at_end"] > 0.9  # a 10,000-step cosine barely started its descent
