"""EAGLE-3 drafter: model, draft vocabulary, TTT loss, Ray Train loop, checkpoints and SGLang/vLLM export.

Imports are lazy so ``import drafter`` stays cheap (torch and Ray load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DrafterModelConfig": "drafter.model",
    "Eagle3Drafter": "drafter.model",
    "DrafterKVCache": "drafter.model",
    "VocabMapping": "drafter.vocab",
    "build_vocab_mapping": "drafter.vocab",
    "count_tokens": "drafter.vocab",
    "TeacherHead": "drafter.ttt",
    "TTTObjective": "drafter.ttt",
    "step_metrics": "drafter.ttt",
    "train_drafter": "drafter.train",
    "export_checkpoint": "drafter.export",
    "export_drafter": "drafter.export",
    "load_drafter": "drafter.export",
    "ExportError": "drafter.export",
    "load_training_checkpoint": "drafter.checkpoint",
    "find_latest_checkpoint": "drafter.checkpoint",
    "check_manifest": "drafter.data",
    "DataMismatchError": "drafter.data",
    "write_quick_shards": "drafter.quick_shards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'drafter' has no attribute {name!r}")
