"""flywheel: served traffic -> capture -> retrain -> gate -> swap without downtime -> watch and roll back.

The loop no open system closes (docs/OPERATIONS.md, "The flywheel"). One turn (:func:`run_turn`, ``eaglenest
flywheel``): the traffic log's new records (serve.traffic_log), split by time into training data and the gate's
held-out; captured by regen (native format: the served answers are the target's own, no regeneration); trained from
the live drafter over traffic + original data (``train.init_from`` / ``train.mix``); the checkpoint chosen by held-out
accept length; then :func:`promote` (``eaglenest promote``): preflight and the gate (:func:`run_gate`), a swap by
rolling replacement (``eaglenest.serve.redeploy_drafter``; where a schedule is served, the candidate re-tuned first
and swapped in with its own: :func:`retune`), the post-swap watch and the automatic rollback. Every
decision and its numbers are in ``WORKDIR/audit.jsonl``.

Imports are lazy: the commands load Ray, torch and the engines only when they run.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Flywheel": "eaglenest.flywheel.context",
    "FlywheelConfig": "eaglenest.flywheel.settings",
    "flywheel_settings": "eaglenest.flywheel.settings",
    "AuditLog": "eaglenest.flywheel.audit",
    "send_alert": "eaglenest.flywheel.audit",
    "collect_traffic": "eaglenest.flywheel.traffic",
    "read_traffic": "eaglenest.flywheel.traffic",
    "Measurer": "eaglenest.flywheel.measure",
    "GateDecision": "eaglenest.flywheel.gate",
    "decide": "eaglenest.flywheel.gate",
    "run_gate": "eaglenest.flywheel.gate",
    "heldout_prompts": "eaglenest.flywheel.gate",
    "stage": "eaglenest.flywheel.store",
    "digest": "eaglenest.flywheel.store",
    "judge": "eaglenest.flywheel.watch",
    "promote": "eaglenest.flywheel.promote",
    "swap_and_watch": "eaglenest.flywheel.promote",
    "compare_schedules": "eaglenest.flywheel.retune",
    "retune": "eaglenest.flywheel.retune",
    "select_checkpoint": "eaglenest.flywheel.select",
    "run_turn": "eaglenest.flywheel.turn",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'eaglenest.flywheel' has no attribute {name!r}")
