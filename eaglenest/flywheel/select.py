"""Checkpoint choice by accept length measured with the target, not by training loss.

Why: an EAGLE-3 drafter peaked at 4.6 of 10 epochs while its loss kept falling; what serving gains is accept length.
Every checkpoint the run kept (``train.keep_checkpoints``) is exported and decoded on the run's own held-out split
(the samples the trainer set aside by id, never trained on) through the target at the serving config; the best
wins, a later step on a tie. ``selection.json`` in the training folder records every checkpoint's number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eaglenest.drafter import export_checkpoint, is_eval_sample, list_checkpoints
from eaglenest.flywheel.context import Flywheel


def split_prompts(shards: str | Path, *, fraction: float, seed: int, limit: int) -> list[dict[str, Any]]:
    """Prompts of the held-out side of a training run's split (its shard folder's ``shards/*.parquet``)."""
    out: list[dict[str, Any]] = []
    for f in sorted((Path(shards) / "shards").glob("*.parquet")):
        t = pq.read_table(str(f), columns=["id", "input_ids", "loss_mask"])
        for sid, ids, mask in zip(*(t.column(c).to_pylist() for c in ("id", "input_ids", "loss_mask")), strict=True):
            if is_eval_sample(sid, fraction, seed):
                first = next((i for i, m in enumerate(mask) if m), len(mask))
                out.append({"input_ids": ids[:first], "domain": "traffic", "id": sid})
    return out[:limit]


def select_checkpoint(fw: Flywheel, train_dir: str | Path, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The export of the checkpoint with the best held-out accept length (the newest when there is one checkpoint,
    no prompt, or ``flywheel.select_checkpoints`` is off)."""
    train_dir = Path(train_dir)
    found = list_checkpoints(train_dir / "ray")
    if not found:
        raise FileNotFoundError(f"no training checkpoint under {train_dir / 'ray'}")
    rows = []
    if len(found) == 1 or not prompts or not fw.settings.select_checkpoints:
        step, ckpt = found[-1]
        export = export_checkpoint(ckpt, train_dir / "candidates" / f"step-{step:08d}", fmt="sglang")
        rows.append({"step": step, "export": str(export), "accept_length": None})
        best = rows[0]
    else:
        for step, ckpt in found:
            export = export_checkpoint(ckpt, train_dir / "candidates" / f"step-{step:08d}", fmt="sglang")
            m = fw.measurer.measure(export, prompts)
            rows.append({"step": step, "export": str(export), "accept_length": m["accept_length"]})
        best = max(rows, key=lambda r: (r["accept_length"], r["step"]))
    report = {"chosen": best, "checkpoints": rows, "prompts": len(prompts), "by": "held-out accept length"}
    (train_dir / "selection.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = ["select_checkpoint", "split_prompts"]
