"""Online training's answer cache: the exact ids and loss mask of every sample the engines regenerated, never its
hidden states.

``eaglenest train --online`` streams regen's engine stage into the trainer once per epoch. With greedy sampling (or
a fixed sampling seed) a sample's regenerated answer is the same every time, and generation is the engine's
dominant cost, so the engine actors file each answer they generate in the ledger, ``OUT/online/answers/``, and a
later row of the same sample (a later epoch, the draft-vocab pass's samples in epoch 1, a rerun after a kill) skips
generation and only captures: the answer becomes a native sample (``Sample.native``), which the Regenerator captures
as it is. The training rows are then the same ids, mask and hidden states as the first time, exactly what offline
training sees every epoch.

Layout::

    answers/part-<hash>.parquet   one file per engine batch: id, source, input_ids, loss_mask and the batch's counts
    answers/settings.json         what the answers depend on besides the target (sampling per source, length limits)

Files are written atomically (a dot-temporary renamed into place) and named by the hash of their ids, like the
quarantine files beside them; a reader only ever sees complete files. The cache is a few bytes per token (int32 id +
int8 mask), against kilobytes per token of hidden states. Answers of other settings are dropped when a run starts
(``prepare_answer_cache``); the target's identity is checked on the whole ledger (``run.json``).

A sample in the ledger's quarantine stays there: :class:`AnswerCache` reports it and the engine actor drops the
row without engine work (a rejected sample has no answer filed; a cached one rejected later, e.g. by a capture
error, is quarantined for good all the same).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.regen.output import QUARANTINE, ids_hash, quarantine_files, write_table_atomic

ANSWERS = "answers"
SETTINGS = "settings.json"
ANSWER_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("generated_tokens", pa.int32()),
    ("truncated_turns", pa.int32()),
    ("dropped_turns", pa.int32()),
])
"""an answer file's columns: no hidden state, by construction"""


def answer_files(ledger: Path) -> list[Path]:
    return sorted(p for p in (Path(ledger) / ANSWERS).glob("*.parquet") if not p.name.startswith("."))


def write_answers(rows: pa.Table, ledger: str | Path) -> Path | None:
    """File regenerated rows (engine-stage rows, any superset of ``ANSWER_SCHEMA``) as one atomic answers file."""
    if rows.num_rows == 0:
        return None
    rows = rows.select(ANSWER_SCHEMA.names).cast(ANSWER_SCHEMA)
    return write_table_atomic(rows, Path(ledger) / ANSWERS / f"part-{ids_hash(rows.column('id').to_pylist())}.parquet")


def prepare_answer_cache(ledger: Path, settings: dict[str, Any]) -> int:
    """At a run's start: delete half-written answers files of a killed run, and every answer when ``settings`` (what
    an answer depends on besides the target) differ from those the cache was filled with. Returns the answers
    files dropped for other settings."""
    folder = Path(ledger) / ANSWERS
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.glob(".tmp-*"):
        p.unlink(missing_ok=True)
    path = folder / SETTINGS
    wanted = json.loads(json.dumps(settings, sort_keys=True))  # the form it has once read back
    dropped = 0
    if path.is_file() and json.loads(path.read_text()) != wanted:
        for p in answer_files(ledger):
            p.unlink()
            dropped += 1
    if not path.is_file() or dropped:
        tmp = folder / f".tmp-{SETTINGS}"
        tmp.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return dropped


class AnswerCache:
    """An engine actor's view of the ledger: which samples have a filed answer, which are quarantined.

    Loaded lazily (first lookup) and refreshed whenever a lookup meets an id it knows nothing about, reading only
    the files that appeared since: other actors, and this one, keep filing answers while the stream runs.
    """

    def __init__(self, ledger: str | Path) -> None:
        self.ledger = Path(ledger)
        self.where: dict[str, str] = {}
        """sample id -> the answers file that holds it"""
        self.quarantined: set[str] = set()
        self.indexed: set[str] = set()
        self.refreshes = 0

    def refresh(self) -> int:
        """Index the answers and quarantine files not seen yet; returns how many were read."""
        self.refreshes += 1
        new = 0
        for f in answer_files(self.ledger):
            if f.name not in self.indexed:
                for i in _ids(f):
                    self.where.setdefault(i, f.name)
                self.indexed.add(f.name)
                new += 1
        for f in quarantine_files(self.ledger):
            key = f"{QUARANTINE}/{f.name}"
            if key not in self.indexed:
                self.quarantined.update(_ids(f))
                self.indexed.add(key)
                new += 1
        return new

    def lookup(self, ids: Sequence[str]) -> tuple[dict[str, tuple[list[int], list[int]]], set[str]]:
        """``ids`` -> (their filed answers: id -> (input_ids, loss_mask), the ones quarantined in the ledger).

        A quarantined id gets no answer even when one is filed. Ids with neither are to be regenerated.
        """
        if not self.refreshes or any(i not in self.where and i not in self.quarantined for i in ids):
            self.refresh()
        quarantined = {i for i in ids if i in self.quarantined}
        by_file: dict[str, set[str]] = {}
        for i in ids:
            if i in self.where and i not in quarantined:
                by_file.setdefault(self.where[i], set()).add(i)
        found: dict[str, tuple[list[int], list[int]]] = {}
        for name, want in by_file.items():
            try:
                t = pq.read_table(self.ledger / ANSWERS / name, columns=["id", "input_ids", "loss_mask"])
            except FileNotFoundError:  # dropped under us (another start's settings): regenerate
                continue
            for i, ids_, mask in zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist(),
                                     t.column("loss_mask").to_pylist(), strict=True):
                if i in want:
                    found[i] = (ids_, mask)
        return found, quarantined


def _ids(path: Path) -> Iterable[str]:
    try:
        return pq.read_table(path, columns=["id"]).column("id").to_pylist()
    except FileNotFoundError:
        return []


def cached_ids(ledger: Path) -> set[str]:
    """Every sample id with a filed answer."""
    out: set[str] = set()
    for f in answer_files(ledger):
        out.update(_ids(f))
    return out
