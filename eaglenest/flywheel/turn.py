"""One turn of the flywheel: traffic -> capture -> retrain from the live drafter -> choose a checkpoint -> promote.

1. **Collect** the traffic log's records since the live drafter's data (``state.json`` ``trained_until``), split by
   time into training data and the gate's held-out (:mod:`eaglenest.flywheel.traffic`).
2. **Capture** the training records with regen (Ray Data; the native format: the answers are the target's own, so
   no regeneration, only the teacher-forced capture of hidden states).
3. **Train** with ``eaglenest train`` (Ray Train) from the live drafter (``train.init_from``) over the traffic and the
   original data at ``flywheel.traffic_share`` (``train.mix``).
4. **Choose** the checkpoint by held-out accept length among those that keep the regression set
   (:mod:`eaglenest.flywheel.select`).
5. **Promote** it (:mod:`eaglenest.flywheel.promote`): gate, re-tune where a schedule is served, swap, watch,
   roll back.

Every step lands in ``WORKDIR/turn-NNNN/`` and the audit log; a promoted drafter that stays live moves
``trained_until``, so a refused or rolled-back turn's traffic is used again by the next turn.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig, MixData, SourceConfig
from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.gate import heldout_prompts
from eaglenest.flywheel.promote import promote
from eaglenest.flywheel.select import select_checkpoint, split_prompts
from eaglenest.flywheel.traffic import collect_traffic, load_jsonl, vocab_coverage


def capture_config(cfg: EaglenestConfig, traffic: Path, output: Path) -> EaglenestConfig:
    """regen over the turn's traffic alone (one native source); the rest of the regen section as configured."""
    src = SourceConfig(name="traffic", domain="chat", adapter="native", path=str(traffic))
    regen = cfg.regen.model_copy(update={"sources": [src], "sources_file": None, "output": str(output)})
    return cfg.model_copy(update={"regen": regen})


def train_config(fw: Flywheel, live: str | None, turn: int) -> EaglenestConfig:
    """The train section of a turn: from the live drafter, mixed with the original data, its own run name."""
    s, tc = fw.settings, fw.cfg.train
    mix = []
    original = fw.cfg.resolve(s.original_data)
    if original and s.traffic_share < 1.0:
        mix = [MixData(data=str(Path(original).resolve()), share=1.0 - s.traffic_share)]
    train = tc.model_copy(update={"init_from": live, "mix": mix, "run_name": f"flywheel-turn-{turn:04d}"})
    return fw.cfg.model_copy(update={"train": train})


def run_turn(fw: Flywheel) -> dict[str, Any]:
    """One turn; returns its summary (also the audit log's ``turn`` record)."""
    from eaglenest.drafter import train_drafter
    from eaglenest.regen import run_regen

    t0 = time.time()
    n = int(fw.state.get("turn", 0)) + 1
    tdir = fw.workdir / f"turn-{n:04d}"
    since = float(fw.state.get("trained_until", 0.0))
    split = collect_traffic(fw.traffic_folder(), tdir / "traffic", since=since,
                            heldout_fraction=fw.settings.heldout_fraction, max_heldout=fw.settings.max_heldout)
    summary: dict[str, Any] = {"turn": n, "traffic_train": split.n_train, "traffic_heldout": split.n_heldout,
                               "skipped_lines": split.skipped, "files": split.files}
    if split.n_train < fw.settings.min_traffic_samples or split.n_heldout == 0:
        summary["outcome"] = (f"waiting for traffic: {split.n_train} new training records (needs "
                              f"{fw.settings.min_traffic_samples}) and {split.n_heldout} held out")
        return fw.audit.write("turn", **summary)
    live = fw.live_drafter()
    if live:  # a new domain's tokens outside the live drafter's draft vocabulary can never be drafted
        summary["live_vocab_coverage"] = vocab_coverage(load_jsonl(split.train), live)
    regen = run_regen(capture_config(fw.cfg, split.train, tdir / "regen"), tdir / "regen")
    cfg = train_config(fw, live, n)
    trained = train_drafter(cfg, tdir / "regen", tdir / "train")
    prompts = split_prompts(tdir / "regen", fraction=cfg.train.eval_fraction, seed=cfg.train.seed,
                            limit=fw.settings.select_max_prompts)
    chosen = select_checkpoint(fw, tdir / "train", prompts, live=live)
    result = promote(fw, chosen["chosen"]["export"], heldout_prompts(fw, split.heldout), label=f"turn-{n:04d}")
    kept = result["watch"] is not None and not result["rolled_back"]
    fw.save_state(turn=n, **({"trained_until": split.watermark} if kept else {}))
    summary.update({"live_before": live, "captured": regen.get("num_samples"), "train_steps": trained.get("steps"),
                    "selection": chosen, "gate": "promote" if result["decision"]["promote"] else "refuse",
                    "promoted": result["watch"] is not None,
                    "rolled_back": result["rolled_back"], "kept": kept, "seconds": round(time.time() - t0, 1),
                    "outcome": _outcome(result, kept)})
    fw.audit.write("turn", **summary)
    return {**summary, "result": result}


def _outcome(result: dict[str, Any], kept: bool) -> str:
    if kept:
        return "promoted and kept"
    if result["rolled_back"]:
        return "rolled back"
    retuned = result.get("retune")
    if retuned is not None and not retuned["keeps"]:
        return "refused by the re-tune: " + "; ".join(retuned["comparison"]["reasons"])
    return "refused by the gate: " + "; ".join(result["decision"]["reasons"])


__all__ = ["capture_config", "run_turn", "train_config"]
