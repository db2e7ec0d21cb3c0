"""regen: dataset sources -> target-regenerated conversations with captured hidden states, on Ray Data.

``run_regen(cfg, output, limit)`` runs or resumes a job and returns its summary (also ``DIR/manifest.json``);
``Regenerator`` is the per-batch core (any ``TargetEngine``); ``normalize_record`` maps one source row to the
conversation schema or to a quarantine reason.
"""

from __future__ import annotations

from typing import Any

from regen.adapters import (
    ADAPTERS,
    NORMALIZED_SCHEMA,
    QUARANTINE_SCHEMA,
    REASONS,
    BadRow,
    Deduplicator,
    conversation_id,
    normalize_record,
    normalize_records,
)
from regen.regenerate import Quarantined, Regenerated, Regenerator, Sample, TemplateFacts

__all__ = [
    "ADAPTERS",
    "METRIC_NAMES",
    "NORMALIZED_SCHEMA",
    "QUARANTINE_SCHEMA",
    "REASONS",
    "BadRow",
    "Deduplicator",
    "Quarantined",
    "Regenerated",
    "Regenerator",
    "Sample",
    "TemplateFacts",
    "conversation_id",
    "normalize_record",
    "normalize_records",
    "run_regen",
]

METRIC_NAMES = (
    "eaglenest_regen_samples_done",
    "eaglenest_regen_samples_quarantined",
    "eaglenest_regen_generated_tokens",
    "eaglenest_regen_tokens_per_second",
    "eaglenest_regen_eta_seconds",
)


def run_regen(cfg: Any, output: Any = None, limit: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run or resume a regen job (imports Ray only when called); see :func:`regen.pipeline.run_regen`."""
    from regen.pipeline import run_regen as _run

    return _run(cfg, output, limit, **kwargs)
