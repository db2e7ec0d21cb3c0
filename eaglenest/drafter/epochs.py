"""Where a training worker's batches come from: Ray Data streams, kept in memory when they fit (the cache policy).

Restarting a Ray Data stream costs seconds on small data and tens of seconds a pass on large shards (the Kimi-width
GPU runs: 45-75 s an epoch reading 9 GB of fp8 states, more than the epoch's compute), which dominates many-epoch
runs and every held-out evaluation. So a worker keeps the tables of a complete pass in memory while they fit a byte
budget (:class:`TableCache`, ``train.memory_cache_gib``) and replays them afterwards; over the budget it streams as
usual.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

DEFAULT_CACHE_SHARE = 0.25
"""``train.memory_cache_gib: null``: the share of the memory available when a worker starts that it may keep (two
drafters trained side by side on one host then hold at most half of it)."""
FALLBACK_CACHE_BYTES = 512 << 20
"""The budget where the available memory cannot be read."""


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of this host (Linux), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cache_budget_bytes(memory_cache_gib: float | None, available: int | None = None) -> int:
    """The bytes a worker may keep: ``memory_cache_gib`` as configured, else :data:`DEFAULT_CACHE_SHARE` of the
    memory available now (``available``: that figure, read from the host when None)."""
    if memory_cache_gib is not None:
        return int(memory_cache_gib * 2**30)
    available = available if available is not None else available_memory_bytes()
    return int(DEFAULT_CACHE_SHARE * available) if available else FALLBACK_CACHE_BYTES


def owned_copy(table: pa.Table) -> pa.Table:
    """``table`` copied into this process's memory. A stream's tables can be views of Ray's object store: kept for a
    whole run they would pin their blocks there (two workers keeping 9 GB each fill an 18 GiB store)."""
    return table.take(np.arange(table.num_rows))


def stream_batches(shard: Any, batch_size: int, **kw: Any) -> Iterator[pa.Table]:
    """A dataset shard's batches as pyarrow tables (``kw``: Ray Data's local-shuffle options)."""
    yield from shard.iter_batches(batch_size=batch_size, batch_format="pyarrow", **kw)


class TableCache:
    """The tables of one complete pass over a stream, kept while their total size fits ``limit_bytes``.

    States: empty (not filled yet), :attr:`tables` set (a complete pass fitted), or :attr:`too_large` (a pass went
    over the budget: never tried again). A pass that stops early keeps nothing.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.tables: list[pa.Table] | None = None
        self.too_large = False

    @property
    def ready(self) -> bool:
        return self.tables is not None

    def fill(self, stream: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """Pass ``stream`` through, keeping its tables; :attr:`too_large` turns true as soon as they overflow."""
        kept: list[pa.Table] | None = [] if not self.too_large else None
        size = 0
        for table in stream:
            if kept is not None:
                size += table.nbytes
                if size <= self.limit_bytes:
                    kept.append(owned_copy(table))
                else:
                    kept, self.too_large = None, True
            yield table
        if kept is not None:
            self.tables = kept


class EvalBatches:
    """Held-out batches: streamed on the first evaluation, replayed from memory afterwards when small."""

    def __init__(self, shard: Any, batch_size: int, limit_bytes: int) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.cache = TableCache(limit_bytes)

    def __iter__(self) -> Iterator[pa.Table]:
        if self.cache.ready:
            yield from self.cache.tables
            return
        yield from self.cache.fill(stream_batches(self.shard, self.batch_size))


class TrainEpochs:
    """One epoch of training batches, streamed (locally shuffled) or, once the split is known to fit in memory,
    cut from a permutation of the kept rows.

    Kept rows are ordered by sample id and permuted with a generator seeded by (seed, epoch), so a cached epoch's
    order is a function of the data and the seed alone and a resumed run sees the same batches. A batch is gathered
    row by row from the kept tables (zero-copy slices): no epoch copies the whole split, whose binary columns can
    exceed what one Arrow array holds.
    """

    def __init__(self, shard: Any, batch_size: int, seed: int, limit_bytes: int) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.seed = seed
        self.cache = TableCache(limit_bytes)
        self._where: tuple[np.ndarray, np.ndarray] | None = None  # (table, row) of each kept row, in id order

    def _streamed(self, epoch: int) -> Iterator[pa.Table]:
        stream = stream_batches(self.shard, self.batch_size, local_shuffle_buffer_size=4 * self.batch_size,
                                local_shuffle_seed=self.seed + 1000 * epoch)
        return self.cache.fill(stream)

    def _kept_rows(self) -> tuple[np.ndarray, np.ndarray]:
        if self._where is None:
            tables = self.cache.tables or []
            table_of = np.concatenate([np.full(t.num_rows, k, dtype=np.int64) for k, t in enumerate(tables)])
            row_of = np.concatenate([np.arange(t.num_rows, dtype=np.int64) for t in tables])
            if tables and "id" in tables[0].column_names:
                ids = [i for t in tables for i in t.column("id").to_pylist()]
                order = sorted(range(len(ids)), key=ids.__getitem__)
                table_of, row_of = table_of[order], row_of[order]
            self._where = (table_of, row_of)
        return self._where

    def _cached(self) -> bool:
        return bool(self.cache.tables) and any(t.num_rows for t in self.cache.tables)  # an empty pass: nothing kept

    def epoch(self, epoch: int) -> Iterator[pa.Table]:
        if not self._cached() and not self.cache.too_large and epoch > 0:
            # resumed past epoch 0: fill the cache first, so this epoch sees the same permutation as before
            for _ in self._streamed(epoch):
                if self.cache.too_large:
                    break  # too large to keep: stop the extra pass at once and stream as usual
        if not self._cached():
            yield from self._streamed(epoch)
            return
        tables = self.cache.tables
        table_of, row_of = self._kept_rows()
        order = np.random.default_rng(self.seed + 1000 * epoch).permutation(len(table_of))
        for start in range(0, len(order), self.batch_size):
            picked = order[start:start + self.batch_size]
            yield pa.concat_tables([tables[table_of[i]].slice(int(row_of[i]), 1) for i in picked])
