"""Continuous batching on the reference speculative decoder: requests join the running batch at a step boundary.

``SpecDecoder.generate`` decodes a fixed batch. A server cannot wait for a batch to finish before starting the next
request: here a :class:`ContinuousBatch` drives the decoder's incremental public API (``eaglenest.speculative``):
newcomers are prefilled together (``SpecDecoder.prefill``) and merged into the running batch
(``merge_batches``); each step is the decoder's own draft -> verify -> commit (``SpecDecoder.step``), after which
finished and cancelled rows leave (``SpecDecoder.drop_finished``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from eaglenest.engines.base import OutputConstraint, SamplingParams
from eaglenest.speculative import DecodeBatch, DecodeRow, SpecDecoder, StreamChunk, merge_batches

Emit = Callable[[int, StreamChunk], None]


class ContinuousBatch:
    """One running batch of a SpecDecoder (one sampling setting); ``add`` newcomers, ``step`` advances everyone.

    ``emit(row_id, chunk)`` receives every chunk (``chunk.result`` on a row's last one); row ids come from ``add``.
    """

    def __init__(self, dec: SpecDecoder, sampling: SamplingParams, emit: Emit) -> None:
        self.dec = dec
        self.sampling = sampling
        self.emit = emit
        self.rows: dict[int, DecodeRow] = {}
        self.batch: DecodeBatch | None = None
        self.incoming: list[tuple[int, DecodeRow]] = []
        self.steps = 0
        self._ids = itertools.count()

    @property
    def alive(self) -> int:
        """Rows decoding or waiting to join."""
        return len(self.incoming) + sum(1 for r in self.rows.values() if r.finish is None)

    def add(self, prompt_ids: list[int], constraint: OutputConstraint | None = None) -> int:
        """Queue a prompt (its own structured output, if any: rows of different schemas share the batch). A prompt
        or schema the decoder cannot take raises ValueError here, before it joins (the batch never sees it)."""
        if not prompt_ids:
            raise ValueError("empty prompt: every prompt needs at least one token")
        row = DecodeRow(prompt=list(prompt_ids), constraint=constraint,
                        guide=self.dec.guides.guide(constraint) if constraint is not None else None)
        rid = next(self._ids)
        self.incoming.append((rid, row))
        return rid

    def cancel(self, rid: int) -> None:
        """Stop decoding a row (its client went away); it leaves the batch at the next step, without a chunk."""
        self.incoming = [entry for entry in self.incoming if entry[0] != rid]
        row = self.rows.get(rid)
        if row is not None:
            row.cancel()

    @torch.inference_mode()
    def step(self) -> None:
        """Admit newcomers (one prefill forward for all of them), then one draft/verify/commit step for the batch."""
        if self.batch is not None:
            self.batch = self.dec.drop_finished(self.batch, self.rows)
        self._forget_dropped()
        if self.incoming:
            self._admit()
        if self.batch is None:
            return
        self.steps += 1
        for rid, chunk in self.dec.step(self.batch, self.rows, self.sampling, self.steps):
            self.emit(rid, chunk)

    def _admit(self) -> None:
        new, self.incoming = self.incoming, []
        fresh = dict(new)
        self.rows.update(fresh)
        batch, chunks = self.dec.prefill(fresh, self.sampling)
        for rid, chunk in chunks:
            self.emit(rid, chunk)
        self.batch = merge_batches(self.batch, batch)
        self._forget_dropped()

    def _forget_dropped(self) -> None:
        """Rows that left the batch are done: forget them (a long-running batch must not grow without bound)."""
        live = set(self.batch.rows) if self.batch is not None else set()
        for rid in [rid for rid, r in self.rows.items() if rid not in live and r.finish is not None]:
            del self.rows[rid]
