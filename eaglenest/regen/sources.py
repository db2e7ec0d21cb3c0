"""Read the configured sources with Ray Data, normalize them, and plan the work of one run.

Planning streams every normalized row through the driver in source order (sources in config order, rows in file
order, ``preserve_order``), which makes sample caps, duplicate resolution and therefore the work list identical on
every rerun. Rows already recorded in the output folder are skipped (resume); rows that failed normalization are
written to quarantine right away; the rest is written as the run's plan (``DIR/plan/*.parquet``), one file per engine
batch so the actor pool gets many blocks to spread.

Files are read incrementally in one Ray Data read task per source (:mod:`regen.readers`: JSONL by line, JSON arrays
by element, parquet by row group), normalized as they are read, and reading stops at the source's cap: memory is
bounded by a block of records, not the file, and a damaged file yields the records before the damage plus one
``damaged_source`` quarantine row instead of an exception.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from eaglenest.config import ConfigError, SourceConfig
from eaglenest.regen.formats import (
    DAMAGED_SOURCE,
    INVALID_JSON,
    NORMALIZED_SCHEMA,
    OK,
    Deduplicator,
    bad_row,
    damage_row,
    normalize_record,
)
from eaglenest.regen.readers import JSON_SUFFIXES, PARQUET_SUFFIXES, Damage, Item, iter_file, iter_rows

if TYPE_CHECKING:
    from eaglenest.regen.output import Completed

READ_CPUS = 0.25  # fractional: on a 2-core box whole-CPU read tasks starve the engine actors (and vice versa)
BLOCK_ROWS = 256  # records per block out of the read task
BLOCK_BYTES = 8 << 20  # ... or fewer, once their raw text reaches this size


class SourceError(ConfigError):
    """A source that cannot be read at all (missing file, unsupported format, hub loader not installed)."""


def check_sources(sources: list[SourceConfig]) -> None:
    """Fail before any work starts: names unique, files present, hub sources loadable."""
    if not sources:
        raise SourceError("regen has no sources: set regen.sources or regen.sources_file (see configs/sources.yaml)")
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SourceError(f"source names must be unique; repeated: {', '.join(dup)}")
    for s in sources:
        if s.hub_id:
            _require_datasets(s)
        else:
            p = Path(s.path or "")
            if not p.is_file():
                raise SourceError(f"source {s.name!r}: file {p} does not exist (paths in a sources file are "
                                  "relative to that file)")
            if not p.name.endswith(PARQUET_SUFFIXES + JSON_SUFFIXES):
                raise SourceError(f"source {s.name!r}: {p.name} is not .jsonl/.json/.parquet; convert it to one")


def _require_datasets(s: SourceConfig) -> Any:
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"source {s.name!r} reads the hub dataset {s.hub_id!r}, but the `datasets` package is not installed. "
            f"Either `pip install datasets` (and `huggingface-cli login` for gated sets), or download the "
            f"{s.split!r} split to a local .jsonl or .parquet file and give the source `path:` instead of `hub_id:`"
        ) from None
    return datasets


def normalized_blocks(src: SourceConfig, cap: int | None, rows_per_block: int = BLOCK_ROWS) -> Iterator[pa.Table]:
    """Read one source incrementally and normalize as it goes: small :data:`NORMALIZED_SCHEMA` tables.

    Runs inside the read task; memory is one block of records, whatever the file's size. A damaged file ends with
    one ``damaged_source`` row (file, byte offset, the parser's message) after the rows read before the damage.
    """
    name = src.hub_id or Path(src.path or "").name
    if src.hub_id:
        split = src.split if cap is None else f"{src.split}[:{cap}]"
        items: Iterator[Item] = iter_rows(_require_datasets(src).load_dataset(src.hub_id, split=split), name, cap)
    else:
        items = iter_file(src.path or "", cap)
    rows: list[dict[str, Any]] = []
    size = 0
    for item in items:
        if isinstance(item, Damage):
            rows.append(damage_row(src.name, src.domain, file=item.file, offset=item.offset, message=item.message,
                                   records_before=item.records_before))
            break
        if item.error is not None:
            row = bad_row(item.value, src.name, src.domain, INVALID_JSON, item.error, f"{name}#{item.index}")
        else:
            row = normalize_record(item.value, src.adapter, source=src.name, domain=src.domain,
                                   fallback_id=f"{name}#{item.index}", where=item.where)
        rows.append(row)
        size += len(row["raw"] or "")
        if len(rows) >= rows_per_block or size >= BLOCK_BYTES:
            yield pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA)
            rows, size = [], 0
    if rows:
        yield pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA)


class SourceDatasource(Datasource):
    """One read task per source that streams its records (see :mod:`eaglenest.regen.readers`) and normalizes them.

    One task keeps file order and lets the reader stop at the cap; Ray Data stores each yielded block as it comes,
    so the worker never holds more than one block.
    """

    def __init__(self, src: SourceConfig, cap: int | None):
        super().__init__()
        self.src, self.cap = src, cap

    def get_name(self) -> str:
        return "ReadSource"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        src, cap = self.src, self.cap
        files = [src.path] if src.path else []
        meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=files)
        return [ReadTask(lambda: normalized_blocks(src, cap), meta, schema=NORMALIZED_SCHEMA,
                         per_task_row_limit=per_task_row_limit)]


def source_dataset(src: SourceConfig, cap: int | None) -> Any:
    """A Ray dataset of :data:`NORMALIZED_SCHEMA` rows for one source (at most ``cap`` input records read)."""
    import ray

    return ray.data.read_datasource(SourceDatasource(src, cap), num_cpus=READ_CPUS, override_num_blocks=1)


def damage_line(d: dict[str, Any]) -> str:
    """What the operator reads about a damaged source (log, summary)."""
    return (f"DAMAGED source {d['source']!r}: {d['file']} stops being readable at byte {d['offset']} "
            f"({d['message']}); the {d['records_before']} record(s) before it were used, the rest of the file was "
            "not read (quarantined once as damaged_source)")


# ---------------------------------------------------------------------------------------------------- planning
@dataclass
class Plan:
    """What one run will do, and what it found in the inputs."""

    files: list[str] = field(default_factory=list)
    planned: int = 0
    inputs_per_source: dict[str, int] = field(default_factory=dict)
    duplicates_per_source: dict[str, int] = field(default_factory=dict)
    already_done_per_source: dict[str, int] = field(default_factory=dict)
    planned_per_source: dict[str, int] = field(default_factory=dict)
    quarantined_now: dict[tuple[str, str], int] = field(default_factory=dict)
    plan_ids: list[str] = field(default_factory=list)
    damaged: list[dict[str, Any]] = field(default_factory=list)  # {source, file, offset, message, records_before}
    notes_per_source: dict[str, dict[str, int]] = field(default_factory=dict)  # normalization notes (not quarantine)


class _PlanWriter:
    def __init__(self, plan_dir: Path, rows_per_file: int):
        self.dir, self.rows_per_file = plan_dir, rows_per_file
        self.buf: list[dict[str, Any]] = []
        self.files: list[str] = []

    def add(self, row: dict[str, Any]) -> None:
        self.buf.append(row)
        if len(self.buf) >= self.rows_per_file:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        import pyarrow.parquet as pq

        path = self.dir / f"part-{len(self.files):06d}.parquet"
        pq.write_table(pa.Table.from_pylist(self.buf, schema=NORMALIZED_SCHEMA), path)
        self.files.append(str(path))
        self.buf = []


@contextlib.contextmanager
def data_context(**options: Any) -> Iterator[Any]:
    """Set DataContext options for one execution and restore them (the context is process-global).

    ``use_datasource_v2=False`` keeps ``read_parquet`` on one fractional-CPU read task per file: the V2 path adds a
    ``ListFiles`` task that asks for a whole CPU, which on a small cluster waits behind the engine actors (an
    internal DataContext field: listed in :mod:`eaglenest.ray_private`).
    """
    from ray.data import DataContext

    ctx = DataContext.get_current()
    targets = {k: (ctx.execution_options if k == "preserve_order" else ctx) for k in options}
    saved = {k: getattr(t, k) for k, t in targets.items()}
    for k, v in options.items():
        setattr(targets[k], k, v)
    try:
        yield ctx
    finally:
        for k, v in saved.items():
            setattr(targets[k], k, v)


def iter_normalized(sources: list[SourceConfig], limit: int | None) -> Iterator[pa.Table]:
    """Normalized rows of every source, in source order then file order (deterministic across runs).

    One small Ray Data execution per source, in config order: a single union of all sources makes dozens of
    operators share the cluster's CPU budget, which on small clusters is slower than running them in turn.
    """
    with data_context(preserve_order=True, use_datasource_v2=False):
        for s in sources:
            caps = [c for c in (s.max_samples, limit) if c is not None]
            ds = source_dataset(s, min(caps) if caps else None)
            yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


def build_plan(sources: list[SourceConfig], out_dir: Path, *, limit: int | None, completed: Completed,
               rows_per_file: int) -> Plan:
    """Dedup, skip completed ids, quarantine bad rows now, write the plan files for the engine stage."""
    from eaglenest.regen.output import PLAN, write_quarantine  # driver only: keeps torch out of the normalize workers

    plan_dir = out_dir / PLAN
    shutil.rmtree(plan_dir, ignore_errors=True)
    plan_dir.mkdir(parents=True)
    plan = Plan()
    for s in sources:
        for d in (plan.inputs_per_source, plan.duplicates_per_source, plan.already_done_per_source,
                  plan.planned_per_source):
            d[s.name] = 0
        plan.notes_per_source[s.name] = {"leading_turns_dropped": 0, "empty_exchanges_dropped": 0}
    dedup = Deduplicator()
    writer = _PlanWriter(plan_dir, rows_per_file)
    bad: list[dict[str, Any]] = []
    for batch in iter_normalized(sources, limit):
        for row in batch.to_pylist():
            src = row["source"]
            if row["status"] == DAMAGED_SOURCE:  # not an input record: where the file stopped being readable
                plan.damaged.append({"source": src, **json.loads(row["raw"])})
            else:
                plan.inputs_per_source[src] += 1
                if not dedup.first(row["id"], src):
                    continue
                notes = plan.notes_per_source[src]
                notes["leading_turns_dropped"] += bool(row["leading_turns_dropped"])
                notes["empty_exchanges_dropped"] += row["empty_exchanges_dropped"] or 0
            if row["id"] in completed:
                plan.already_done_per_source[src] += 1
                continue
            if row["status"] != OK:
                bad.append({"id": row["id"], "source": src, "reason": row["status"], "detail": row["detail"],
                            "raw": row["raw"], "source_id": row["source_id"]})
                key = (src, row["status"])
                plan.quarantined_now[key] = plan.quarantined_now.get(key, 0) + 1
                continue
            writer.add(row)
            plan.planned_per_source[src] += 1
            plan.plan_ids.append(row["id"])
    writer.flush()
    plan.duplicates_per_source.update(dedup.duplicates)
    for start in range(0, len(bad), 5000):
        write_quarantine(pa.Table.from_pylist(bad[start:start + 5000]), out_dir, "normalize")
    plan.files, plan.planned = writer.files, len(plan.plan_ids)
    return plan
