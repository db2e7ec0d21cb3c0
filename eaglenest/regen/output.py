"""The regen output folder: atomic shard and quarantine files, the completed-id scan that makes reruns resume, and
the manifest.

Layout of ``DIR``::

    shards/part-<hash>.parquet        one row per sample (eaglenest.contracts.shards.SHARD_SCHEMA)
    quarantine/normalize-<hash>.parquet   rows that could not be normalized (id, source, reason, detail, raw)
    quarantine/regen-<hash>.parquet       samples the engine stage rejected (too long, engine error, ...)
    plan/                             this run's work list (rebuilt by every run)
    run.json                          the target identity this folder belongs to
    manifest.json                     written at the end of every run, over the whole folder

Every file is written under a dot-name and renamed into place, so a killed job leaves either a complete file or a
temporary one that the next run deletes. File names are hashes of the ids they hold: a retried write of the same
rows replaces its own file instead of adding a second copy. A rerun reads the ids of every completed file first and
schedules only the rest, so each input sample ends up in exactly one shard or quarantine file. A quarantined sample
counts as done; delete its quarantine file to have a rerun try it again (e.g. after fixing an engine problem).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eaglenest.contracts.shards import (
    FP8,
    FP8_SCALE_LAYOUT,
    HIDDEN_COLUMNS,
    SHARD_SCHEMA,
    Manifest,
    hidden_bytes_per_token,
    shard_files,
    write_manifest,
)
from eaglenest.regen.formats import QUARANTINE_SCHEMA

SHARDS, QUARANTINE, PLAN = "shards", "quarantine", "plan"
ROW_GROUP_BYTES = 256 << 20  # keeps every binary chunk far below Arrow's 2 GiB array limit
_SMALL_COLUMNS = {"id", "source", "domain", "input_ids", "loss_mask", "num_tokens"}


class OutputFolderError(ValueError):
    """An output folder that this run must not write into (another target's shards, duplicated samples)."""


@contextlib.contextmanager
def output_lock(out_dir: Path) -> Iterator[None]:
    """One job per output folder at a time (the OS releases the lock when a killed driver's process ends)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputFolderError(f"another regen job is writing to {out_dir}; wait for it or pick another "
                                    "--output") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ids_hash(ids: Iterable[str]) -> str:
    """Deterministic file stem for a set of sample ids."""
    h = hashlib.sha256()
    for i in sorted(ids):
        h.update(i.encode())
        h.update(b"\n")
    return h.hexdigest()[:24]


def _atomic_path(path: Path) -> Path:
    return path.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{path.name}")


def write_table_atomic(table: pa.Table, path: Path, *, row_group_bytes: int = ROW_GROUP_BYTES) -> Path:
    """Write ``table`` to ``path`` via a temporary dot-file and a rename; blob columns are stored uncompressed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_path(path)
    compression = {name: ("zstd" if name in _SMALL_COLUMNS or not pa.types.is_binary(table.schema.field(name).type)
                          else "none") for name in table.schema.names}
    try:
        with pq.ParquetWriter(tmp, table.schema, compression=compression, use_dictionary=False) as w:
            for chunk in _row_groups(table, row_group_bytes):
                w.write_table(chunk)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _row_groups(table: pa.Table, max_bytes: int) -> Iterable[pa.Table]:
    if table.num_rows == 0:
        yield table
        return
    per_row = max(1, table.nbytes // table.num_rows)
    step = max(1, max_bytes // per_row)
    for start in range(0, table.num_rows, step):
        yield table.slice(start, step)


def write_shard(table: pa.Table, out_dir: Path) -> Path:
    """One shard file (SHARD_SCHEMA) named by its ids."""
    table = table.select(SHARD_SCHEMA.names).cast(SHARD_SCHEMA)
    return write_table_atomic(table, out_dir / SHARDS / f"part-{ids_hash(table.column('id').to_pylist())}.parquet")


def write_quarantine(rows: pa.Table, out_dir: Path, prefix: str) -> Path:
    """One quarantine file (id, source, reason, detail, raw) named by its ids."""
    rows = rows.select(QUARANTINE_SCHEMA.names).cast(QUARANTINE_SCHEMA)
    name = f"{prefix}-{ids_hash(rows.column('id').to_pylist())}.parquet"
    return write_table_atomic(rows, out_dir / QUARANTINE / name)


def quarantine_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in (out_dir / QUARANTINE).glob("*.parquet") if not p.name.startswith("."))


def remove_stale_temporaries(out_dir: Path) -> int:
    """Delete half-written files of a killed run (dot-prefixed temporaries)."""
    n = 0
    for sub in (SHARDS, QUARANTINE):
        for p in (out_dir / sub).glob(".tmp-*"):
            p.unlink(missing_ok=True)
            n += 1
    return n


# ------------------------------------------------------------------------------------------- completed ids
@dataclass
class Completed:
    """Ids already recorded in the folder (shards and quarantine), as read back before scheduling."""

    shard_ids: set[str] = field(default_factory=set)
    quarantine_ids: set[str] = field(default_factory=set)
    duplicates: list[str] = field(default_factory=list)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.shard_ids or sample_id in self.quarantine_ids

    def __len__(self) -> int:
        return len(self.shard_ids) + len(self.quarantine_ids)


def scan_completed(out_dir: Path) -> Completed:
    """Read the ``id`` column of every completed shard and quarantine file (nothing else is read)."""
    done = Completed()
    seen: set[str] = set()
    for files, target in ((shard_files(out_dir), done.shard_ids), (quarantine_files(out_dir), done.quarantine_ids)):
        for f in files:
            for i in pq.read_table(f, columns=["id"]).column("id").to_pylist():
                if i in seen:
                    done.duplicates.append(i)
                seen.add(i)
                target.add(i)
    return done


# ---------------------------------------------------------------------------------------------- identity
IDENTITY_KEYS = ("target", "num_layers", "hidden_size", "vocab_size", "aux_layer_ids", "dtype")


def check_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    """Refuse to mix shards of different targets or layer taps in one folder; record the identity on first use."""
    path = out_dir / "run.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [f"{k}: folder {old.get(k)!r}, this run {identity.get(k)!r}" for k in IDENTITY_KEYS
                if old.get(k) != identity.get(k)]
        if diff:
            raise OutputFolderError(
                f"{out_dir} holds regen output of another target or capture setup ({'; '.join(diff)}); "
                "use a new --output folder (or delete this one) to regenerate with this config")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({k: identity[k] for k in IDENTITY_KEYS}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- manifest
def summarize_folder(out_dir: Path) -> dict[str, Any]:
    """Counts over every completed file (all runs): samples/tokens per source, quarantine per reason and source."""
    per_source: dict[str, int] = {}
    tokens = loss_tokens = samples = 0
    blob_bytes = 0
    for f in shard_files(out_dir):
        t = pq.read_table(f, columns=["source", "num_tokens", "loss_mask"])
        samples += t.num_rows
        tokens += int(pc.sum(t.column("num_tokens")).as_py() or 0)
        loss_tokens += int(pc.sum(pc.list_flatten(t.column("loss_mask"))).as_py() or 0)
        for s in t.column("source").to_pylist():
            per_source[s] = per_source.get(s, 0) + 1
        md = pq.ParquetFile(f).metadata
        for rg in range(md.num_row_groups):
            for c in range(md.num_columns):
                col = md.row_group(rg).column(c)
                if col.path_in_schema in HIDDEN_COLUMNS:
                    blob_bytes += col.total_uncompressed_size
    per_reason: dict[str, int] = {}
    q_source: dict[str, int] = {}
    for f in quarantine_files(out_dir):
        t = pq.read_table(f, columns=["source", "reason"])
        for s, r in zip(t.column("source").to_pylist(), t.column("reason").to_pylist(), strict=True):
            per_reason[r] = per_reason.get(r, 0) + 1
            q_source[s] = q_source.get(s, 0) + 1
    return {
        "num_samples": samples, "num_tokens": tokens, "num_loss_tokens": loss_tokens,
        "samples_per_source": dict(sorted(per_source.items())),
        "quarantined_per_reason": dict(sorted(per_reason.items())),
        "quarantined_per_source": dict(sorted(q_source.items())),
        "num_quarantined": sum(per_reason.values()),
        "file_bytes_per_token": round(blob_bytes / tokens, 3) if tokens else 0.0,
    }


def write_final_manifest(out_dir: Path, identity: dict[str, Any], engine_version: str,
                         extra: dict[str, Any]) -> Manifest:
    """The manifest over the whole folder; ``bytes_per_token`` is the exact stored hidden-state size."""
    counts = summarize_folder(out_dir)
    fp8 = {"scale_layout": FP8_SCALE_LAYOUT} if identity["dtype"] == FP8 else {}
    prev_created = None
    old = out_dir / "manifest.json"
    if old.is_file():
        prev_created = json.loads(old.read_text()).get("created_at")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    m = Manifest(
        target=identity["target"], num_layers=identity["num_layers"], hidden_size=identity["hidden_size"],
        vocab_size=identity["vocab_size"], aux_layer_ids=list(identity["aux_layer_ids"]), dtype=identity["dtype"],
        engine=identity["engine"], engine_version=engine_version,
        num_samples=counts.pop("num_samples"), num_tokens=counts.pop("num_tokens"),
        num_loss_tokens=counts.pop("num_loss_tokens"), samples_per_source=counts.pop("samples_per_source"),
        quarantined_per_reason=counts.pop("quarantined_per_reason"),
        bytes_per_token=float(hidden_bytes_per_token(identity["hidden_size"], identity["dtype"])),
        **counts, **extra, **fp8, created_at=prev_created or now, updated_at=now,
    )
    write_manifest(out_dir, m)
    return m
