"""The pieces of recorded states the engine actor's sink works with: a chunk file as read (:func:`read_chunk`), a
reserved batch's slab of rows (:class:`Slab`), the per-sequence views cut from slabs (:func:`states_from_slabs`), and
what the reader reports (:class:`ReaderStats`). Kept apart from ``capture_sink`` (the reader thread and its
bookkeeping under one lock) because none of this touches the sink's state.
"""

from __future__ import annotations

import bisect
import itertools
import json
import struct
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest.contracts.states import unread_state_positions
from eaglenest.engines.base import Capture
from eaglenest.engines.sglang.capture_ring import RingView
from eaglenest.engines.sglang.hooks import ALIGN


class CaptureSinkError(RuntimeError):
    """The scheduler-side recorder failed (its traceback is in the message)."""


@dataclass
class ReaderStats:
    """What the sink's reader did since it was last asked: why a finished batch may still wait for its rows (is the
    reader behind the scheduler's writes, or slow to place them?)."""

    chunks: int = 0
    bytes: int = 0
    placing_s: float = 0.0  # reading + placing, summed
    lag_sum_s: float = 0.0  # a chunk file's age when read (written by the scheduler -> read here)
    lag_max_s: float = 0.0
    write_lag_sum_s: float = 0.0  # its forward -> its file written (the scheduler's writers; chunks that say when)
    write_lag_max_s: float = 0.0
    write_lag_n: int = 0
    scheduler: dict[str, float] | None = None  # recording's cost to the scheduler so far, as the latest chunk says

    def line(self) -> str:
        if not self.chunks:
            line = "reader: no chunk since the last batch"
        else:
            line = (f"reader: {self.chunks} chunks, {self.bytes / 1e9:.2f} GB, {self.placing_s:.2f} s reading and "
                    f"placing ({self.bytes / 1e9 / max(self.placing_s, 1e-9):.2f} GB/s), chunk age when read mean "
                    f"{self.lag_sum_s / self.chunks:.3f} s, max {self.lag_max_s:.3f} s")
        if self.write_lag_n:
            line += (f"; written after their forward mean {self.write_lag_sum_s / self.write_lag_n:.3f} s, max "
                     f"{self.write_lag_max_s:.3f} s")
        if self.scheduler:
            c = self.scheduler
            line += (f"; scheduler so far: {c.get('hooks_s', 0.0):.2f} s in the hooks, {c.get('blocked_s', 0.0):.2f} s "
                     f"of it waiting for a writer or the ring, writers pinning memory {c.get('pinning_s', 0.0):.2f} s")
            if c.get("decode_steps"):
                line += (f"; decode steps on the scheduler's thread: {c['decode_launch_ms']:.1f} ms launching the "
                         f"layers, {c['decode_between_ms']:.1f} ms between steps (mean of {int(c['decode_steps'])})")
            if "ring_pinned" in c:
                line += (f"; ring {'pinned' if c['ring_pinned'] else 'NOT pinned (synchronous copies)'}, set up in "
                         f"{c.get('ring_setup_s', 0.0):.2f} s, {int(c.get('ring_fallbacks', 0))} forwards through "
                         f"chunk files instead")
        return line


@dataclass
class Chunk:
    """One forward's rows: the request of each row (as a list of ``(rid, count)`` runs), positions, ids, states."""

    runs: list[tuple[str, int]]
    positions: torch.Tensor  # [rows] int64
    ids: torch.Tensor  # [rows] int64
    states: torch.Tensor  # [rows, width]
    forward_at: float | None = None  # when its forward recorded it (wall clock), if the writer said
    scheduler: dict[str, float] | None = None  # recording's cost to the scheduler up to that forward, if it said
    ring_end: int | None = None  # its states are a view of the ring: hand the space back (up to here) once done


def read_chunk(path: Path, ring: RingView | None = None) -> Chunk:
    """One chunk file, mapped rather than read (on /dev/shm the states are never copied; the mapping outlives the
    file's deletion and goes when the tensors do); states the writer put in the ring are a view of it."""
    size = path.stat().st_size
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    (hlen,) = struct.unpack("<Q", raw[:8].numpy().tobytes())
    head = json.loads(raw[8:8 + hlen].numpy().tobytes())
    rows, width, dtype = int(head["rows"]), int(head["width"]), getattr(torch, head["dtype"])
    off = 8 + hlen
    ids = raw[off:off + 4 * rows].view(torch.int32).long()
    positions = raw[off + 4 * rows:off + 8 * rows].view(torch.int32).long()
    nbytes = rows * width * dtype.itemsize
    region = head.get("ring")
    if region is not None:
        if ring is None:
            raise CaptureSinkError(f"chunk {path.name} has its states in a ring this sink does not have")
        states = ring.region(int(region[0]), nbytes).view(dtype).view(rows, width)
    else:
        off += 8 * rows + (-(8 * rows) % ALIGN)
        states = raw[off:off + nbytes].view(dtype).view(rows, width)
    return Chunk(list(zip(head["rids"], head["counts"], strict=True)), positions, ids, states, head.get("forward_at"),
                 head.get("scheduler"), int(region[1]) if region is not None else None)


