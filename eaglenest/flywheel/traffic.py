"""A turn's traffic: the log's new records, deduplicated, split by time into training data and the gate's held-out.

The newest ``heldout_fraction`` of the records is held out: the gate measures candidate and live drafter on recent
traffic that neither trained on. The turn's watermark is the newest *training* record, so this turn's held-out
records become training data of the next turn (whose gate holds out newer ones). Lines that cannot be used are
counted by reason and skipped: an unfinished last line (a replica is writing it), invalid JSON, a record the contract
refuses (:func:`eaglenest.contracts.traffic.check_record`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.contracts.traffic import FILE_GLOB, TrafficRecordError, check_record


@dataclass
class TrafficSplit:
    """What :func:`collect_traffic` wrote: ``train.jsonl`` (a native regen source) and ``heldout.jsonl``."""

    train: Path
    heldout: Path
    n_train: int
    n_heldout: int
    watermark: float
    """finished_at of the newest training record: the next turn reads only newer ones"""
    skipped: dict[str, int] = field(default_factory=dict)
    files: int = 0


def read_traffic(folder: str | Path, since: float = 0.0) -> tuple[list[dict[str, Any]], dict[str, int], int]:
    """Records finished after ``since``, oldest first, one per id; the skipped lines by reason; files read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"traffic log folder {folder} does not exist: turn the log on (serve.traffic_log.path) "
                                "and point flywheel.traffic at the same folder")
    skipped: dict[str, int] = {}
    seen: dict[str, dict[str, Any]] = {}
    files = sorted(folder.glob(FILE_GLOB))
    for f in files:
        try:
            text = f.read_text()
        except FileNotFoundError:  # a replica's retention sweep removed it meanwhile
            continue
        lines = text.split("\n")
        if lines and lines[-1]:
            skipped["unfinished"] = skipped.get("unfinished", 0) + 1
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                rec = check_record(json.loads(line))
            except json.JSONDecodeError:
                skipped["invalid_json"] = skipped.get("invalid_json", 0) + 1
                continue
            except TrafficRecordError:
                skipped["bad_record"] = skipped.get("bad_record", 0) + 1
                continue
            if float(rec["finished_at"]) > since:
                seen.setdefault(str(rec["id"]), rec)
    return sorted(seen.values(), key=lambda r: (float(r["finished_at"]), str(r["id"]))), skipped, len(files)


def write_jsonl(records: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tmp.replace(path)
    return path


def collect_traffic(folder: str | Path, out_dir: str | Path, *, since: float, heldout_fraction: float,
                    max_heldout: int) -> TrafficSplit:
    """Read the new records and write the turn's ``train.jsonl`` / ``heldout.jsonl`` into ``out_dir``."""
    out = Path(out_dir)
    records, skipped, files = read_traffic(folder, since)
    n_held = min(max_heldout, math.ceil(len(records) * heldout_fraction)) if len(records) > 1 else 0
    train, held = records[:len(records) - n_held], records[len(records) - n_held:]
    watermark = float(train[-1]["finished_at"]) if train else since
    return TrafficSplit(write_jsonl(train, out / "train.jsonl"), write_jsonl(held, out / "heldout.jsonl"),
                        len(train), len(held), watermark, skipped, files)


def vocab_coverage(records: list[dict[str, Any]], drafter: str | Path) -> float | None:
    """Share of the records' generated tokens inside ``drafter``'s draft vocabulary (its ``t2d``): a drafter can
    never propose a token outside it, and ``train.init_from`` keeps that vocabulary (None: no generated token)."""
    from safetensors import safe_open

    with safe_open(str(Path(drafter) / "model.safetensors"), framework="pt") as f:
        t2d = f.get_tensor("t2d").bool().tolist()
    inside = total = 0
    for r in records:
        for t, m in zip(r["input_ids"], r["loss_mask"], strict=True):
            if m:
                total += 1
                inside += bool(0 <= t < len(t2d) and t2d[t])
    return round(inside / total, 4) if total else None


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


__all__ = ["TrafficSplit", "collect_traffic", "load_jsonl", "read_traffic", "vocab_coverage", "write_jsonl"]
