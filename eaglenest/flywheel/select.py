"""Checkpoint choice by accept length measured with the target, not by training loss, among the checkpoints that
keep the regression set.

Why: an EAGLE-3 drafter peaked at 4.6 of 10 epochs while its loss kept falling; what serving gains is accept length.
And a fine-tune gains on the new traffic step by step while it forgets the original data: the newest checkpoint
with the best held-out number can be the one the gate refuses, while an earlier one both wins and keeps. So every
checkpoint the run kept (``train.keep_checkpoints``) is exported and decoded through the target at the serving config
on the run's own held-out split (the samples the trainer set aside by id, never trained on) and, when there is one,
on the regression set, as is the live drafter there; a checkpoint *keeps* when it loses nowhere on the regression set
(overall or per domain) by more than ``flywheel.tolerance`` (the gate's rule). The best held-out number among those
that keep wins, a later step on a tie; when none keeps, the best overall (the gate then refuses it and says why).
``selection.json`` in the training folder records every checkpoint's numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eaglenest.drafter import export_checkpoint, is_eval_sample, list_checkpoints
from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.gate import losses


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


def select_checkpoint(fw: Flywheel, train_dir: str | Path, prompts: list[dict[str, Any]], *,
                      live: str | None = None) -> dict[str, Any]:
    """The export of the best checkpoint by held-out accept length among those that keep the regression set against
    ``live`` (the newest when there is one checkpoint, no prompt, or ``flywheel.select_checkpoints`` is off)."""
    train_dir = Path(train_dir)
    found = list_checkpoints(train_dir / "ray")
    if not found:
        raise FileNotFoundError(f"no training checkpoint under {train_dir / 'ray'}")
    rows = []
    regression = fw.regression_prompts() if live else []
    live_reg = fw.measurer.measure(live, regression) if regression else None
    if len(found) == 1 or not prompts or not fw.settings.select_checkpoints:
        step, ckpt = found[-1]
        export = export_checkpoint(ckpt, train_dir / "candidates" / f"step-{step:08d}", fmt="sglang")
        rows.append({"step": step, "export": str(export), "accept_length": None})
        best = rows[0]
    else:
        for step, ckpt in found:
            export = export_checkpoint(ckpt, train_dir / "candidates" / f"step-{step:08d}", fmt="sglang")
            sets = {"heldout": prompts, **({"regression": regression} if regression else {})}
            m = fw.measurer.measure_sets(export, sets)
            row = {"step": step, "export": str(export), "accept_length": m["heldout"]["accept_length"]}
            if live_reg is not None:
                lost = losses(live_reg, m["regression"], fw.settings.tolerance)
                row.update({"regression_accept_length": m["regression"]["accept_length"],
                            "regression_per_domain": m["regression"]["per_domain"], "keeps": not lost,
                            "regression_losses": [f"regression{w} {cv:.3f} vs live {lv:.3f}" for w, lv, cv in lost]})
            rows.append(row)
        keeping = [r for r in rows if r.get("keeps", True)] or rows
        best = max(keeping, key=lambda r: (r["accept_length"], r["step"]))
    report = {"chosen": best, "checkpoints": rows, "prompts": len(prompts),
              "by": "held-out accept length" + (" among checkpoints that keep the regression set" if live_reg else ""),
              "live_regression": live_reg}
    (train_dir / "selection.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = ["select_checkpoint", "split_prompts"]
