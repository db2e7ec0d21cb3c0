"""Host memory for a batch's assembled hidden states, reused once nothing refers to it any more.

Regen assembles ~32 KiB per token of a large target on the engine actor's CPUs (``capture_sink``), and the
assembled memory becomes the Arrow block's buffer as it is (``regen.stage.blob_column``). Freshly allocated memory
costs a page fault and a kernel zero-fill per page on first touch, which is most of assembly's time (BENCHMARKS.md,
the actor's host path); memory that was touched before copies several times faster. So buffers are kept and lent
again, but only when nothing refers to them any more.

Each buffer is an anonymous ``mmap`` lent through ``torch.frombuffer``: the tensor's storage holds a buffer export
of the mapping (one reference to it) for as long as any tensor sharing that storage lives, whatever views, dtype
views, ``.numpy()`` arrays or Arrow buffers were built on it since. A mapping referenced by the pool alone is free.
(Tensor views are not a safe signal: a dtype view does not keep its base tensor object alive.) A mapping rather than
a ``bytearray``: a bytearray is zero-filled when it is made, page by page under the GIL in the thread that asks;
a mapping's pages are zeroed by the kernel when first written, by whichever thread writes them (the capture sink's
reader, inside a torch copy that has released the GIL).
"""

from __future__ import annotations

import mmap
import sys
import threading

import torch

GRANULE = 64 << 20
"""Sizes are rounded up to this, so batches of slightly different lengths reuse the same buffers."""


def _rounded(nbytes: int) -> int:
    """The size of the buffer that holds ``nbytes``: whole granules, at least one."""
    return max(GRANULE, -(-nbytes // GRANULE) * GRANULE)


class HostBufferPool:
    """Lends uint8 host tensors on pooled anonymous mappings; keeps at most ``max_free_bytes`` of free ones."""

    def __init__(self, max_free_bytes: int = 8 << 30) -> None:
        self.max_free_bytes = max_free_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on a pooled buffer (its old contents are not cleared)."""
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        size = _rounded(nbytes)
        with self._lock:
            free = [i for i in range(len(self._buffers)) if self._is_free(i)]
            fits = [i for i in free if len(self._buffers[i]) >= size]
            if fits:
                i = min(fits, key=lambda k: len(self._buffers[k]))
                self.reused += 1
            else:
                self._trim(free, keep=size)
                self._buffers.append(mmap.mmap(-1, size))
                i = len(self._buffers) - 1
                self.allocated += 1
            return torch.frombuffer(self._buffers[i], dtype=torch.uint8, count=nbytes)

    def _is_free(self, i: int) -> bool:
        # references to a free mapping: the pool's list and getrefcount's argument; a lent one has its export's too
        return sys.getrefcount(self._buffers[i]) <= 2

    def _trim(self, free: list[int], keep: int) -> None:
        """Drop free buffers, smallest first, until the free ones plus a new one of ``keep`` bytes fit the cap."""
        total = sum(len(self._buffers[i]) for i in free)
        drop = set()
        for i in sorted(free, key=lambda k: len(self._buffers[k])):
            if total + keep <= self.max_free_bytes:
                break
            drop.add(i)
            total -= len(self._buffers[i])
        self._buffers = [b for k, b in enumerate(self._buffers) if k not in drop]

    def prewarm(self, sizes: list[int]) -> int:
        """Add free buffers of ``sizes`` bytes with every page already touched, so the batches that take them copy at
        memory speed from their first row (a fresh page costs a fault and a kernel zero-fill: on the development CPU
        the sink placed rows 1.4-2.6x slower into fresh memory, BENCHMARKS.md). Returns the bytes added; the free-bytes
        cap grows to keep them."""
        added = 0
        for nbytes in sizes:
            size = _rounded(nbytes)
            buf = mmap.mmap(-1, size)
            torch.frombuffer(buf, dtype=torch.uint8).zero_()  # writes every page (the GIL is released meanwhile)
            with self._lock:
                self._buffers.append(buf)
            added += size
        with self._lock:
            self.max_free_bytes = max(self.max_free_bytes, sum(len(b) for b in self._buffers))
        return added

    def clear(self) -> None:
        """Forget every buffer (lent ones stay valid: their tensors keep the memory until they go)."""
        with self._lock:
            self._buffers = []

    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._buffers)
