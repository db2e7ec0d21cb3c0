"""Capture during generation, engine side: the hooks to launch with, request ids, and per-batch assembly.

The SGLang engine launched with :attr:`GenerationRecorder.hooks` records every forward's aux and final states
(``eaglenest.engines.sglang.hooks``); this object names each generation's requests, remembers how many rows each
must produce (prompt + answer - 1: the last answer token is never fed back), and turns a batch's recordings into one
:class:`Capture` per sequence. Sequences it cannot serve from recordings (no hint, a mismatch, rows missing that
training reads) are captured by a one-token generation over the whole sequence, whose prefill records every
position, on the same engine: no second model copy. Nothing here imports sglang.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eaglenest.engines.base import Capture, CaptureHint, Generation
from eaglenest.engines.sglang.capture_sink import RESERVE_MAX_BYTES, CaptureSink, CaptureSinkError
from eaglenest.engines.sglang.hooks import STAGING_ROWS, WRITERS, hook_specs, staging_size

SHM_MIN_FREE = 8 << 30
"""/dev/shm is used for the chunk files when it has this much free space (a container's default is 64 MiB)."""


def capture_folder(configured: str | None) -> Path:
    """A fresh folder for one engine's chunk files: under ``configured``, else /dev/shm (RAM), else the temp dir."""
    if configured:
        base = Path(configured)
    elif Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free >= SHM_MIN_FREE:
        base = Path("/dev/shm")
    else:
        base = Path(tempfile.gettempdir())
    return base / f"eaglenest-capture-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GenerationRecorder:
    """Request ids and expected row counts of one engine's generations, and the sink that receives their rows."""

    def __init__(self, folder: str | None, aux_layer_ids: Sequence[int], *, hidden_size: int,
                 dtype: str = "bfloat16", reserve_max_bytes: int = RESERVE_MAX_BYTES, writers: int = WRITERS,
                 ring_bytes: int = 0, architecture: str = "LlamaForCausalLM") -> None:
        self.folder = capture_folder(folder)
        # the sink (and its ring, when ``ring_bytes``) exists before the hooks: the scheduler maps the ring at start
        self.sink = CaptureSink(self.folder, hidden_size=hidden_size, n_aux=len(aux_layer_ids),
                                dtype=getattr(torch, dtype), reserve_max_bytes=reserve_max_bytes,
                                ring_bytes=ring_bytes)
        # each writer's pinned staging, for a prefill chunk's states (or only its ids and positions, with a ring)
        width = hidden_size * (len(aux_layer_ids) + 1) if ring_bytes <= 0 else 0
        self.hooks = hook_specs(self.folder, list(aux_layer_ids), dtype, writers,
                                staging_size(STAGING_ROWS, width, getattr(torch, dtype).itemsize), ring=ring_bytes > 0,
                                architecture=architecture)
        ring = f"a ring of {ring_bytes / 2**30:.2f} GiB" if ring_bytes > 0 else "no ring (states in chunk files)"
        print(f"[eaglenest capture] recording into {self.folder}, {ring}, {writers} writer thread(s)", flush=True)
        self.counts: Counter[str] = Counter()
        """samples served from generation recordings ("generation") and by a one-token prefill ("prefill")"""
        self.fallback_reasons: list[str] = []
        self._expected: dict[str, int] = {}
        self._prefix = uuid.uuid4().hex[:12]
        self._n = 0
        self._owned: dict[int, list[str]] = {}  # per calling thread: the requests of the batch it works on
        self._lock = threading.Lock()

    def _fresh_rids(self, n: int) -> list[str]:
        rids = [f"eaglenest-{self._prefix}-{self._n + i}" for i in range(n)]
        self._n += n
        return rids

    def new_rids(self, n: int) -> list[str]:
        """Fresh request ids, owned by the calling thread until its next :meth:`capture` consumes them."""
        with self._lock:
            rids = self._fresh_rids(n)
            self._owned.setdefault(threading.get_ident(), []).extend(rids)
        return rids

    def throwaway_rids(self, n: int) -> list[str]:
        """Fresh request ids whose rows nobody reads (an engine's warm-up): released up front, so the sink drops their
        rows as they arrive and no batch's capture ever waits for or sees them."""
        with self._lock:
            rids = self._fresh_rids(n)
        self.sink.discard(rids)
        return rids

    def reserve(self, rids: Sequence[str], prompts: Sequence[Sequence[int]], max_new_tokens: int) -> bool:
        """Have the sink place these requests' rows as they arrive (before they are submitted): room for the prompt,
        every new token, and one token appended after a truncated answer (regen closes its turn with it)."""
        return self.sink.reserve(rids, [len(p) + max_new_tokens + 1 for p in prompts])

    def _release(self) -> None:
        """Drop every row and expectation of the calling thread's requests (its batch, earlier turns included)."""
        with self._lock:
            rids = self._owned.pop(threading.get_ident(), [])
            for r in rids:
                self._expected.pop(r, None)
        self.sink.discard(rids)

    def expect(self, rids: Sequence[str], prompts: Sequence[Sequence[int]], gens: Sequence[Generation]) -> None:
        """Remember the rows each request's forwards produce, and hand its id to the caller as ``capture_ref``."""
        for rid, prompt, gen in zip(rids, prompts, gens, strict=True):
            steps = int(gen.meta.get("completion_tokens", len(gen.token_ids)))
            self._expected[rid] = len(prompt) + max(steps, 1) - 1
            gen.meta["capture_ref"] = rid

    def capture(self, seqs: Sequence[Sequence[int]], hints: Sequence[CaptureHint | None] | None, *,
                prefill: Callable[[list[list[int]], list[str]], None]) -> list[Capture]:
        """One Capture per sequence: from its hinted generation's rows, else through ``prefill(seqs, rids)``.

        Consumes the calling thread's batch: the rows of every request it generated are dropped afterwards (other
        threads' batches, with ``regen.batches_in_flight`` > 1, keep theirs).
        """
        hints = list(hints) if hints is not None else [None] * len(seqs)
        if len(hints) != len(seqs):
            raise ValueError(f"{len(hints)} capture hints for {len(seqs)} sequences")
        need = {h.ref: self._expected[h.ref] for h in hints if h is not None and h.ref in self._expected}
        try:
            return self._capture(seqs, hints, need, prefill)
        finally:
            self._release()

    def _capture(self, seqs: Sequence[Sequence[int]], hints: list[CaptureHint | None], need: dict[str, int],
                 prefill: Callable[[list[list[int]], list[str]], None]) -> list[Capture]:
        if need:
            t0 = time.monotonic()
            self.sink.wait(need)
            # one line per batch in the actor's log (`ray job logs`): how long a finished generation waited for its
            # last rows, and whether the reader was behind the scheduler's writes or slow to place them
            print(f"[eaglenest capture] {len(need)} requests waited {time.monotonic() - t0:.2f} s for their last "
                  f"rows; {self.sink.take_stats().line()}", flush=True)
        out: list[Capture | None] = [None] * len(seqs)
        hinted = [i for i, h in enumerate(hints) if h is not None]
        got = self.sink.assemble_many([(hints[i].ref, seqs[i], hints[i].loss_mask) for i in hinted])  # type: ignore[union-attr]
        for i, (cap, why) in zip(hinted, got, strict=True):
            if cap is not None:
                out[i] = cap
                self.counts["generation"] += 1
            else:
                self.fallback_reasons = (self.fallback_reasons + [why])[-20:]
        redo = [i for i, c in enumerate(out) if c is None]
        if redo:
            rids = self.new_rids(len(redo))
            prefill([list(seqs[i]) for i in redo], rids)
            self.sink.wait({r: len(seqs[i]) for r, i in zip(rids, redo, strict=True)})
            got = self.sink.assemble_many([(r, seqs[i], [1] * len(seqs[i])) for r, i in zip(rids, redo, strict=True)])
            for i, (cap, why) in zip(redo, got, strict=True):
                if cap is None:
                    raise CaptureSinkError(f"prefill capture through the generating engine: {why}")
                out[i] = cap
                self.counts["prefill"] += 1
        return [c for c in out if c is not None]

    def close(self) -> None:
        self.sink.close()
