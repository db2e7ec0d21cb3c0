"""regen: dataset sources -> target-regenerated conversations with captured hidden states, on Ray Data.

``run_regen(cfg, output, limit)`` runs or resumes a job and returns its summary (also ``DIR/manifest.json``);
``Regenerator`` is the per-batch core (any ``TargetEngine``); ``normalize_record`` maps one source row to the
conversation schema or to a quarantine reason.

Importing the package is light (no torch, no Ray): Ray Data's normalize workers import it for every fresh process.
"""

from __future__ import annotations

import importlib
from typing import Any

from eaglenest.regen.formats import (
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

_LAZY = {
    "Regenerator": "eaglenest.regen.regenerate",
    "Sample": "eaglenest.regen.regenerate",
    "Regenerated": "eaglenest.regen.regenerate",
    "Quarantined": "eaglenest.regen.regenerate",
    "TemplateFacts": "eaglenest.regen.regenerate",
    "run_regen": "eaglenest.regen.pipeline",
    # the pieces online training (eaglenest train --online) composes: plan -> engine stage -> ledger
    "regenerate_dataset": "eaglenest.regen.pipeline",
    "answer_settings": "eaglenest.regen.pipeline",
    "resolved_sources": "eaglenest.regen.pipeline",
    "target_identity": "eaglenest.regen.pipeline",
    "build_plan": "eaglenest.regen.sources",
    "check_sources": "eaglenest.regen.sources",
    "data_context": "eaglenest.regen.sources",
    "check_identity": "eaglenest.regen.output",
    "remove_stale_temporaries": "eaglenest.regen.output",
    "scan_completed": "eaglenest.regen.output",
    "AnswerCache": "eaglenest.regen.answers",
    "answer_files": "eaglenest.regen.answers",
    "cached_ids": "eaglenest.regen.answers",
    "prepare_answer_cache": "eaglenest.regen.answers",
    "ProgressTracker": "eaglenest.regen.progress",
    "METRIC_NAMES": "eaglenest.regen.progress",  # the names of eaglenest.contracts.metrics.REGEN
}

__all__ = [
    "ADAPTERS",
    "AnswerCache",
    "answer_files",
    "answer_settings",
    "cached_ids",
    "prepare_answer_cache",
    "ProgressTracker",
    "build_plan",
    "check_identity",
    "check_sources",
    "data_context",
    "regenerate_dataset",
    "remove_stale_temporaries",
    "resolved_sources",
    "scan_completed",
    "target_identity",
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'regen' has no attribute {name!r}")
