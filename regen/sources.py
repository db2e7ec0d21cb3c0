"""Read the configured sources with Ray Data, normalize them, and plan the work of one run.

Planning streams every normalized row through the driver in source order (sources in config order, rows in file
order, ``preserve_order``), which makes sample caps, duplicate resolution and therefore the work list identical on
every rerun. Rows already recorded in the output folder are skipped (resume); rows that failed normalization are
written to quarantine right away; the rest is written as the run's plan (``DIR/plan/*.parquet``), one file per engine
batch so the actor pool gets many blocks to spread.

JSONL is read with ``read_text`` and parsed per line: Arrow's JSON reader rejects a whole file for one broken line
or a type change between rows, and a bad row must be quarantined, not fatal.
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

from eaglenest.config import ConfigError, SourceConfig
from regen.adapters import NORMALIZED_SCHEMA, OK, Deduplicator, normalize_records

if TYPE_CHECKING:
    from regen.output import Completed

READ_CPUS = 0.25  # fractional: on a 2-core box whole-CPU read tasks starve the engine actors (and vice versa)
PARQUET_SUFFIXES = (".parquet", ".pq")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


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


def _json_array_elements(row: dict[str, Any]) -> list[dict[str, str]]:
    """A ``.json`` file holding one array (ShareGPT dumps) -> one text line per element."""
    data = json.loads(row["bytes"])
    items = data if isinstance(data, list) else [data]
    return [{"text": json.dumps(x, ensure_ascii=False)} for x in items]


def _normalize_batch(batch: pa.Table, *, kind: str, adapter: str, source: str, domain: str) -> pa.Table:
    records = batch.column("text").to_pylist() if kind == "lines" else batch.to_pylist()
    return normalize_records(records, adapter, source=source, domain=domain)


def source_dataset(src: SourceConfig, cap: int | None) -> Any:
    """A Ray dataset of :data:`NORMALIZED_SCHEMA` rows for one source (at most ``cap`` input rows)."""
    import ray

    if src.hub_id:
        datasets = _require_datasets(src)
        split = src.split if cap is None else f"{src.split}[:{cap}]"
        ds, kind = ray.data.from_huggingface(datasets.load_dataset(src.hub_id, split=split)), "records"
    else:
        path = Path(src.path or "")
        if path.name.endswith(PARQUET_SUFFIXES):
            ds, kind = ray.data.read_parquet(str(path), num_cpus=READ_CPUS, file_extensions=None), "records"
        elif _is_json_array(path):
            ds = ray.data.read_binary_files(str(path), num_cpus=READ_CPUS, file_extensions=None)
            ds, kind = ds.flat_map(_json_array_elements, num_cpus=READ_CPUS), "lines"
        else:
            ds, kind = ray.data.read_text(str(path), num_cpus=READ_CPUS, file_extensions=None), "lines"
    if cap is not None:
        ds = ds.limit(cap)
    return ds.map_batches(_normalize_batch, batch_format="pyarrow", num_cpus=READ_CPUS, batch_size=512,
                          fn_kwargs={"kind": kind, "adapter": src.adapter, "source": src.name, "domain": src.domain})


def _is_json_array(path: Path) -> bool:
    if not path.name.endswith(".json"):
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


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
    ``ListFiles`` task that asks for a whole CPU, which on a small cluster waits behind the engine actors.
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
    from regen.output import PLAN, write_quarantine  # driver only: keeps torch out of the normalize workers

    plan_dir = out_dir / PLAN
    shutil.rmtree(plan_dir, ignore_errors=True)
    plan_dir.mkdir(parents=True)
    plan = Plan()
    for s in sources:
        for d in (plan.inputs_per_source, plan.duplicates_per_source, plan.already_done_per_source,
                  plan.planned_per_source):
            d[s.name] = 0
    dedup = Deduplicator()
    writer = _PlanWriter(plan_dir, rows_per_file)
    bad: list[dict[str, Any]] = []
    for batch in iter_normalized(sources, limit):
        for row in batch.to_pylist():
            src = row["source"]
            plan.inputs_per_source[src] += 1
            if not dedup.first(row["id"], src):
                continue
            if row["id"] in completed:
                plan.already_done_per_source[src] += 1
                continue
            if row["status"] != OK:
                bad.append({"id": row["id"], "source": src, "reason": row["status"], "detail": row["detail"],
                            "raw": row["raw"]})
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
