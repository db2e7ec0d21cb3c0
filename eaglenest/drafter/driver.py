"""``eaglenest train``'s driver: TTT training on Ray Train (V2), shards or the online stream feeding DDP workers.

:func:`train_drafter` checks the inputs (:mod:`eaglenest.drafter.inputs`), fixes the drafter's shape, starts a
TorchTrainer whose workers run :func:`eaglenest.drafter.worker.train_worker` (the loop itself:
:func:`eaglenest.drafter.loop.train_loop`), and collects the result: export, plot and summary.

Re-running the same command with the same output folder resumes: Ray Train V2 finds the run by
``RunConfig(name, storage_path=OUT/ray)`` and :func:`ray.train.get_checkpoint` hands the newest checkpoint to the
workers, which restore weights, optimizer, scheduler, step and data position. The draft vocab lives in
``OUT/vocab.safetensors`` from the first start on and is never rebuilt.

Files under OUT: ``vocab.safetensors``, ``drafter_config.json``, ``metrics.jsonl`` (train/eval records),
``resume_log.jsonl`` (one record per resume, with fingerprints), ``training_curves.png``, ``ray/`` (checkpoints),
``export/`` (SGLang-loadable drafter), ``summary.json``.

Ray, and the worker module that imports it, are imported inside :func:`train_drafter` once the inputs have started
Ray (importing Ray costs seconds; a refused input folder fails before that).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.checkpoint import find_latest_checkpoint
from eaglenest.drafter.export import export_checkpoint
from eaglenest.drafter.init_from import init_model_config, read_init_drafter
from eaglenest.drafter.inputs import online_inputs, shard_inputs
from eaglenest.drafter.online import EPOCHS_FILE, engine_rows, hidden_state_files
from eaglenest.drafter.plot import plot_training_curves
from eaglenest.drafter.shape import resolve_model_config
from eaglenest.drafters.eagle3.config import LAUNCH_NUM_STEPS, DrafterModelConfig
from eaglenest.drafters.vocab import VOCAB_FILE
from eaglenest.engines.location import resolve_target_path
from eaglenest.regen import answer_files, cached_ids


def train_drafter(cfg: EaglenestConfig, data_dir: str | Path | None, output_dir: str | Path, *,
                  online: bool | None = None, limit: int | None = None) -> dict[str, Any]:
    """Train (or resume) a drafter; writes checkpoints, metrics, a PNG and ``OUT/export``.

    Offline (default) it reads the shards of a regen folder ``data_dir``; ``online`` (or ``train.data: online``)
    regenerates and captures while training and writes no hidden state (``limit`` caps every source, as
    ``eaglenest regen --limit``).
    """
    t0 = time.time()
    tc = cfg.train
    online = tc.data == "online" if online is None else online
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    facts = TargetSpec.read(resolve_target_path(cfg.target))
    if not online and data_dir is None:
        raise ValueError("offline training reads a regen folder: pass --data DIR (or train online: --online)")

    init = read_init_drafter(cfg)
    vocab = init.mapping if init else None
    inputs = (online_inputs(cfg, out, facts, limit, vocab=vocab) if online
              else shard_inputs(cfg, Path(data_dir).resolve(), out, facts, vocab=vocab))
    mapping, n_train, n_eval = inputs.mapping, inputs.n_train, inputs.n_eval
    model_cfg = resolve_model_config(cfg, facts, inputs.aux_layer_ids, mapping.draft_vocab_size)
    if init is not None:
        model_cfg = init_model_config(init, model_cfg)
        print(f"[eaglenest train] starting from {init.path} (its weights, shape and draft vocab)", flush=True)
    cfg_path = out / "drafter_config.json"
    if cfg_path.is_file():
        previous = DrafterModelConfig.load(cfg_path)
        if previous.to_dict() != model_cfg.to_dict():
            raise ValueError(
                f"{cfg_path} records a different drafter shape than this config resolves to; resuming would not "
                "fit the checkpoints. Use a new output folder, or restore the previous config."
            )
    else:
        model_cfg.save(cfg_path)

    rows_per_worker = n_train // tc.num_workers
    if rows_per_worker == 0:
        raise ValueError(f"{n_train} training samples cannot feed {tc.num_workers} workers; lower train.num_workers")
    steps_per_epoch = math.ceil(rows_per_worker / tc.batch_size)
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    print(f"[eaglenest train] target {facts.path}: {facts.num_layers} layers, hidden {facts.hidden_size}, vocab "
          f"{facts.vocab_size}", flush=True)
    origin = ("train.init_from's" if init is not None else
              f"{'built' if inputs.vocab_built else 'reused'}, covers {100 * mapping.coverage():.1f}% of the "
              "loss-masked tokens it was counted on")
    print(f"[eaglenest train] draft vocab {mapping.draft_vocab_size} ({origin}); split "
          f"{n_train} train / {n_eval} held-out; {steps_per_epoch} steps/epoch"
          f"{' (planned: engine rejects end an epoch early)' if online else ''}, {total_steps} steps", flush=True)

    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig

    from eaglenest.drafter.worker import train_worker
    from eaglenest.ray_private import trainer_class  # TorchTrainer without Train V2's placement-group cleaner

    resources = {"CPU": tc.cpus_per_worker}
    if tc.use_gpu:
        resources["GPU"] = tc.gpus_per_worker
    online_cfg = None
    if inputs.online is not None:
        online_cfg = {k: v for k, v in inputs.online.items() if k != "tracker"}
    loop_config = {
        "cfg": cfg.model_dump(),
        "model_cfg": model_cfg.to_dict(),
        "vocab_path": str(out / VOCAB_FILE),
        "out": str(out),
        "dtype": inputs.dtype,
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "online": online_cfg,
        "init_from": str(init.path) if init else None,
    }
    trainer = trainer_class()(
        train_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=tc.run_name,
            storage_path=str(out / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints),
            failure_config=FailureConfig(max_failures=0),
        ),
        datasets=inputs.datasets,
        dataset_config=DataConfig(datasets_to_split="all", execution_options=inputs.options),
    )
    engine_timeline: list = []
    row_counts: dict = {}  # the tracker's rows per stream and epoch
    engine_seconds: dict = {}
    if inputs.notes is not None:
        inputs.notes["stream_started"] = time.time()  # engine batches before this regenerated the held-out split
    try:
        result = trainer.fit()
    finally:
        if inputs.online is not None:
            with contextlib.suppress(Exception):
                engine_timeline = ray.get(inputs.online["tracker"].batch_timeline.remote(), timeout=30)
                row_counts = ray.get(inputs.online["tracker"].row_counts.remote(), timeout=30)
                engine_seconds = ray.get(inputs.online["tracker"].engine_time.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(inputs.online["tracker"])
    if result.error is not None:
        raise RuntimeError(f"drafter training failed: {result.error}") from result.error

    latest = find_latest_checkpoint(out / "ray" / tc.run_name)
    if latest is None:
        raise RuntimeError(f"training finished without a checkpoint under {out / 'ray' / tc.run_name}")
    export_dir = export_checkpoint(latest, out / "export")
    records = read_metrics(out / "metrics.jsonl")
    png = plot_training_curves(records, out / "training_curves.png")
    evals = [r for r in records if r.get("kind") == "eval"]
    summary = {
        "steps": total_steps,
        "checkpoint": str(latest),
        "export": str(export_dir),
        "metrics": str(out / "metrics.jsonl"),
        "plot": str(png) if png else None,
        "draft_vocab_size": mapping.draft_vocab_size,
        "vocab_coverage": mapping.coverage(),
        "train_samples": n_train,
        "eval_samples": n_eval,
        "first_eval": evals[0] if evals else None,
        "final_eval": evals[-1] if evals else None,
        "wall_s": time.time() - t0,
    }
    if online:
        summary["online"] = _online_summary(out, inputs.notes or {}, engine_timeline, row_counts,
                                            engine_seconds)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    fe = summary["final_eval"]
    if fe:
        print(f"[eaglenest train] done: step {fe['step']} held-out acc_0 {fe['acc_0']:.3f}, simulated accept length "
              f"{fe['sim_accept_length']:.2f} over the {len([k for k in fe if k.startswith('acc_')])} TTT steps, "
              f"{fe.get('sim_accept_chain', fe['sim_accept_length']):.2f} at the {LAUNCH_NUM_STEPS}-step chain it "
              f"launches with; export {export_dir}", flush=True)
    return summary


def _online_summary(out: Path, notes: dict[str, Any], timeline: list, row_counts: dict,
                    engine_seconds: dict) -> dict[str, Any]:
    """What an online run did: samples trained per epoch, this start's engine rows per epoch (generated vs captured
    only), the ledger's quarantine and answers, engine busy time, and the hidden-state bytes found on disk under OUT
    afterwards (the mode's promise: 0)."""
    ledger = Path(notes["ledger"])
    epochs = read_metrics(ledger / EPOCHS_FILE)
    (ledger / "engine_timeline.json").write_text(json.dumps(timeline) + "\n")
    files = hidden_state_files(out)
    reasons: dict[str, str] = {}  # by id: a reject may be filed again (two batches in flight at once)
    for f in sorted((ledger / "quarantine").glob("*.parquet")):
        t = pq.read_table(f, columns=["id", "reason"])
        reasons.update(zip(t.column("id").to_pylist(), t.column("reason").to_pylist(), strict=True))
    quarantined: dict[str, int] = {}
    for r in reasons.values():
        quarantined[r] = quarantined.get(r, 0) + 1
    shutil.rmtree(ledger / "plan", ignore_errors=True)  # the work list of a finished run (rebuilt by every start)
    busy = sum(b[1] - b[0] for b in timeline)
    answers = answer_files(ledger)
    return {**notes, "epochs": epochs, "quarantined_per_reason": quarantined, **engine_rows(row_counts),
            "engine_seconds": engine_seconds,
            "answers_cached": len(cached_ids(ledger)), "answers_bytes": sum(f.stat().st_size for f in answers),
            "hidden_state_files": [str(f) for f in files],
            "hidden_state_bytes_written": sum(f.stat().st_size for f in files),
            "engine_batches": len(timeline), "engine_busy_s": round(busy, 2),
            "engine_window_s": round(max(b[1] for b in timeline) - min(b[0] for b in timeline), 2) if timeline
            else 0.0}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (or any JSON-lines file; [] when it is missing)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
