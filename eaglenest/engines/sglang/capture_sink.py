"""The engine actor's side of capture during generation: read the hooks' chunk files, assemble per-sample states.

``eaglenest.engines.sglang.hooks`` writes one chunk per forward (rows of many requests) from SGLang's scheduler
process. A background thread here reads chunks as they appear (while the actor's main thread waits on
``Engine.generate``), files each row under its request id, and deletes the file. After generation the engine asks for
a sequence's states by the request id of its last generation: rows are placed by their recorded positions, their
recorded input ids must equal the sequence's, and every position training reads must be present
(``contracts.states.unread_state_positions`` names the ones that may be missing). Anything else is reported, and the
engine captures that sample by a prefill instead.

Requests reserved before they are submitted (:meth:`CaptureSink.reserve`: prompt length + max new tokens + 1 rows
each, one :class:`Slab` per batch) have their rows copied into place by the reader thread as their chunks arrive, so
the copy overlaps generation, a finished batch's states are ready when its last chunk is read, and chunk files are
freed at once. Rows of other requests (the one-token prefills, or a batch beyond ``reserve_max_bytes``) stay in
their chunks and are placed when the batch is captured.
"""

from __future__ import annotations

import shutil
import threading
import time
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from eaglenest.contracts.states import unread_state_positions
from eaglenest.engines.base import Capture
from eaglenest.engines.sglang.capture_chunks import (
    CaptureSinkError,
    Chunk,
    ReaderStats,
    Slab,
    read_chunk,
    states_from_slabs,
    zero_rows,
)
from eaglenest.engines.sglang.capture_ring import RingView, create_ring
from eaglenest.engines.sglang.hooks import ERROR_FILE, chunk_name
from eaglenest.engines.sglang.host_buffers import HostBufferPool

RELEASED_MEMORY = 1 << 17
"""Released request ids remembered, so that a chunk arriving after its request was released is not kept."""

RESERVE_MAX_BYTES = 32 << 30
"""Host memory the reserved batches in flight may hold at once (a batch beyond it is placed after generation); the
default of ``target.sglang.capture_host_gib``."""


