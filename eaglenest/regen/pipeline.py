"""``run_regen``: sources -> normalize -> plan -> actor pool of target engines -> shards + quarantine + manifest.

A run has two Ray Data executions. The first reads and normalizes every source (CPU tasks) and streams the result
through the driver, which resolves duplicates, skips ids already in the output folder and writes this run's plan.
The second reads the plan and runs it through ``map_batches(EngineActor, compute=ActorPoolStrategy(size=n))`` into
``ShardDatasink``. Kill either at any point and rerun the same command: completed files are scanned first, so every
input sample ends up exactly once in a shard or in quarantine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig, SamplingConfig
from eaglenest.regen.output import (
    PLAN,
    OutputFolderError,
    check_identity,
    output_lock,
    remove_stale_temporaries,
    scan_completed,
    write_final_manifest,
)
from eaglenest.regen.sources import build_plan, check_sources, damage_line, data_context

WRITE_CPUS = 0.25


def target_identity(cfg: EaglenestConfig) -> dict[str, Any]:
    """What the shards will be checked against, from the model's config (no weights are loaded in the driver)."""
    from eaglenest.contracts.layers import default_aux_layer_ids, validate_aux_layer_ids
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.location import resolve_target_path

    path = resolve_target_path(cfg.target)
    spec = TargetSpec.read(path, hub=True)
    n = spec.num_layers
    aux = validate_aux_layer_ids(cfg.target.aux_layer_ids or default_aux_layer_ids(n), n)
    return {"target": str(path), "num_layers": n, "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size, "aux_layer_ids": aux, "dtype": cfg.regen.storage_dtype,
            "engine": cfg.target.engine}


def _sampling(s: SamplingConfig) -> dict[str, Any]:
    return {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "seed": s.seed}


def answer_settings(cfg: EaglenestConfig) -> dict[str, Any]:
    """What a regenerated answer depends on besides the target: each source's sampling and the length limits (the
    answer cache of online training is kept only while these stay the same)."""
    rc = cfg.regen
    return {"sampling": {s.name: _sampling(s.sampling or rc.sampling) for s in rc.sources},
            "min_tokens": rc.min_tokens, "max_tokens": rc.max_tokens}


def resolved_sources(cfg: EaglenestConfig) -> list:
    out = []
    for s in cfg.regen.sources:
        out.append(s.model_copy(update={"path": cfg.resolve(s.path)}) if s.path else s)
    return out


def run_regen(cfg: EaglenestConfig, output: str | Path | None = None, limit: int | None = None, *,
              log: Callable[[str], None] = print, progress_interval_s: float = 15.0,
              timeline: bool = False, flush_metrics: bool | None = None) -> dict[str, Any]:
    """Run (or resume) the regen job; returns the summary that is also written to ``DIR/manifest.json``.

    ``limit`` caps every source at ``limit`` input rows (on top of its ``max_samples``): a quick smoke run over all
    formats. Bad rows never stop the job; they are counted per source and reason. ``timeline=True`` adds the
    engine batches' (start, end, pid, generated tokens) to the returned summary (benchmarks). ``flush_metrics``
    keeps the progress actor alive for one metrics export interval at the end, so Prometheus sees the final
    counts and ETA 0 (default: when attached to a cluster through RAY_ADDRESS, where someone scrapes it).
    """
    t_start = time.monotonic()
    rc = cfg.regen
    sources = resolved_sources(cfg)
    check_sources(sources)
    out_dir = Path(output if output is not None else cfg.resolve(rc.output) or rc.output).resolve()
    with output_lock(out_dir):
        return _run_locked(cfg, sources, out_dir, limit, log=log, interval=progress_interval_s, timeline=timeline,
                           flush_metrics=flush_metrics, t_start=t_start)


