"""The flywheel's Prometheus metrics (definitions: :data:`eaglenest.contracts.metrics.FLYWHEEL`).

The flywheel runs as a Ray driver (``eaglenest flywheel`` / ``promote``, attached to the serving cluster), so its
metrics go through Ray's metrics agent like every other eaglenest metric; the alert rules read
``ray_eaglenest_flywheel_rollbacks_total`` and the gauges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglenest.contracts import metrics as contract
from eaglenest.contracts.metrics import ray_metric


@dataclass
class FlywheelMetrics:
    """The metric objects of one application's flywheel."""

    app: str
    accept_length: Any
    live_accept_length: Any
    promotions: Any
    refusals: Any
    rollbacks: Any

    @classmethod
    def create(cls, app: str) -> FlywheelMetrics:
        return cls(app, ray_metric(contract.FLYWHEEL_ACCEPT_LENGTH), ray_metric(contract.FLYWHEEL_LIVE_ACCEPT_LENGTH),
                   ray_metric(contract.FLYWHEEL_PROMOTIONS), ray_metric(contract.FLYWHEEL_REFUSALS),
                   ray_metric(contract.FLYWHEEL_ROLLBACKS))

    def gate(self, role: str, prompt_set: str, value: float) -> None:
        self.accept_length.set(value, tags={"app": self.app, "role": role, "set": prompt_set})

    def live(self, phase: str, value: float) -> None:
        self.live_accept_length.set(value, tags={"app": self.app, "phase": phase})

    def count(self, what: str) -> None:
        """``promotions``, ``refusals`` or ``rollbacks``."""
        getattr(self, what).inc(1, tags={"app": self.app})


__all__ = ["FlywheelMetrics"]
