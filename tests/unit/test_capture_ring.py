"""The ring that carries recorded states from SGLang's scheduler to the engine actor (``engines.capture_ring``): regions
in forward order, wrapping at the end, waiting for the reader's release, and the fallbacks that keep a stopped reader
or an oversized forward from hanging the scheduler."""

from __future__ import annotations

import threading
import time

import torch

from eaglenest.engines.sglang.capture_ring import ALIGN, RingView, RingWriter, create_ring


def test_regions_follow_each_other_wrap_and_wait_for_the_reader(tmp_path) -> None:
    create_ring(tmp_path, 1024)
    writer, reader = RingWriter(RingView(tmp_path), timeout_s=5), RingView(tmp_path)
    assert writer.allocate(100) == (0, 128)  # aligned to 64 bytes
    assert writer.allocate(500) == (128, 640)
    assert writer.allocate(300) == (640, 960)
    # 100 more bytes do not fit before the end: the 64 left are skipped, and the region starts over at 0 once the
    # reader has handed back enough of the ring
    released = threading.Event()

    def read_later() -> None:
        time.sleep(0.2)
        reader.release(640)
        released.set()

    threading.Thread(target=read_later).start()
    t0 = time.monotonic()
    assert writer.allocate(100) == (0, 1024 + 128)
    assert released.is_set() and time.monotonic() - t0 >= 0.15  # it waited for the release
    # what one process writes into a region, the other maps and sees
    writer.view.region(0, 8).copy_(torch.arange(8, dtype=torch.uint8))
    assert reader.region(0, 8).tolist() == list(range(8))


def test_a_full_ring_or_an_oversized_forward_falls_back_instead_of_hanging(tmp_path) -> None:
    create_ring(tmp_path, 4 * ALIGN)
    writer = RingWriter(RingView(tmp_path), timeout_s=0.1)
    assert writer.allocate(5 * ALIGN) is None  # larger than the ring: its states go in its chunk file
    assert writer.allocate(4 * ALIGN) == (0, 4 * ALIGN)
    t0 = time.monotonic()
    assert writer.allocate(ALIGN) is None  # nobody reads: given up after timeout_s, the scheduler goes on
    assert 0.1 <= time.monotonic() - t0 < 5
    assert writer.produced == 4 * ALIGN  # a refused region takes no space
    writer.view.release(4 * ALIGN)
    assert writer.allocate(ALIGN) == (0, 5 * ALIGN)


def test_the_ring_is_not_pinned_without_cuda(tmp_path) -> None:
    create_ring(tmp_path, 1024)
    view = RingView(tmp_path)
    assert view.pin() is torch.cuda.is_available()
    assert view.size == 1024 and view.released == 0