def _run_locked(cfg: EaglenestConfig, sources: list, out_dir: Path, limit: int | None, *,
                log: Callable[[str], None], interval: float, timeline: bool, flush_metrics: bool | None,
                t_start: float) -> dict[str, Any]:
    rc = cfg.regen
    identity = target_identity(cfg)
    check_identity(out_dir, identity)
    stale = remove_stale_temporaries(out_dir)
    completed = scan_completed(out_dir)
    if completed.duplicates:
        raise OutputFolderError(f"{out_dir} records {len(completed.duplicates)} sample id(s) twice (e.g. "
                                f"{completed.duplicates[0]}); the folder was written by something else")
    from eaglenest.runtime import init_ray

    init_ray()  # attach to RAY_ADDRESS / a `ray start` cluster, or start a local Ray
    import ray

    from eaglenest.regen.progress import ProgressTracker, steady_state, whole_run

    log(f"regen: {len(sources)} sources -> {out_dir} ({len(completed)} samples already recorded"
        f"{f', {stale} partial files removed' if stale else ''})")
    tracker = ProgressTracker.remote()
    try:
        plan = build_plan(sources, out_dir, limit=limit, completed=completed, rows_per_file=rc.batch_size)
        q_now = sorted(plan.quarantined_now.items())
        if q_now:
            tracker.written.remote({}, [(s, r, n) for (s, r), n in q_now], planned=False)
        log(f"regen: planned {plan.planned} samples for the engines; {sum(n for _, n in q_now)} rows quarantined while "
            f"normalizing, {sum(plan.duplicates_per_source.values())} duplicates, "
            f"{sum(plan.already_done_per_source.values())} already done")
        for d in plan.damaged:
            log(f"regen: {damage_line(d)}")
        totals: dict[str, int] = {}
        engine_version = None
        batches: list = []
        batch_records: list = []
        engine_time: dict[str, float] = {}
        placement: dict[str, int] = {}
        if plan.planned:
            totals = _run_engine_stage(cfg, plan.files, out_dir, identity, tracker, log, interval)
            engine_version = (ray.get(tracker.snapshot.remote()).get("engine") or {}).get("engine_version")
            batches = ray.get(tracker.batch_timeline.remote())
            batch_records = ray.get(tracker.batch_records.remote())
            engine_time = ray.get(tracker.engine_time.remote())
            placement = ray.get(tracker.placement_totals.remote())
        if flush_metrics if flush_metrics is not None else bool(os.environ.get("RAY_ADDRESS")):
            ray.get(tracker.snapshot.remote())  # final gauges (ETA 0)
            from eaglenest.ray_private import metrics_report_interval_s

            time.sleep(max(metrics_report_interval_s(), 1.0) + 1)
    finally:
        with contextlib.suppress(Exception):
            ray.kill(tracker)
    if engine_version is None:
        engine_version = _previous_engine_version(out_dir) or f"{identity['engine']} (not started: nothing to do)"
    wall = time.monotonic() - t_start
    extra = {
        "inputs_per_source": plan.inputs_per_source,
        "duplicates_per_source": plan.duplicates_per_source,
        "damaged_sources": plan.damaged,
        "normalize_notes_per_source": plan.notes_per_source,
        "sources": [{k: v for k, v in s.model_dump().items() if v is not None and k != "sampling"}
                    for s in sources],
        "last_run": {"planned": plan.planned, "already_done": sum(plan.already_done_per_source.values()),
                     "quarantined_while_normalizing": sum(n for _, n in q_now),
                     "written": totals.get("samples", 0), "quarantined_by_engine_stage": totals.get("quarantined", 0),
                     "generated_tokens": totals.get("generated_tokens", 0),
                     "truncated_turns": totals.get("truncated_turns", 0),
                     "dropped_turns": totals.get("dropped_turns", 0),
                     "limit": limit, "wall_seconds": round(wall, 1),
                     # engine start, warm-up and the last shard's write are outside the steady window
                     "steady": steady_state(batches, rc.num_actors), "whole_run": whole_run(batches),
                     "engine_seconds": engine_time,
                     # capture during generation: sequences whose rows were placed as recorded vs after their batch
                     "capture_placement": placement,
                     "batches": batch_records},
    }
    manifest = write_final_manifest(out_dir, identity, engine_version, extra)
    shutil.rmtree(out_dir / PLAN, ignore_errors=True)  # the work list of a finished run (rebuilt by every run)
    summary = manifest.model_dump()
    summary["output"] = str(out_dir)
    if timeline:
        summary["timeline"] = batches
    return summary


def _previous_engine_version(out_dir: Path) -> str | None:
    import json

    p = out_dir / "manifest.json"
    return json.loads(p.read_text()).get("engine_version") if p.is_file() else None


class EngineDiedError(RuntimeError):
    """An engine actor died more often than ``regen.max_engine_restarts`` allows."""


def _run_engine_stage(cfg: EaglenestConfig, files: list[str], out_dir: Path, identity: dict[str, Any], tracker: Any,
                      log: Callable[[str], None], interval: float) -> dict[str, int]:
    import ray

    from eaglenest.regen.progress import format_progress
    from eaglenest.regen.stage import ShardDatasink

    rc = cfg.regen
    ray.get(tracker.start.remote(_count_rows(files)))
    sink = ShardDatasink(out_dir, rows_per_shard=rc.rows_per_shard, hidden_size=identity["hidden_size"],
                         storage_dtype=rc.storage_dtype, tracker=tracker)
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):  # progress lines are best effort
                log(format_progress(ray.get(tracker.snapshot.remote(), timeout=10)))

    thread = threading.Thread(target=report, name="regen-progress", daemon=True)
    thread.start()
    # bars on a TTY; on a pipe (ray job logs) Ray Data logs a progress block every few seconds instead
    try:
        with data_context(enable_progress_bars=True, enable_operator_progress_bars=sys.stdout.isatty(),
                          preserve_order=False, use_datasource_v2=False):
            ds = regenerate_dataset(plan_dataset(files), cfg, identity, tracker)
            ds.write_datasink(sink, ray_remote_args={"num_cpus": WRITE_CPUS})
    except ray.exceptions.RayActorError as e:
        raise EngineDiedError(
            f"regen: an engine actor died and was restarted regen.max_engine_restarts={rc.max_engine_restarts} "
            f"times without finishing its batch, so the job stops here (nothing written is lost: rerun the same "
            f"command to resume). The engine's own error is in the actor's log above (`ray job logs`); the last "
            f"death: {str(e).strip()[-1500:]}") from e
    finally:
        stop.set()
        thread.join(timeout=5)
    log(format_progress(ray.get(tracker.snapshot.remote())))
    return sink.totals


