"""The engine stage of the Ray Data pipeline: one target engine per actor, and the sink that writes its output.

``EngineActor`` is the ``map_batches`` callable class: it loads the engine once (any ``TargetEngine`` through
``load_engine``) and hands it each batch whole. ``ShardDatasink`` writes the samples of each write task to one shard
file and the rejected ones to one quarantine file, both atomically, named by the hash of their ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasink

from eaglenest.contracts.shards import HIDDEN_COLUMNS
from eaglenest.engines import TargetEngine
from eaglenest.regen.formats import OK
from eaglenest.regen.regenerate import Quarantined, Regenerated, Result, Sample

RESULT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("domain", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    # 64-bit offsets between stages: a batch of long sequences of a large target exceeds 2 GiB of hidden states
    ("aux_hidden_states", pa.large_binary()),
    ("last_hidden_state", pa.large_binary()),
    ("status", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("raw", pa.string()),
    ("generated_tokens", pa.int32()),
    ("truncated_turns", pa.int32()),
    ("dropped_turns", pa.int32()),
    ("source_id", pa.string()),
])


MIN_RUN_BYTES = 64 << 10
"""A hidden-state column is chunked rather than copied when its runs of consecutive memory average at least this."""

PASS_THROUGH = ("epoch",)
"""plan columns the engine stage hands on unchanged (online training tags every row with its epoch)"""


def results_table(results: list[Result]) -> pa.Table:
    """The engine stage's rows; the hidden-state columns are built from the results' buffers directly (see
    :func:`blob_column`), never through Python bytes objects."""
    rows = []
    for r in results:
        s = r.sample
        if isinstance(r, Regenerated):
            rows.append({"id": s.id, "source": s.source, "domain": s.domain, "input_ids": r.input_ids,
                         "loss_mask": r.loss_mask, "num_tokens": len(r.input_ids),
                         "status": OK, "reason": None, "detail": None, "raw": None,
                         "generated_tokens": r.generated_tokens, "truncated_turns": r.truncated_turns,
                         "dropped_turns": r.dropped_turns, "source_id": s.source_id})
        else:
            assert isinstance(r, Quarantined)
            rows.append({"id": s.id, "source": s.source, "domain": s.domain, "status": r.reason,
                         "reason": r.reason, "detail": r.detail, "raw": s.raw, "generated_tokens": 0,
                         "truncated_turns": 0, "dropped_turns": 0, "source_id": s.source_id})
    small = pa.schema([f for f in RESULT_SCHEMA if f.name not in HIDDEN_COLUMNS])
    table = pa.Table.from_pylist(rows, schema=small)
    columns = {name: blob_column([getattr(r, name) if isinstance(r, Regenerated) else None for r in results])
               for name in HIDDEN_COLUMNS}
    return pa.table({f.name: columns[f.name] if f.name in columns else table.column(f.name) for f in RESULT_SCHEMA},
                    schema=RESULT_SCHEMA)


def blob_column(blobs: list[bytes | memoryview | None]) -> pa.LargeBinaryArray | pa.ChunkedArray:
    """A ``large_binary`` column of ``blobs`` (None: null), copied at most once.

    Regen's capture lays a batch's states out back to back in result order, each sequence in room reserved for its
    longest possible answer: runs of consecutive blobs are consecutive pieces of one piece of memory, broken where an
    answer ended early. One run becomes the column's buffer as it is; several runs become a chunked column, one chunk
    per run, still without a copy, as long as the runs are large (a chunk costs next to nothing beside a copy of a
    batch's states, gigabytes; where most answers end early there is a run per sequence); small scattered blobs and
    bytes objects are copied once into one buffer.
    """
    import numpy as np

    views = [None if b is None else np.frombuffer(b, dtype=np.uint8) for b in blobs]
    runs: list[list[int]] = [[]]
    last = None
    for k, v in enumerate(views):
        if v is not None and v.nbytes:
            if last is not None and v.ctypes.data != last.ctypes.data + last.nbytes:
                runs.append([])
            last = v
        runs[-1].append(k)
    total = sum(v.nbytes for v in views if v is not None)
    if len(runs) > 1 and total >= MIN_RUN_BYTES * len(runs):
        return pa.chunked_array([_binary_run([views[k] for k in run]) for run in runs], type=pa.large_binary())
    return _binary_run(views)


def _binary_run(views: list) -> pa.LargeBinaryArray:
    """One ``large_binary`` array of ``views``: their memory as it is when they are consecutive, else one copy."""
    import numpy as np

    lengths = np.array([0 if v is None else v.nbytes for v in views], dtype=np.int64)
    offsets = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [v for v in views if v is not None and v.nbytes]
    if not present:
        data = pa.py_buffer(b"")
    elif all(b.ctypes.data == a.ctypes.data + a.nbytes for a, b in zip(present, present[1:], strict=False)):
        data = pa.foreign_buffer(present[0].ctypes.data, int(offsets[-1]), base=present)  # keeps the memory alive
    else:
        data = pa.py_buffer(np.concatenate(present))
    nulls = [v is None for v in views]
    validity = pa.array([not n for n in nulls], type=pa.bool_()).buffers()[1] if any(nulls) else None
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(views), [validity, pa.py_buffer(offsets), data],
                                            null_count=sum(nulls))


def samples_from_table(batch: pa.Table) -> list[Sample]:
    return [Sample(id=r["id"], source=r["source"], domain=r["domain"], messages=r["messages"] or [],
                   tools=r["tools"], native=bool(r["native"]), native_input_ids=r["native_input_ids"],
                   native_loss_mask=r["native_loss_mask"], raw=r["raw"] or "", source_id=r.get("source_id"))
            for r in batch.to_pylist()]


def _quiet_model_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


PREWARM_PROMPT_TOKENS = 256
"""Prompt tokens per sample assumed when an engine actor readies the host memory of its batches in flight (a batch
with longer prompts takes fresh memory for what does not fit)."""


def _prewarm_capture(engine: TargetEngine, regen: dict[str, Any],
                     sampling: dict[str, dict[str, Any]]) -> threading.Thread:
    """Start readying the host memory that ``regen.batches_in_flight`` batches record into, on a thread, so it runs
    while the engine starts (a no-op for an engine that does not record while generating)."""
    prewarm = engine.prewarm_capture
    max_new = max((s["max_new_tokens"] for s in sampling.values()), default=0)
    rows = int(regen["batch_size"]) * (PREWARM_PROMPT_TOKENS + max_new + 1)
    thread = threading.Thread(target=prewarm, args=(rows, int(regen["batches_in_flight"])),
                              name="eaglenest-capture-prewarm", daemon=True)
    thread.start()
    return thread


class EngineActor:
    """``map_batches`` callable: regenerates and captures whole batches with one engine per actor."""

    def __init__(self, target: dict[str, Any], regen: dict[str, Any], sampling: dict[str, dict[str, Any]],
                 identity: dict[str, Any], tracker: Any = None, ledger: dict[str, Any] | None = None):
        _quiet_model_libraries()
        from eaglenest.config import TargetConfig
        from eaglenest.engines import SamplingParams, load_engine
        from eaglenest.regen.regenerate import Regenerator

        tcfg = TargetConfig.model_validate(target)
        if tcfg.device != "cuda" and tcfg.engine == "hf":
            import torch

            torch.set_num_threads(tcfg.cpu_threads or max(1, int(regen["num_cpus_per_actor"])))
        self.engine = load_engine(tcfg, regen=True)
        warm = _prewarm_capture(self.engine, regen, sampling)  # alongside the engine start
        # an engine that starts lazily starts with the actor, not inside the first batch: the batch timeline and
        # generate seconds then measure generation alone
        self.engine.start()
        warm.join()
        info = self.engine.info
        layer_ids = list(self.engine.aux_layer_ids)
        got = {"num_layers": info.num_layers, "hidden_size": info.hidden_size, "aux_layer_ids": layer_ids}
        bad = {k: (identity[k], v) for k, v in got.items() if identity[k] != v}
        if bad:
            raise RuntimeError(f"the engine's target does not match the driver's view of it: {bad} (config "
                               f"{identity['target']}); check target.model / target.aux_layer_ids")
        self._regen_args = {"min_tokens": regen["min_tokens"], "max_tokens": regen["max_tokens"],
                            "storage_dtype": regen["storage_dtype"], "layer_ids": layer_ids}
        self._local = threading.local()
        self._new_regenerator = Regenerator
        # an engine that is not thread safe runs one batch at a time even when Ray Data calls from two threads
        self._exclusive = contextlib.nullcontext() if self.engine.thread_safe else threading.Lock()
        self.sampling = {name: SamplingParams(temperature=s["temperature"], top_p=s["top_p"],
                                              max_new_tokens=s["max_new_tokens"], seed=s["seed"])
                         for name, s in sampling.items()}
        self.tracker = tracker
        self.ledger = ledger  # online training: file rejects here and pass on only the regenerated rows
        self.answers = None
        if ledger is not None:  # ... and file every generated answer, and capture only the answers filed before
            from eaglenest.regen.answers import AnswerCache

            self.answers = AnswerCache(ledger["ledger_dir"])
        if tracker is not None:
            tracker.engine_info.remote({"engine": info.engine, "engine_version": info.engine_version,
                                        "model": info.model, "pid": os.getpid()})

    @property
    def regen(self) -> Any:
        """This thread's Regenerator (``regen.batches_in_flight`` > 1: Ray Data calls the actor from several)."""
        r = getattr(self._local, "regen", None)
        if r is None:
            r = self._local.regen = self._new_regenerator(self.engine, **self._regen_args)
        return r

    def __call__(self, batch: pa.Table) -> pa.Table:
        t0 = time.time()
        samples = samples_from_table(batch)
        generate = [not s.native for s in samples]  # the rows whose answers the engine generates
        skipped: dict[int, int] = {}
        with self._exclusive:
            if self.answers is not None:
                batch, samples, generate, skipped = self._use_answer_cache(batch, samples, generate)
                results = self._run_once_per_sample(samples, generate)
            else:
                results = self.regen.run(samples, lambda s: self.sampling[s.source])
        table = results_table(results)
        for name in PASS_THROUGH:  # results come back in input order: extra plan columns ride along by position
            if name in batch.column_names:
                table = table.append_column(name, batch.column(name))
        if self.answers is not None:  # filed before the rows go on: a row trained on always has its answer filed
            from eaglenest.regen.answers import write_answers

            fresh = [g and isinstance(r, Regenerated) for r, g in zip(results, generate, strict=True)]
            write_answers(table.filter(pa.array(fresh, type=pa.bool_())), self.ledger["ledger_dir"])
        if self.tracker is not None:
            st = self.regen.stats
            timing = (t0, time.time(), os.getpid(), len(samples))
            if self.answers is not None:
                timing += (sum(generate),)
                self.tracker.engine_rows.remote(self.ledger.get("stream", "train"),
                                                _rows_per_epoch(batch, generate, skipped))
            self.tracker.generated.remote(st.generated_tokens, timing, (st.generate_seconds, st.capture_seconds,
                                                                        st.generate_from, st.generate_to))
            placement = self.engine.capture_placement()
            if placement:
                self.tracker.capture_placement.remote(os.getpid(), placement)
        if self.ledger is not None:
            return keep_regenerated(table, self.ledger["ledger_dir"], self.ledger["columns"])
        return table

    def _use_answer_cache(self, batch: pa.Table, samples: list[Sample],
                          generate: list[bool]) -> tuple[pa.Table, list[Sample], list[bool], dict[int, int]]:
        """Online: drop the rows of samples quarantined in the ledger, and turn the ones with a filed answer into
        native samples (the Regenerator then captures that answer and generates nothing). Returns the batch, its
        samples, which of them generate, and the rows dropped per epoch."""
        found, quarantined = self.answers.lookup([s.id for s in samples])
        skipped: dict[int, int] = {}
        if quarantined:
            keep = [s.id not in quarantined for s in samples]
            for e, k in zip(_epochs(batch), keep, strict=True):
                if not k:
                    skipped[e] = skipped.get(e, 0) + 1
            batch = batch.filter(pa.array(keep, type=pa.bool_()))
            samples = [s for s, k in zip(samples, keep, strict=True) if k]
            generate = [g for g, k in zip(generate, keep, strict=True) if k]
        for n, s in enumerate(samples):
            if generate[n] and s.id in found:
                ids, mask = found[s.id]
                samples[n] = dataclasses.replace(s, native=True, native_input_ids=ids, native_loss_mask=mask)
                generate[n] = False
        return batch, samples, generate, skipped

    def _run_once_per_sample(self, samples: list[Sample], generate: list[bool]) -> list[Result]:
        """Online: a batch can hold one sample twice (its rows of two epochs, at an epoch boundary): the engine runs
        it once and both rows get that result (the later one counts as not generated, and is not filed twice)."""
        unique: dict[str, int] = {}  # sample id -> its position among the batch's distinct samples
        where = [unique.setdefault(s.id, len(unique)) for s in samples]
        if len(unique) == len(samples):
            return self.regen.run(samples, lambda s: self.sampling[s.source])
        firsts = [n for n, k in enumerate(where) if n == where.index(k)]
        results = self.regen.run([samples[n] for n in firsts], lambda s: self.sampling[s.source])
        for n in set(range(len(samples))) - set(firsts):
            generate[n] = False
        return [results[k] for k in where]


def _epochs(batch: pa.Table) -> list[int]:
    return batch.column("epoch").to_pylist() if "epoch" in batch.column_names else [0] * batch.num_rows


def _rows_per_epoch(batch: pa.Table, generate: list[bool], skipped: dict[int, int]) -> dict[int, list[int]]:
    """epoch -> [rows generated, rows captured only, rows dropped as quarantined] of one engine batch."""
    out: dict[int, list[int]] = {e: [0, 0, n] for e, n in skipped.items()}
    for e, g in zip(_epochs(batch), generate, strict=True):
        out.setdefault(e, [0, 0, 0])[0 if g else 1] += 1
    return out


class ShardDatasink(Datasink):
    """Writes each write task's rows: samples -> ``shards/part-<hash>.parquet``, rejects -> ``quarantine/``."""

    def __init__(self, out_dir: str | Path, *, rows_per_shard: int, hidden_size: int, storage_dtype: str,
                 tracker: Any = None):
        self.out_dir = Path(out_dir)
        self.rows_per_shard = rows_per_shard
        self.hidden_size = hidden_size
        self.storage_dtype = storage_dtype
        self.tracker = tracker
        self.totals: dict[str, int] = {}

    @property
    def min_rows_per_write(self) -> int:
        return self.rows_per_shard

    @property
    def supports_distributed_writes(self) -> bool:
        # the output folder is a path on the driver's node (scanned there to resume and for the manifest): write
        # tasks run there too, whatever node the engines are on
        return False

    def get_name(self) -> str:
        return "WriteShards"

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, int]:
        from ray.data.block import BlockAccessor

        from eaglenest.contracts.shards import blob_bytes
        from eaglenest.regen.output import write_quarantine, write_shard

        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return {}
        table = pa.concat_tables(tables)
        ok, bad = split_status(table)
        h, dt = self.hidden_size, self.storage_dtype
        for n, a, b in zip(ok.column("num_tokens").to_pylist(), pc.binary_length(ok.column("aux_hidden_states"))
                           .to_pylist(), pc.binary_length(ok.column("last_hidden_state")).to_pylist(), strict=True):
            if a != blob_bytes(dt, n, 3 * h, 3) or b != blob_bytes(dt, n, h):
                raise RuntimeError(f"hidden-state blob sizes {a}/{b} bytes do not match {n} tokens of "
                                   f"3x{self.hidden_size}/{self.hidden_size} {self.storage_dtype}")
        t0 = time.perf_counter()
        if ok.num_rows:
            write_shard(ok, self.out_dir)
        if bad.num_rows:
            write_quarantine(bad, self.out_dir, "regen")
        done: dict[str, int] = {}
        for s in ok.column("source").to_pylist():
            done[s] = done.get(s, 0) + 1
        quarantined: dict[tuple[str, str], int] = {}
        for s, r in zip(bad.column("source").to_pylist(), bad.column("reason").to_pylist(), strict=True):
            quarantined[(s, r)] = quarantined.get((s, r), 0) + 1
        if self.tracker is not None:
            self.tracker.written.remote(done, [(s, r, n) for (s, r), n in quarantined.items()])
        return {"samples": ok.num_rows, "quarantined": bad.num_rows,
                "tokens": int(pc.sum(ok.column("num_tokens")).as_py() or 0),
                "generated_tokens": int(pc.sum(table.column("generated_tokens")).as_py() or 0),
                "truncated_turns": int(pc.sum(table.column("truncated_turns")).as_py() or 0),
                "dropped_turns": int(pc.sum(table.column("dropped_turns")).as_py() or 0),
                "files": int(ok.num_rows > 0) + int(bad.num_rows > 0),
                "write_ms": int((time.perf_counter() - t0) * 1000)}

    def on_write_complete(self, write_result: Any) -> None:
        totals: dict[str, int] = {}
        for r in write_result.write_returns:
            for k, v in (r or {}).items():
                totals[k] = totals.get(k, 0) + int(v)
        self.totals = totals


def split_status(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Engine-stage rows -> (regenerated, rejected)."""
    is_ok = pc.equal(table.column("status"), OK)
    return table.filter(is_ok), table.filter(pc.invert(is_ok))


def keep_regenerated(table: pa.Table, ledger_dir: str, columns: list[str]) -> pa.Table:
    """Online training's ledger step: rejected rows go to ``ledger_dir/quarantine`` (atomic files, as in a regen
    folder), regenerated rows go on with ``columns`` only (hidden states stay in the object store, never on disk)."""
    from eaglenest.regen.output import write_quarantine

    ok, bad = split_status(table)
    if bad.num_rows:
        write_quarantine(bad, Path(ledger_dir), "regen")
    return ok.select(columns)
