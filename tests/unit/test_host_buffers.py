"""HostBufferPool: a buffer is lent again only when nothing built on it (views, arrays, Arrow columns) is left."""

from __future__ import annotations

import gc

import torch

from eaglenest.contracts.shards import tensor_to_buffer
from eaglenest.engines.sglang.host_buffers import GRANULE, HostBufferPool
from eaglenest.regen.stage import blob_column


def _states(pool: HostBufferPool, rows: int, width: int) -> torch.Tensor:
    return pool.take(rows * width * 2).view(torch.bfloat16).view(rows, width)


def test_a_buffer_in_use_is_never_lent_and_a_released_one_is_reused() -> None:
    pool = HostBufferPool()
    a = _states(pool, 64, 32)
    a.fill_(1.0)
    b = _states(pool, 64, 32)  # a is still held: new memory
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    ptr = a.data_ptr()
    del a
    c = _states(pool, 64, 32)
    assert c.data_ptr() == ptr and pool.reused == 1
    assert b.data_ptr() != c.data_ptr()


def test_arrow_columns_built_on_the_memory_keep_it_lent() -> None:
    pool = HostBufferPool()
    aux = _states(pool, 10, 8)
    aux.copy_(torch.arange(80, dtype=torch.float32).view(10, 8))
    col = blob_column([tensor_to_buffer(aux[0:4], "bfloat16"), tensor_to_buffer(aux[4:10], "bfloat16")])
    assert col.buffers()[2].address == aux.data_ptr()  # zero copy: the column is the pooled memory
    want = col.to_pylist()
    del aux  # only the column refers to the memory now
    gc.collect()
    other = _states(pool, 10, 8)
    other.fill_(-7.0)  # must not land in the column's memory
    assert col.to_pylist() == want and pool.allocated == 2
    del col, other
    gc.collect()
    _states(pool, 10, 8)
    assert pool.reused == 1


def test_free_buffers_beyond_the_cap_are_dropped() -> None:
    pool = HostBufferPool(max_free_bytes=2 * GRANULE)
    held = [pool.take(GRANULE) for _ in range(3)]
    assert pool.pooled_bytes() == 3 * GRANULE
    del held
    big = pool.take(3 * GRANULE)  # no free one fits: the three small free ones go, then a new one
    assert pool.pooled_bytes() == 3 * GRANULE and big.numel() == 3 * GRANULE


def test_the_sink_reuses_memory_only_after_a_batchs_captures_are_gone(tmp_path) -> None:
    from eaglenest.engines.sglang.capture_sink import CaptureSink
    from eaglenest.engines.sglang.hooks import write_chunk

    h = 4
    sink = CaptureSink(tmp_path, hidden_size=h)

    def batch(seq: int, rid: str, fill: float):
        ids = torch.arange(1, 7)
        write_chunk(tmp_path, seq, [rid], [6], ids, torch.arange(6), torch.full((6, 4 * h), fill).to(torch.bfloat16))
        sink.poll()
        (cap, why), = sink.assemble_many([(rid, ids.tolist(), [1] * 6)])
        assert cap is not None, why
        return cap

    a = batch(0, "a", 1.0)
    b = batch(1, "b", 2.0)  # a is held: b must not overwrite it
    assert float(a.aux_hidden_states.float().mean()) == 1.0 and float(b.last_hidden_state.float().mean()) == 2.0
    assert sink.buffers.reused == 0
    del a
    gc.collect()
    c = batch(2, "c", 3.0)
    assert sink.buffers.reused == 2  # a's aux and final-state buffers
    assert float(b.aux_hidden_states.float().mean()) == 2.0 and float(c.aux_hidden_states.float().mean()) == 3.0
    sink.close()


def test_clear_forgets_the_pool_but_lent_memory_stays_valid() -> None:
    pool = HostBufferPool()
    a = _states(pool, 8, 8)
    a.fill_(5.0)
    pool.clear()
    assert pool.pooled_bytes() == 0 and float(a.float().mean()) == 5.0


def test_prewarmed_buffers_are_lent_first_and_kept_beyond_the_free_cap() -> None:
    pool = HostBufferPool(max_free_bytes=GRANULE)
    assert pool.prewarm([GRANULE, 2 * GRANULE + 1]) == 4 * GRANULE
    assert pool.pooled_bytes() == 4 * GRANULE and pool.max_free_bytes == 4 * GRANULE  # not trimmed away
    small = pool.take(GRANULE // 2)  # the smallest that fits
    big = pool.take(3 * GRANULE)
    assert pool.allocated == 0 and pool.reused == 2 and small.numel() == GRANULE // 2
    big[:8] = 5
    del small, big


def test_the_sink_prewarms_what_its_reservations_take(tmp_path) -> None:
    from eaglenest.engines.sglang.capture_sink import CaptureSink

    sink = CaptureSink(tmp_path, hidden_size=64, n_aux=3, dtype=torch.bfloat16,
                       reserve_max_bytes=3 * 1000 * 4 * 64 * 2)
    assert sink.prewarm(rows_per_batch=1000, batches=5) == 6 * GRANULE  # capped at 3 batches: 2 buffers each
    assert sink.reserve(["a", "b"], [400, 600])  # one batch of 1000 rows: served by prewarmed memory
    assert sink.buffers.allocated == 0 and sink.buffers.reused == 2
    sink.close()
