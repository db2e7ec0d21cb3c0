"""A ring of shared memory that carries recorded states from SGLang's scheduler process to the engine actor.

Written as chunk files, every recorded byte was copied by a writer thread into tmpfs pages allocated for it, then
mapped, copied into place and freed by the actor's reader: about 40 GB of page traffic for 20 GB of states in the
seventh GPU run, on the host whose CPU also runs the scheduler's per-step bookkeeping (its decode then ran at 0.81x of
the offline engine's pace while the context was short). With the ring, a forward's states go GPU -> ring by DMA (the
scheduler registers the ring as pinned memory), and the chunk file keeps only its header, ids and positions and says
where in the ring the states are; the reader copies them into place from pages that stay mapped, and hands the space
back. Measured on the H200 (eighth GPU run): the recording engine then decoded at 0.99x of the offline engine's pace.

Protocol (one producer, one consumer, in forward order): the scheduler's forward thread allocates each forward's
region in sequence, so ``end`` (bytes ever allocated, counting the waste skipped at the ring's end) grows with the
forward number; the reader, which takes chunks in forward order, writes the ``end`` of the last chunk it finished
with into an 8-byte control file: everything before it is free. A forward whose states do not fit (larger than the
ring, or no room within ``timeout_s``: a reader that stopped) falls back to carrying them in its chunk file.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

RING_FILE = "ring.bin"
CONTROL_FILE = "ring.ctl"
ALIGN = 64


def create_ring(folder: str | Path, nbytes: int) -> None:
    """The ring's two files in ``folder`` (the actor creates them before the engine starts; pages are allocated
    when first mapped with populate)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / RING_FILE, "wb") as f:
        f.truncate(int(nbytes))
    (folder / CONTROL_FILE).write_bytes(b"\0" * 8)


def ring_exists(folder: str | Path) -> bool:
    return (Path(folder) / RING_FILE).is_file() and (Path(folder) / CONTROL_FILE).is_file()


def _map(path: Path, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, flags=flags,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)


class RingView:
    """The ring as mapped by one process: ``data`` (all of it, uint8) and the reader's release counter."""

    def __init__(self, folder: str | Path, *, populate: bool = True) -> None:
        folder = Path(folder)
        self._map = _map(folder / RING_FILE, populate)
        self._ctl_map = _map(folder / CONTROL_FILE, False)
        self.size = len(self._map)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)
        self._released = np.frombuffer(self._ctl_map, dtype=np.uint64, count=1)
        self.pinned = False

    @property
    def released(self) -> int:
        """Bytes handed back by the reader (an aligned 8-byte load: one store by the other process is seen whole)."""
        return int(self._released[0])

    def release(self, end: int) -> None:
        """The reader is done with everything up to ``end`` (chunks are finished in forward order)."""
        self._released[0] = end

    def region(self, start: int, nbytes: int) -> torch.Tensor:
        return self.data[start:start + nbytes]

    def pin(self) -> bool:
        """Register the ring as pinned memory in this (the scheduler's) process, so the states' GPU -> ring copies are
        asynchronous DMA; False where CUDA cannot (the copies are then synchronous, still correct)."""
        if self.pinned or not self.size or not torch.cuda.is_available():
            return self.pinned
        try:
            # flags 1: cudaHostRegisterPortable (pinned for every CUDA context of the process)
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.size, 1)) == 0
        except Exception:  # noqa: BLE001 - unpinned is slower, not wrong
            self.pinned = False
        return self.pinned


class RingWriter:
    """The scheduler side: allocates each forward's region, in forward order, waiting for the reader when full."""

    def __init__(self, view: RingView, *, timeout_s: float = 30.0) -> None:
        self.view = view
        self.timeout_s = timeout_s
        self.produced = 0  # bytes ever allocated, waste at the ring's end included

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """``(start, end)`` of a region of ``nbytes`` (``end``: what the reader releases once done with it), or None:
        larger than the ring, or no room within ``timeout_s``."""
        size = self.view.size
        need = -(-int(nbytes) // ALIGN) * ALIGN
        if need > size or need == 0:
            return None
        off = self.produced % size
        waste = size - off if off + need > size else 0
        end = self.produced + waste + need
        if end - self.view.released > size:
            deadline = time.monotonic() + self.timeout_s
            while end - self.view.released > size:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.0005)
        self.produced = end
        return (0 if waste else off), end
