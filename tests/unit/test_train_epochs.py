"""A training worker's batch source (eaglenest.drafter.epochs): the first pass streams and keeps its tables when
they fit the budget, later epochs replay them in a seeded permutation by sample id (no Ray Data restart), and kept
tables are the worker's own copies. The shard here is a table served in batches the way Ray Data's iterator serves
them (``iter_batches`` with local-shuffle options); the Ray Train worker uses these classes on the real iterator in
tests/e2e/test_drafter_train.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.drafter.epochs import (
    DEFAULT_CACHE_SHARE,
    FALLBACK_CACHE_BYTES,
    EvalBatches,
    TrainEpochs,
    available_memory_bytes,
    cache_budget_bytes,
    owned_copy,
)

ROWS = 23


class TableShard:
    """Serves one table in batches, shuffled per seed, counting the passes it was asked for."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.passes = 0

    def iter_batches(self, batch_size: int, batch_format: str, local_shuffle_buffer_size: int | None = None,
                     local_shuffle_seed: int | None = None) -> Iterator[pa.Table]:
        assert batch_format == "pyarrow"
        self.passes += 1
        t = self.table
        if local_shuffle_seed is not None:
            t = t.take(np.random.default_rng(local_shuffle_seed).permutation(t.num_rows))
        for start in range(0, t.num_rows, batch_size):
            yield t.slice(start, batch_size)


def rows_table(n: int = ROWS) -> pa.Table:
    ids = [f"s{i:03d}" for i in np.random.default_rng(0).permutation(n)]  # stored out of id order
    return pa.table({"id": ids, "payload": [sid.encode() * 50 for sid in ids]})


def epoch_ids(epochs: TrainEpochs, e: int) -> list[str]:
    out: list[str] = []
    for t in epochs.epoch(e):
        assert t.num_rows <= 4
        assert t.column("payload").to_pylist() == [sid.encode() * 50 for sid in t.column("id").to_pylist()]
        out += t.column("id").to_pylist()
    return out


def test_epochs_after_the_first_replay_memory_in_a_seeded_order() -> None:
    shard = TableShard(rows_table())
    epochs = TrainEpochs(shard, 4, seed=7, limit_bytes=1 << 30)
    seen = [epoch_ids(epochs, e) for e in range(3)]
    assert shard.passes == 1  # epochs 1 and 2 came from memory
    for ids in seen:
        assert Counter(ids) == Counter(rows_table().column("id").to_pylist())  # every row once an epoch
    assert seen[1] != seen[2]  # a new permutation each epoch
    # a resumed run (a fresh worker starting at epoch 2) sees the same batches: the order is data + seed alone
    resumed_shard = TableShard(rows_table().take(np.arange(ROWS)[::-1]))  # the stream delivers another order
    resumed = TrainEpochs(resumed_shard, 4, seed=7, limit_bytes=1 << 30)
    assert epoch_ids(resumed, 2) == seen[2]
    assert resumed_shard.passes == 1  # the filling pass, then memory
    assert epoch_ids(TrainEpochs(TableShard(rows_table()), 4, seed=8, limit_bytes=1 << 30), 2) != seen[2]


def test_a_split_over_the_budget_streams_every_epoch() -> None:
    shard = TableShard(rows_table())
    epochs = TrainEpochs(shard, 4, seed=7, limit_bytes=rows_table().nbytes // 2)
    for e in range(3):
        assert Counter(epoch_ids(epochs, e)) == Counter(rows_table().column("id").to_pylist())
    assert shard.passes == 3 and epochs.cache.too_large
    never = TableShard(rows_table())
    zero = TrainEpochs(never, 4, seed=7, limit_bytes=cache_budget_bytes(0))  # memory_cache_gib: 0 always streams
    for e in range(2):
        epoch_ids(zero, e)
    assert never.passes == 2


def test_held_out_batches_stream_once_then_replay() -> None:
    shard = TableShard(rows_table())
    held = EvalBatches(shard, 4, 1 << 30)
    first = [t.column("id").to_pylist() for t in held]
    assert [t.column("id").to_pylist() for t in held] == first and shard.passes == 1


def test_kept_tables_are_the_workers_own_copies() -> None:
    source = rows_table()
    copy = owned_copy(source)
    assert copy.equals(source)

    def addresses(t: pa.Table) -> set[int]:
        return {b.address for col in t.columns for chunk in col.chunks for b in chunk.buffers() if b is not None}

    assert not addresses(copy) & addresses(source)
    assert addresses(source.slice(0, ROWS)) & addresses(source)  # control: a view shares them, and is seen to
    epochs = TrainEpochs(TableShard(source), 4, seed=1, limit_bytes=1 << 30)
    streamed = list(epochs.epoch(0))
    kept = epochs.cache.tables
    assert kept is not None and len(kept) == len(streamed)
    assert all(not addresses(k) & addresses(s) for k, s in zip(kept, streamed, strict=True))


def test_the_budget_is_configured_or_a_share_of_available_memory(tmp_path: Path) -> None:
    assert cache_budget_bytes(1.5) == int(1.5 * 2**30)
    assert cache_budget_bytes(0) == 0
    assert cache_budget_bytes(None, available=40 << 30) == int(DEFAULT_CACHE_SHARE * (40 << 30))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n")
    assert available_memory_bytes(meminfo) == 16000000 * 1024
    meminfo.write_text("garbage\n")
    assert available_memory_bytes(meminfo) is None
    assert available_memory_bytes(tmp_path / "missing") is None


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads Linux's /proc/meminfo")
def test_the_default_budget_reads_this_host() -> None:
    avail = available_memory_bytes()
    assert avail is not None and avail > 0
    assert cache_budget_bytes(None) > FALLBACK_CACHE_BYTES or avail < 4 * FALLBACK_CACHE_BYTES
