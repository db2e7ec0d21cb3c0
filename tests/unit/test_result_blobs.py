"""The engine stage's hidden-state columns: built from the capture's memory, copied at most once, bytes unchanged."""

from __future__ import annotations

import pickle

import pyarrow as pa
import torch

from eaglenest.contracts.shards import bytes_to_tensor, tensor_to_buffer, tensor_to_bytes
from eaglenest.regen.stage import blob_column


def test_buffer_has_the_same_bytes_as_tensor_to_bytes_and_shares_memory_when_it_can() -> None:
    t = torch.randn(5, 12).to(torch.bfloat16)
    buf = tensor_to_buffer(t, "bfloat16", states=3)
    assert bytes(buf) == tensor_to_bytes(t, "bfloat16", states=3)
    assert isinstance(buf, memoryview)
    t[0, 0] = 7.0  # a view: the capture's memory itself
    assert bytes_to_tensor(bytes(buf), "bfloat16", 12)[0, 0].item() == 7.0
    f32 = torch.randn(3, 4)
    assert bytes(tensor_to_buffer(f32, "bfloat16")) == tensor_to_bytes(f32, "bfloat16")  # converted: a copy
    assert tensor_to_buffer(f32, "float8_e4m3fn", states=2) == tensor_to_bytes(f32, "float8_e4m3fn", states=2)


def test_consecutive_views_become_the_column_buffer_without_a_copy() -> None:
    batch = torch.randn(10, 8).to(torch.bfloat16)  # one batch's assembled states, sequences back to back
    blobs = [tensor_to_buffer(batch[0:3], "bfloat16"), None, tensor_to_buffer(batch[3:10], "bfloat16")]
    col = blob_column(blobs)
    assert col.type == pa.large_binary() and col.null_count == 1
    assert col.to_pylist() == [bytes(blobs[0]), None, bytes(blobs[2])]
    assert col.buffers()[2].address == batch.data_ptr()  # zero copy
    back = pickle.loads(pickle.dumps(col))  # what the object store does with it
    del batch, blobs
    assert back.equals(col)


def test_blobs_out_of_order_or_from_bytes_are_copied_once_into_one_buffer() -> None:
    batch = torch.randn(6, 4).to(torch.bfloat16)
    blobs = [tensor_to_buffer(batch[3:6], "bfloat16"), b"", tensor_to_buffer(batch[0:3], "bfloat16"), b"\x01\x02"]
    col = blob_column(blobs)
    assert col.to_pylist() == [bytes(b) for b in blobs]
    assert col.buffers()[2].address != batch.data_ptr()
    assert blob_column([None, None]).to_pylist() == [None, None]
    assert blob_column([]).to_pylist() == []


def test_runs_broken_by_early_answers_become_chunks_without_a_copy() -> None:
    """Each sequence sits in room for its longest answer: one that ended early leaves a gap, so the column is a few
    runs of consecutive memory, each taken as it is."""
    slab = torch.randn(40, 4096).to(torch.bfloat16)  # rows of a real width: runs of ~100 KB
    spans = [(0, 2), (2, 4), (4, 5), (6, 8), (8, 10), (10, 12), (12, 14), (14, 16), (16, 18), (18, 20), (20, 22),
             (22, 24), (24, 26), (26, 28), (28, 30), (30, 32)]  # (4, 5) ended one row early
    blobs = [tensor_to_buffer(slab[a:b], "bfloat16") for a, b in spans]
    col = blob_column(blobs)
    assert isinstance(col, pa.ChunkedArray) and col.num_chunks == 2 and col.type == pa.large_binary()
    assert col.to_pylist() == [bytes(b) for b in blobs]
    assert col.chunk(0).buffers()[2].address == slab.data_ptr()  # zero copy
    assert col.chunk(1).buffers()[2].address == slab[6:8].data_ptr()
    table = pa.table({"aux_hidden_states": col})
    assert pickle.loads(pickle.dumps(table)).equals(table)  # what the object store does with it
    scattered = [tensor_to_buffer(slab[a:a + 1], "bfloat16") for a in range(0, 16, 2)]  # a gap after every blob
    assert not isinstance(blob_column(scattered), pa.ChunkedArray)  # small runs: one copy instead


def test_a_batch_whose_answers_all_ended_early_is_still_not_copied() -> None:
    """Real chats mostly end before the token limit: then every sequence is a run of its own, and copying the batch's
    states (gigabytes) would cost far more than a chunk per sequence."""
    width = 3 * 4096
    slab = torch.randn(8 * 12, width).to(torch.bfloat16)  # 8 sequences, each in room for 12 rows, each used 10
    blobs = [tensor_to_buffer(slab[12 * k:12 * k + 10], "bfloat16") for k in range(8)]
    col = blob_column(blobs)
    assert isinstance(col, pa.ChunkedArray) and col.num_chunks == 8
    assert [c.buffers()[2].address for c in col.chunks] == [slab[12 * k].data_ptr() for k in range(8)]
    assert col.to_pylist() == [bytes(b) for b in blobs]
