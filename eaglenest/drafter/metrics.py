"""Drafter training's Prometheus metrics (rank 0), created from the contract in :mod:`eaglenest.contracts.metrics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglenest.contracts import metrics as contract
from eaglenest.contracts.metrics import ray_metric


@dataclass
class TrainMetrics:
    """Loss, step-0 accuracy and simulated accept length gauges, and the non-finite-step counter of one run."""

    loss: Any
    acc0: Any
    sim_accept_length: Any
    nonfinite: Any

    @classmethod
    def create(cls, run_name: str) -> TrainMetrics:
        """The Ray metric objects, every series tagged with ``run=run_name``."""
        m = cls(ray_metric(contract.TRAIN_LOSS), ray_metric(contract.TRAIN_ACC0),
                ray_metric(contract.TRAIN_SIM_ACCEPT_LENGTH), ray_metric(contract.TRAIN_LOSS_NONFINITE))
        for metric in (m.loss, m.acc0, m.sim_accept_length, m.nonfinite):
            metric.set_default_tags({"run": run_name})
        return m