PLAN_IN_MEMORY_BYTES = 64 << 20
"""Plans up to this size on disk (prompt rows only: ~3,200 chat prompts take ~2 MB) go to Ray Data as in-memory
blocks; larger ones are read by Ray Data's read tasks."""


def plan_dataset(files: list[str]) -> Any:
    """The plan's rows, one block per plan file (each file is one engine batch: ``regen.batch_size`` rows, the last
    one fewer).

    Why not simply ``read_parquet``: with Ray Data's default read, files came in pieces and the last, partial batch
    waited until every read had finished (fourth GPU run). One read block per file fixed the pieces, but a batch short
    of ``regen.batch_size`` still waits in Ray Data's bundler until the read operator has completed, which came only
    after the full batches' outputs had drained: on the H200 the last 128 of 3,200 prompts started 36 s in, 17 s after
    the other 3,072 had finished (fifth run; reproduced on a CPU). Blocks already in memory complete their input at
    once, so every batch starts together. A plan too large to hold (a long run, where one late batch costs little) is
    still read lazily, one block per file."""
    import ray

    if sum(os.path.getsize(f) for f in files) <= PLAN_IN_MEMORY_BYTES:
        import pyarrow.parquet as pq

        return ray.data.from_arrow([pq.read_table(f) for f in files])
    return ray.data.read_parquet(files, num_cpus=WRITE_CPUS, file_extensions=None, override_num_blocks=len(files))


def regenerate_dataset(plan_rows: Any, cfg: EaglenestConfig, identity: dict[str, Any], tracker: Any = None, *,
                       ledger_dir: str | None = None, columns: list[str] | None = None,
                       stream: str = "train") -> Any:
    """``plan_rows`` (a Ray Data dataset of plan rows) through the engine actor pool: rows of ``RESULT_SCHEMA``.

    The one definition of the engine stage: ``run_regen`` writes its output to shards, online training
    (``eaglenest train --online``) streams it to the trainer's workers. With ``ledger_dir`` the actors file rejected
    rows there themselves (quarantine files, as in a regen folder) and pass on only regenerated rows, in ``columns``;
    they also file every answer they generate there and only capture the answers filed before
    (:mod:`eaglenest.regen.answers`), reporting their rows to ``tracker`` under ``stream``. A block of
    ``regen.batch_size`` rows (a plan file, :func:`plan_dataset`) is one engine batch as it is. (Ray Data refuses
    ``batch_size=None`` with GPUs: "You must provide `batch_size` to `map_batches` when requesting GPUs".)
    """
    from eaglenest.regen.stage import EngineActor

    rc = cfg.regen
    sampling = {s.name: _sampling(s.sampling or rc.sampling) for s in rc.sources}
    with warnings.catch_warnings():
        # Ray 2.60 deprecates map_batches' free-form remote arguments but names no parameter for max_restarts and
        # max_task_retries yet: the bound below has no other spelling, so its warning only misleads a user's log
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return plan_rows.map_batches(
            EngineActor,
            fn_constructor_kwargs={"target": cfg.target.model_dump(), "regen": rc.model_dump(),
                                   "sampling": sampling, "identity": identity, "tracker": tracker,
                                   "ledger": None if ledger_dir is None else {"ledger_dir": ledger_dir,
                                                                              "columns": columns, "stream": stream}},
            batch_size=rc.batch_size, batch_format="pyarrow", zero_copy_batch=True,
            compute=_actor_pool(rc.num_actors, rc.batches_in_flight),
            num_cpus=rc.num_cpus_per_actor, num_gpus=rc.num_gpus_per_actor,
            # Ray Data's default is to restart a dead actor and retry its tasks forever: a deterministic engine crash
            # then loops with no progress and no error (seen on the H200); bounded, the job fails with the cause
            max_restarts=rc.max_engine_restarts, max_task_retries=rc.max_engine_restarts,
        )


def _actor_pool(size: int, in_flight: int) -> Any:
    """The engine actors; with ``in_flight`` > 1 each runs that many batches concurrently in threads (the engine
    serialises its own calls, so what overlaps is one batch's generation with another's capture and output)."""
    from ray.data import ActorPoolStrategy

    if in_flight == 1:
        return ActorPoolStrategy(size=size)
    return ActorPoolStrategy(size=size, max_concurrent_calls_per_actor=in_flight, enable_true_multi_threading=True)


def _count_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
