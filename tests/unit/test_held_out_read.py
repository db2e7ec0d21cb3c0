"""The held-out side of training's split, read directly from the shards: the same rows, in the same order, as
filtering every whole shard, while row groups without a held-out row are never decoded."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.contracts.shards import SHARD_SCHEMA
from eaglenest.drafter.data import COLUMNS, held_out_tables, is_eval_sample, split_table
from eaglenest.regen.output import write_table_atomic


def _shard(path: Path, ids: list[str]) -> Path:
    rows = [{"id": i, "source": "s", "domain": "chat", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
             "num_tokens": 3, "aux_hidden_states": bytes(600), "last_hidden_state": bytes(200), "source_id": None}
            for i in ids]
    return write_table_atomic(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), path, row_group_bytes=4000)


def test_the_same_rows_in_file_order_as_filtering_every_shard(tmp_path) -> None:
    files = [_shard(tmp_path / f"part-{k}.parquet", [f"s{k}-{i}" for i in range(40)]) for k in range(3)]
    assert pq.ParquetFile(str(files[0])).num_row_groups > 3  # the case worth reading by row group
    got = held_out_tables(files, 0.2, 0)
    want = [split_table(pq.read_table(str(f), columns=COLUMNS), fraction=0.2, seed=0, want_eval=True) for f in files]
    assert [t.column("id").to_pylist() for t in got] == [t.column("id").to_pylist() for t in want]
    assert all(t.column_names == COLUMNS for t in got)
    assert sum(t.num_rows for t in got) > 0


def test_a_shard_without_held_out_rows_gives_an_empty_table_of_the_columns(tmp_path) -> None:
    ids = [i for i in (f"r{n}" for n in range(200)) if not is_eval_sample(i, 0.05, 0)][:30]
    (table,) = held_out_tables([_shard(tmp_path / "part.parquet", ids)], 0.05, 0)
    assert table.num_rows == 0 and table.column_names == COLUMNS