class CaptureSink:
    """Reads chunk files from ``folder`` in sequence order and keeps each request's rows until they are used."""

    def __init__(self, folder: str | Path, *, hidden_size: int, n_aux: int = 3, poll_s: float = 0.02,
                 dtype: torch.dtype = torch.bfloat16, reserve_max_bytes: int = RESERVE_MAX_BYTES,
                 ring_bytes: int = 0) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ring: RingView | None = None
        """where the scheduler puts recorded states (``capture_ring``); created here, before the engine starts"""
        if ring_bytes > 0:
            create_ring(self.folder, ring_bytes)
            self.ring = RingView(self.folder, populate=True)
        self.hidden_size = hidden_size
        self.width = (n_aux + 1) * hidden_size
        self.poll_s = poll_s
        self._chunks: list[tuple[Chunk, torch.Tensor, set[int]]] = []  # with each row's request index, and the set
        self._index: dict[str, int] = {}
        self._next_index = 0
        self._dead: set[int] = set()
        self._released: set[str] = set()
        self._released_order: deque[str] = deque()
        self._counts: dict[str, int] = defaultdict(int)
        self._next = 0
        self._last_chunk_at = time.monotonic()
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # one reader of chunk files at a time (see :meth:`poll`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.buffers = HostBufferPool()
        """where assembled states live: reused once the blocks built on them are gone (first touches cost most)"""
        self.dtype = dtype
        self.reserve_max_bytes = reserve_max_bytes
        self._slots: dict[str, tuple[Slab, int, int]] = {}  # reserved rid -> (slab, offset, capacity)
        self._overflow: dict[str, str] = {}  # reserved rids whose rows did not fit, with why
        self._reserved_bytes = 0
        self._reader_error: str | None = None
        self.served: Counter[str] = Counter()
        """sequences assembled from rows placed as they arrived ("on_arrival") or after their batch ("at_capture")"""
        self._stats = ReaderStats()
        self._scheduler: dict[str, float] | None = None  # the latest chunk's word on recording's cost to the scheduler

    # ------------------------------------------------------------------------------------------------ reading
    def start(self) -> None:
        """Read chunks in the background from now on (generation and reading overlap)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="eaglenest-capture-reader", daemon=True)
            self._thread.start()

    def _state_nbytes(self, rows: int, dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of ``rows`` rows of aux states and of final states (the two buffers a batch is laid out in)."""
        return rows * (self.width - self.hidden_size) * dtype.itemsize, rows * self.hidden_size * dtype.itemsize

    def _state_buffers(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled ``[rows, width - hidden]`` aux and ``[rows, hidden]`` final-state tensors (contents not cleared)."""
        a, b = self._state_nbytes(rows, dtype)
        return (self.buffers.take(a).view(dtype).view(rows, self.width - self.hidden_size),
                self.buffers.take(b).view(dtype).view(rows, self.hidden_size))

    def reserve(self, rids: Sequence[str], capacities: Sequence[int]) -> bool:
        """Place the rows of ``rids`` (up to ``capacities[i]`` positions each) as they arrive; call before their
        requests are submitted. False (nothing reserved: their rows are placed when captured) when the reserved
        batches in flight would exceed ``reserve_max_bytes``."""
        total = int(sum(capacities))
        if not rids or total <= 0:
            return False
        nbytes = sum(self._state_nbytes(total, self.dtype))
        with self._lock:
            if self._reserved_bytes + nbytes > self.reserve_max_bytes:
                return False
            self._reserved_bytes += nbytes
        try:  # pooled memory; its pages are first touched by the reader thread's copies (no zeroing here)
            aux, last = self._state_buffers(total, self.dtype)
        except BaseException:
            with self._lock:
                self._reserved_bytes -= nbytes
            raise
        slab = Slab(aux, last, torch.full((total,), -1, dtype=torch.int32), nbytes, len(rids))
        with self._lock:
            off = 0
            for rid, cap in zip(rids, capacities, strict=True):
                self._slots[rid] = (slab, off, int(cap))
                off += int(cap)
        return True

    def prewarm(self, rows_per_batch: int, batches: int) -> int:
        """Touch the memory of ``batches`` reservations of ``rows_per_batch`` rows ahead of time (the engine actor does
        it while its engine starts); bounded by ``reserve_max_bytes``. Returns the bytes made ready."""
        sizes = list(self._state_nbytes(rows_per_batch, self.dtype))
        batches = min(batches, self.reserve_max_bytes // max(sum(sizes), 1))
        return self.buffers.prewarm(sizes * int(batches))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                read = self.poll()
            except Exception:  # noqa: BLE001 - reported by check(): the batches waiting on it fail, loudly
                self._reader_error = traceback.format_exc()
                return
            if not read:
                self._stop.wait(self.poll_s)

    def poll(self, *, block: bool = True) -> int:
        """Read every chunk that is ready, in order; returns how many were read.

        One thread reads at a time (chunks are placed in forward order: where a position was recorded twice, the
        later row wins); ``block=False`` returns 0 at once while another thread is reading. Rows are copied into
        their slabs outside the lock that :meth:`reserve`, :meth:`wait` and :meth:`assemble_many` take: a batch
        about to be submitted or one collecting its states never waits behind the copy of other batches' rows (in
        the sixth GPU run half the batches waited ~0.7 s to reserve while the first prompts' prefill chunks were
        placed). A request's rows count as arrived only once copied.

        Rows of a request already released (a late chunk after a wait that ended on its quiet timeout) are not kept:
        they belong to request index -1, which nothing asks for and which does not keep a chunk alive.
        """
        if not self._read_lock.acquire(blocking=block):
            return 0
        try:
            read = 0
            while self._read_next():
                read += 1
            if read:
                with self._lock:
                    self._last_chunk_at = time.monotonic()
            return read
        finally:
            self._read_lock.release()

    def _read_next(self) -> bool:
        """Read and place chunk ``self._next`` if it is there (the caller holds ``_read_lock``)."""
        path = self.folder / chunk_name(self._next)
        t_read = time.time()
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        chunk = read_chunk(path, self.ring)
        idx = []
        placed: list[tuple[int, str, int]] = []  # (run, rid, rows) of reserved requests
        kept: list[tuple[str, int]] = []  # (rid, rows) of the others: their rows stay in the chunk
        with self._lock:
            for k, (rid, rows) in enumerate(chunk.runs):
                if rid in self._released:
                    idx.append(-1)
                    continue
                if rid in self._slots:
                    placed.append((k, rid, rows))
                    idx.append(-1)  # its rows go to its slab now; the chunk is not kept for them
                    continue
                if rid not in self._index:
                    self._index[rid] = self._next_index
                    self._next_index += 1
                idx.append(self._index[rid])
                kept.append((rid, rows))
            slots = {rid: self._slots[rid] for _, rid, _ in placed}
        counts = torch.tensor([rows for _, rows in chunk.runs], dtype=torch.long)
        live = set(idx) - {-1}
        owner = torch.repeat_interleave(torch.tensor(idx, dtype=torch.long), counts) if live else None
        # the copy, outside ``_lock``: the slabs stay alive while referenced here, even if their batch is released
        overflow = self._place(chunk, counts, placed, slots) if placed else {}
        if chunk.ring_end is not None:  # rows kept for later leave the ring before its space is handed back
            if live:
                chunk.states = chunk.states.clone()
            self.ring.release(chunk.ring_end)
        with self._lock:  # the rows count as arrived now, for requests not released meanwhile
            for _, rid, rows in placed:
                if rid in self._slots:
                    self._counts[rid] += rows
            for rid, why in overflow.items():
                if rid in self._slots:
                    self._overflow[rid] = why
            for rid, rows in kept:
                if rid in self._index:
                    self._counts[rid] += rows
            live -= self._dead
            if live:
                self._chunks.append((chunk, owner, live))
            self._next += 1
            done = time.time()
            st = self._stats
            st.chunks += 1
            st.bytes += stat.st_size + (chunk.states.numel() * chunk.states.element_size()
                                        if chunk.ring_end is not None else 0)
            st.placing_s += done - t_read
            st.lag_sum_s += max(t_read - stat.st_mtime, 0.0)
            st.lag_max_s = max(st.lag_max_s, t_read - stat.st_mtime)
            if chunk.forward_at is not None:
                written = max(stat.st_mtime - chunk.forward_at, 0.0)
                st.write_lag_sum_s += written
                st.write_lag_max_s = max(st.write_lag_max_s, written)
                st.write_lag_n += 1
            if chunk.scheduler:
                self._scheduler = chunk.scheduler
        path.unlink()
        return True

    def _place(self, chunk: Chunk, counts: torch.Tensor, placed: list[tuple[int, str, int]],
               slots: dict[str, tuple[Slab, int, int]]) -> dict[str, str]:
        """Copy the rows of reserved requests into their slabs (the reading thread, outside ``_lock``); ``counts``:
        rows per run of the chunk; ``slots``: where each placed request's rows go. Returns the requests that recorded
        a position past their reservation, with why. A decode step's chunk has one row for each of thousands of
        requests: per run only dict lookups, the rest is tensor work."""
        run_start = torch.cumsum(counts, 0) - counts
        slabs: dict[int, int] = {}
        slab_list: list[Slab] = []
        runs, offs, caps, which = [], [], [], []
        overflow: dict[str, str] = {}
        for k, rid, _ in placed:
            slab, off, cap = slots[rid]
            j = slabs.setdefault(id(slab), len(slab_list))
            if j == len(slab_list):
                slab_list.append(slab)
            runs.append(k)
            offs.append(off)
            caps.append(cap)
            which.append(j)
        sel = torch.tensor(runs, dtype=torch.long)
        n = counts[sel]
        first = torch.repeat_interleave(run_start[sel], n)  # each placed row's run start in the chunk
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        src = first + within
        pos = chunk.positions[src]
        over = pos >= torch.repeat_interleave(torch.tensor(caps, dtype=torch.long), n)
        if bool(over.any()):
            run_of_row = torch.repeat_interleave(torch.arange(len(runs)), n)
            for r in torch.unique(run_of_row[over]).tolist():
                rid = chunk.runs[runs[r]][0]
                overflow[rid] = f"request {rid} recorded a position past the {caps[r]} reserved for it"
        dst = torch.repeat_interleave(torch.tensor(offs, dtype=torch.long), n) + pos
        row_slab = torch.repeat_interleave(torch.tensor(which, dtype=torch.long), n)
        h = self.hidden_size
        for j, slab in enumerate(slab_list):
            m = (row_slab == j) & ~over
            s_j, d_j = src[m], dst[m]
            if not s_j.numel():
                continue
            lo, count = int(s_j[0]), int(s_j.numel())
            if int(s_j[-1]) - lo + 1 == count:
                rows, ids = chunk.states[lo:lo + count], chunk.ids[lo:lo + count]  # a run of the chunk: no gather
            else:
                rows, ids = chunk.states[s_j], chunk.ids[s_j]
            if rows.dtype != slab.aux.dtype:
                rows = rows.to(slab.aux.dtype)
            slab.aux.index_copy_(0, d_j, rows[:, : self.width - h])
            slab.last.index_copy_(0, d_j, rows[:, self.width - h:])
            slab.ids.index_copy_(0, d_j, ids.to(torch.int32))
        return overflow

    def check(self) -> None:
        """Raise if the recorder in the scheduler process, or the reader thread here, failed."""
        if self._reader_error:
            raise CaptureSinkError("reading the recorded states failed in the engine actor: "
                                   f"{self._reader_error[-2000:]}")
        err = self.folder / ERROR_FILE
        if err.exists():
            raise CaptureSinkError(f"capture during generation failed in SGLang's scheduler: {err.read_text()[:2000]}")

    def take_stats(self) -> ReaderStats:
        """The reader's work since the last call (and start afresh)."""
        with self._lock:
            st, self._stats = self._stats, ReaderStats()
            st.scheduler = self._scheduler
        return st

    def wait(self, need: Mapping[str, int], *, quiet_s: float = 1.0, timeout_s: float = 300.0) -> None:
        """Until every rid has ``need[rid]`` rows, or no chunk arrived for ``quiet_s`` (the engine is idle after a
        finished ``generate``, so nothing more is coming), or ``timeout_s``."""
        t0 = time.monotonic()
        while True:
            self.poll(block=False)  # the reader thread may be at it already
            self.check()
            with self._lock:
                if all(self._counts.get(r, 0) >= n for r, n in need.items()):
                    return
                quiet = time.monotonic() - self._last_chunk_at
            if quiet >= quiet_s or time.monotonic() - t0 >= timeout_s:
                return
            time.sleep(self.poll_s)

    # ---------------------------------------------------------------------------------------------- assembling
    def assemble(self, rid: str, ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[Capture | None, str]:
        """The states of one sequence from request ``rid``'s rows, or ``(None, why)`` (see :meth:`assemble_many`)."""
        return self.assemble_many([(rid, ids, loss_mask)])[0]

    def assemble_many(self, wanted: Sequence[tuple[str, Sequence[int], Sequence[int]]]
                      ) -> list[tuple[Capture | None, str]]:
        """Per ``(rid, ids, loss_mask)``: the sequence's states from the request's rows, or ``(None, why)``.

        Rows are placed by position; rows past the sequence's end are ignored (a sample cut back to an earlier turn);
        for a position recorded twice the later row wins (a retracted, recomputed request). The recorded input ids
        must equal the sequence's, and every position training reads must be present. One sort of all recorded rows
        serves the whole batch.
        """
        with self._lock:  # where each reserved request's rows are; the views and checks are made outside the lock
            picked = [(k, rid, ids, mask, self._overflow.get(rid), self._slots[rid])
                      for k, (rid, ids, mask) in enumerate(wanted) if rid in self._slots]
        reserved = states_from_slabs(picked)
        if reserved:
            with self._lock:
                self.served["on_arrival"] += sum(cap is not None for cap, _ in reserved.values())
        if reserved:
            rest = [k for k in range(len(wanted)) if k not in reserved]
            got = dict(zip(rest, self.assemble_many([wanted[k] for k in rest]), strict=True)) if rest else {}
            return [reserved[k] if k in reserved else got[k] for k in range(len(wanted))]
        with self._lock:
            chunks = list(self._chunks)
            index = dict(self._index)
        if not chunks:
            return [(None, f"no rows recorded for request {rid}") for rid, _, _ in wanted]
        owner = torch.cat([o for _, o, _ in chunks])
        pos = torch.cat([c.positions for c, _, _ in chunks])
        toks = torch.cat([c.ids for c, _, _ in chunks])
        span = int(pos.max()) + 1
        key = owner * span + pos
        order = torch.argsort(key, stable=True)
        skey = key[order]
        last = torch.ones_like(skey, dtype=torch.bool)  # the latest row of each (request, position)
        last[:-1] = skey[1:] != skey[:-1]
        order, skey = order[last], skey[last]
        rows_of = torch.cumsum(torch.tensor([0] + [c.states.shape[0] for c, _, _ in chunks]), 0)
        out: list[tuple[Capture | None, str]] = []
        placed: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (result index, length, rows, positions)
        for rid, ids, mask in wanted:
            r = index.get(rid)
            if r is None:
                out.append((None, f"no rows recorded for request {rid}"))
                continue
            t = len(ids)
            lo = int(torch.searchsorted(skey, r * span))
            hi = int(torch.searchsorted(skey, r * span + min(t, span)))
            sel = order[lo:hi]
            p = skey[lo:hi] - r * span
            want = torch.as_tensor(list(ids), dtype=torch.long)
            bad = toks[sel] != want[p]
            if bool(bad.any()):
                at = int(p[bad][0])
                out.append((None, f"request {rid} computed token {int(toks[sel][bad][0])} at position {at}, the "
                                  f"sequence has {int(want[at])}"))
                continue
            have = torch.zeros(t, dtype=torch.bool)
            have[p] = True
            unread = unread_state_positions(t, mask)
            missing = [i for i in (~have).nonzero().flatten().tolist() if i not in unread]
            if missing:
                out.append((None, f"request {rid} has no states for {len(missing)} positions training reads "
                                  f"(first {missing[0]})"))
                continue
            placed.append((len(out), t, sel, p))
            out.append((None, ""))
        if placed:
            # one aux and one final-state buffer for every placed sequence, filled chunk by chunk: each recorded row
            # is copied once, straight into the contiguous layout the shards store (no later reshuffling copy)
            h, dtype = self.hidden_size, chunks[0][0].states.dtype
            starts = torch.cumsum(torch.tensor([0] + [t for _, t, _, _ in placed]), 0)
            total = int(starts[-1])
            aux, last = self._state_buffers(total, dtype)
            src = torch.cat([sel for _, _, sel, _ in placed])
            dst = torch.cat([p + starts[i] for i, (_, _, _, p) in enumerate(placed)])
            which = torch.searchsorted(rows_of, src, right=True) - 1
            for c in torch.unique(which).tolist():
                m = which == c
                local, to = src[m] - rows_of[c], dst[m]
                states = chunks[c][0].states
                lo, n = int(local[0]), int(local.numel())
                if int(local[-1]) - lo + 1 == n and bool((local[1:] > local[:-1]).all()):
                    rows = states[lo:lo + n]  # the usual case, a run of the chunk's rows: copied once, no gather
                else:
                    rows = states[local]
                aux.index_copy_(0, to, rows[:, : self.width - h])
                last.index_copy_(0, to, rows[:, self.width - h:])
            unfilled = torch.ones(total, dtype=torch.bool)
            unfilled[dst] = False
            # the positions training never reads (a reused buffer holds an earlier batch's rows)
            zero_rows(unfilled.nonzero().flatten(), aux, last)
            for i, (k, t, _, _) in enumerate(placed):
                a, b = int(starts[i]), int(starts[i]) + t
                out[k] = (Capture(aux_hidden_states=aux[a:b], last_hidden_state=last[a:b]), "")
            with self._lock:
                self.served["at_capture"] += len(placed)
        return out

    def rows(self, rid: str) -> int:
        with self._lock:
            return self._counts.get(rid, 0)

    def discard(self, rids: Sequence[str] | None = None) -> None:
        """Forget the rows of ``rids`` (None: of every request); a chunk goes when none of its requests is left."""
        with self._lock:
            if rids is None:
                self._slots.clear()
                self._overflow.clear()
                self._reserved_bytes = 0
                self._chunks.clear()
                self._index.clear()
                self._counts.clear()
                self._dead.clear()
                self._released.clear()
                self._released_order.clear()
                return
            for r in rids:
                slot = self._slots.pop(r, None)
                self._overflow.pop(r, None)
                if slot is not None:
                    slot[0].live -= 1
                    if slot[0].live == 0:
                        self._reserved_bytes -= slot[0].nbytes
                i = self._index.pop(r, None)
                self._counts.pop(r, None)
                if i is not None:
                    self._dead.add(i)
                self._released.add(r)
                self._released_order.append(r)
            while len(self._released_order) > RELEASED_MEMORY:  # old ids cannot have rows in flight any more
                self._released.discard(self._released_order.popleft())
            self._chunks = [c for c in self._chunks if not c[2] <= self._dead]
            self._dead &= set().union(*(c[2] for c in self._chunks))  # only what a kept chunk still refers to

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.discard()
        self.buffers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

