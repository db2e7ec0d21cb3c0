"""EAGLE-3 drafter: model, draft vocabulary, TTT loss, Ray Train loop, checkpoints and SGLang/vLLM export.

Imports are lazy so ``import drafter`` stays cheap (torch and Ray load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # the network lives in the core (training and the reference decoder share it); re-exported for old callers
    "DrafterModelConfig": "eaglenest.drafters.eagle3.model",
    "Eagle3Drafter": "eaglenest.drafters.eagle3.model",
    "DrafterKVCache": "eaglenest.drafters.eagle3.model",
    "VocabMapping": "eaglenest.drafters.vocab",
    "build_vocab_mapping": "eaglenest.drafters.vocab",
    "count_tokens": "eaglenest.drafters.vocab",
    "TeacherHead": "eaglenest.drafters.eagle3.ttt",
    "TTTObjective": "eaglenest.drafters.eagle3.ttt",
    "step_metrics": "eaglenest.drafters.eagle3.ttt",
    "train_drafter": "eaglenest.drafter.driver",
    "export_checkpoint": "eaglenest.drafter.export",
    "export_drafter": "eaglenest.drafter.export",
    "load_drafter": "eaglenest.drafters.eagle3.model",
    "ExportError": "eaglenest.drafter.export",
    "load_training_checkpoint": "eaglenest.drafter.checkpoint",
    "find_latest_checkpoint": "eaglenest.drafter.checkpoint",
    "list_checkpoints": "eaglenest.drafter.checkpoint",
    "is_eval_sample": "eaglenest.drafter.data",
    "check_manifest": "eaglenest.drafter.data",
    "DataMismatchError": "eaglenest.drafter.data",
    "write_quick_shards": "eaglenest.drafter.quick_shards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'drafter' has no attribute {name!r}")
