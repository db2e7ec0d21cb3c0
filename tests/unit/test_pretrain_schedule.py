"""The stand-ins' pre-training under a time limit: the cosine is fitted to the steps that fit, so the weights come
out of an annealed run instead of one cut mid-descent."""

from __future__ import annotations

import time

import torch

from eaglenest.engines.pretrain import PretrainPlan, pretrain_lm, steps_that_fit

STEP_S = 0.02


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(16, 16)


def _paced_loss(model: Bigram, batch: torch.Tensor) -> torch.Tensor:
    """A real next-token loss that takes at least STEP_S (so the pace is the test's, not the machine's)."""
    time.sleep(STEP_S)
    logits = model.table(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), batch[:, 1:].reshape(-1))


def _plan(**kw) -> PretrainPlan:
    return PretrainPlan(**{"train_steps": 10_000, "batch_size": 4, "seq_len": 8, "learning_rate": 0.1,
                           "warmup_steps": 5, **kw})


def test_the_steps_that_fit_follow_the_pace_and_the_time_left() -> None:
    plan = _plan(max_seconds=10.0)
    assert steps_that_fit(plan, done=20, elapsed_s=2.0, paced_steps=10, paced_s=1.0) == 20 + 80
    assert steps_that_fit(plan, done=20, elapsed_s=12.0, paced_steps=10, paced_s=1.0) == 20  # already over
    assert steps_that_fit(_plan(train_steps=50, max_seconds=10.0), 20, 2.0, 10, 1.0) == 50  # the plan caps it
    assert steps_that_fit(_plan(), 20, 2.0, 10, 1.0) == 10_000  # no time limit: the plan's steps


def test_a_time_limited_run_ends_annealed_within_its_time() -> None:
    stream = torch.arange(4000) % 16
    torch.manual_seed(0)
    report = pretrain_lm(Bigram(), stream, _plan(max_seconds=1.5), "cpu", loss_fn=_paced_loss, log=lambda m: None)
    assert report["stopped_early"] and report["steps"] == report["schedule_steps"] < 1.5 / STEP_S, report
    assert report["lr_at_end"] < 0.2, report  # at (or within a fit's error of) the floor; a cut cosine sat near 1.0
    assert report["seconds"] < 1.5 + 0.5, report
    assert report["final_loss"] < report["loss_curve"][0], report


def test_without_a_time_limit_the_plan_runs_whole() -> None:
    stream = torch.arange(4000) % 16
    report = pretrain_lm(Bigram(), stream, _plan(train_steps=30), "cpu", log=lambda m: None,
                         loss_fn=lambda m, b: torch.nn.functional.cross_entropy(
                             m.table(b[:, :-1]).reshape(-1, 16), b[:, 1:].reshape(-1)))
    assert report["steps"] == report["schedule_steps"] == 30 and not report["stopped_early"]
    assert abs(report["lr_at_end"] - 0.1) < 1e-6