def zero_rows(rows: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Zero ``rows`` of each tensor, row by row: a boolean-mask assignment would pass over every byte of them."""
    if rows.numel():
        for t in tensors:
            t.index_fill_(0, rows, 0)


@dataclass
class Slab:
    """A reserved batch's states: request ``r`` owns rows ``[offset_r, offset_r + capacity_r)``, row ``p`` of which is
    its position ``p``; ``ids`` holds each placed row's recorded input id (-1: nothing recorded there)."""

    aux: torch.Tensor  # [rows, width - hidden]
    last: torch.Tensor  # [rows, hidden]
    ids: torch.Tensor  # [rows] int32
    nbytes: int
    live: int  # requests not released yet



def states_from_slabs(items: Sequence[tuple[int, str, Sequence[int], Sequence[int], str | None,
                                            tuple[Slab, int, int]]]) -> dict[int, tuple[Capture | None, str]]:
    """Reserved requests' sequences, ``(key, rid, ids, loss_mask, overflow, slot)`` each: views of their slab rows,
    checked as ``CaptureSink.assemble_many`` checks. Positions nothing recorded are zeroed (reused memory holds an
    earlier batch's rows).

    Outside the sink's lock: the caller's batch owns these slabs (their rows are all in, and the reader only
    writes other batches' rows meanwhile), so at the end of a regen wave a dozen batches assemble side by side
    instead of one after another. A whole batch costs a handful of tensor calls per slab, not several per
    sequence: most torch calls release the GIL, and then a dozen batch threads and SGLang's output loop want it at
    once, so every release can wait out a switch interval (a few ms) before the call returns.
    """
    out: dict[int, tuple[Capture | None, str]] = {}
    by_slab: dict[int, list[tuple[int, str, Sequence[int], Sequence[int], int, int]]] = defaultdict(list)
    slabs: dict[int, Slab] = {}
    for key, rid, ids, mask, overflow, (slab, off, cap) in items:
        if overflow is not None:
            out[key] = (None, overflow)
            continue
        slabs[id(slab)] = slab
        by_slab[id(slab)].append((key, rid, ids, mask, off, cap))
    for sid, group in by_slab.items():
        out.update(_from_slab(slabs[sid], group))
    return out

def _from_slab(slab: Slab, group: list[tuple[int, str, Sequence[int], Sequence[int], int, int]]
               ) -> dict[int, tuple[Capture | None, str]]:
    """:func:`states_from_slabs` for the requests of one slab."""
    lengths = [min(len(ids), cap) for _, _, ids, _, _, cap in group]
    rows: list[int] = []
    want: list[int] = []
    for (_, _, ids, _, off, _), n in zip(group, lengths, strict=True):
        rows.extend(range(off, off + n))
        want.extend(ids[:n])
    rows_t = torch.tensor(rows, dtype=torch.long)
    rec = slab.ids[rows_t]
    recorded = rec >= 0
    wrong = (recorded & (rec != torch.tensor(want, dtype=torch.int32))).nonzero().flatten().tolist()
    gone = (~recorded).nonzero().flatten()
    seg_start = list(itertools.accumulate(lengths, initial=0))
    first_wrong: dict[int, int] = {}  # group index -> its first position computed with another token
    for i in wrong:
        g = bisect.bisect_right(seg_start, i) - 1
        first_wrong.setdefault(g, i - seg_start[g])
    unrecorded: dict[int, list[int]] = defaultdict(list)
    for i in gone.tolist():
        g = bisect.bisect_right(seg_start, i) - 1
        unrecorded[g].append(i - seg_start[g])
    if gone.numel():
        zero_rows(rows_t[gone], slab.aux, slab.last)
    out: dict[int, tuple[Capture | None, str]] = {}
    wa, wl = slab.aux.shape[1], slab.last.shape[1]
    for g, ((key, rid, ids, mask, off, _), n) in enumerate(zip(group, lengths, strict=True)):
        if g in first_wrong:
            at = first_wrong[g]
            out[key] = (None, f"request {rid} computed token {int(slab.ids[off + at])} at position {at}, the "
                              f"sequence has {int(ids[at])}")
            continue
        t = len(ids)
        unread = unread_state_positions(t, mask)
        missing = [i for i in unrecorded.get(g, []) + list(range(n, t)) if i not in unread]
        if missing:
            out[key] = (None, f"request {rid} has no states for {len(missing)} positions training reads "
                              f"(first {missing[0]})")
            continue
        # as_strided views: unlike slicing, they do not release the GIL (see above)
        aux = slab.aux.as_strided((n, wa), (wa, 1), slab.aux.storage_offset() + off * wa)
        last = slab.last.as_strided((n, wl), (wl, 1), slab.last.storage_offset() + off * wl)
        if t > n:  # the sequence runs past the reservation (unread positions only): its own, longer copy
            aux = torch.cat([aux, aux.new_zeros(t - n, wa)])
            last = torch.cat([last, last.new_zeros(t - n, wl)])
        out[key] = (Capture(aux_hidden_states=aux, last_hidden_state=last), "")
    return out
