"""Where a training worker's batches come from: Ray Data streams, kept in memory when small (the cache policy).

Restarting a Ray Data stream costs seconds, which dominates many-epoch runs over small data (the demo) and every
held-out evaluation. So a worker keeps the tables of a complete pass in memory while they fit a byte budget
(:class:`TableCache`) and replays them afterwards; over the budget it streams as usual.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa


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
                    kept.append(table)
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

    Kept rows are sorted by sample id and permuted with a generator seeded by (seed, epoch), so a cached epoch's
    order is a function of the data and the seed alone and a resumed run sees the same batches.
    """

    def __init__(self, shard: Any, batch_size: int, seed: int, limit_bytes: int) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.seed = seed
        self.cache = TableCache(limit_bytes)
        self._rows: pa.Table | None = None

    def _streamed(self, epoch: int) -> Iterator[pa.Table]:
        stream = stream_batches(self.shard, self.batch_size, local_shuffle_buffer_size=4 * self.batch_size,
                                local_shuffle_seed=self.seed + 1000 * epoch)
        return self.cache.fill(stream)

    def _kept_rows(self) -> pa.Table:
        if self._rows is None:
            table = pa.concat_tables(self.cache.tables)
            self._rows = table.sort_by("id") if "id" in table.column_names else table
        return self._rows

    def _cached(self) -> bool:
        return bool(self.cache.tables)  # an empty pass keeps nothing worth replaying

    def epoch(self, epoch: int) -> Iterator[pa.Table]:
        if not self._cached() and not self.cache.too_large and epoch > 0:
            # resumed past epoch 0: fill the cache first, so this epoch sees the same permutation as before
            for _ in self._streamed(epoch):
                if self.cache.too_large:
                    break  # too large to keep: stop the extra pass at once and stream as usual
        if not self._cached():
            yield from self._streamed(epoch)
            return
        rows = self._kept_rows()
        order = np.random.default_rng(self.seed + 1000 * epoch).permutation(rows.num_rows)
        shuffled = rows.take(order)
        for start in range(0, shuffled.num_rows, self.batch_size):
            yield shuffled.slice(start, self.batch_size)
