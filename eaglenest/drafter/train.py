"""TTT training on Ray Train (V2): shards stream through Ray Data into DDP workers; full checkpoints; export at the end.

Re-running the same command with the same output folder resumes: Ray Train V2 finds the run by
``RunConfig(name, storage_path=OUT/ray)`` and :func:`ray.train.get_checkpoint` hands the newest checkpoint to the
workers, which restore weights, optimizer, scheduler, step and data position. The draft vocab lives in
``OUT/vocab.safetensors`` from the first start on and is never rebuilt.

Files under OUT: ``vocab.safetensors``, ``drafter_config.json``, ``metrics.jsonl`` (train/eval records),
``resume_log.jsonl`` (one record per resume, with fingerprints), ``training_curves.png``, ``ray/`` (checkpoints),
``export/`` (SGLang-loadable drafter), ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig

MAX_CONSECUTIVE_NONFINITE = 20
EVAL_CACHE_BYTES = 512 << 20
TRAIN_CACHE_BYTES = 512 << 20
"""A worker's train split up to this size is kept in memory after its first pass: restarting a Ray Data stream
costs seconds per epoch, which dominates many-epoch runs over small data (the demo)."""


def _log(msg: str) -> None:
    """One progress line (written directly: Ray Train's print patch would also copy it to stderr, doubling it)."""
    import sys

    sys.stdout.write(f"[eaglenest train] {msg}\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------------ driver side
def resolve_model_config(cfg: EaglenestConfig, facts, aux_layer_ids: list[int], draft_vocab_size: int):
    """The drafter's shape: the target's hidden size, heads etc. unless the train.drafter section overrides them."""
    from eaglenest.drafter.shape import drafter_model_config

    d = cfg.train.drafter
    return drafter_model_config(facts, aux_layer_ids, draft_vocab_size, num_heads=d.num_heads,
                                num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                                intermediate_size=d.intermediate_size,
                                max_position_embeddings=d.max_position_embeddings, **d.shape_kwargs())


@dataclass
class _Inputs:
    """What the trainer is fed: datasets (+ per-dataset execution options), the draft vocab and the split sizes."""

    aux_layer_ids: list[int]
    dtype: str
    mapping: Any
    vocab_built: bool
    n_train: int
    n_eval: int
    datasets: dict[str, Any]
    options: dict[str, Any]
    online: dict[str, Any] | None = None
    """online runs: what the workers need (the restored step, the ids trained on before it) and the tracker"""
    notes: dict[str, Any] | None = None
    """online runs: the plan and resume figures that go into ``summary.json``"""


def _vocab(out: Path, vocab_size: int, draft_vocab_size: int, count: Any):
    """The run's draft vocab: read back when it exists (a changed size is refused), else built from ``count()``."""
    from eaglenest.drafters.vocab import VOCAB_FILE, VocabMapping, build_vocab_mapping

    path = out / VOCAB_FILE
    want = min(draft_vocab_size, vocab_size)
    if path.is_file():
        mapping = VocabMapping.load(path)
        if mapping.vocab_size != vocab_size or mapping.draft_vocab_size != want:
            raise ValueError(
                f"{path} holds a draft vocab of {mapping.draft_vocab_size} over a target vocab of "
                f"{mapping.vocab_size}, but the config asks for {want} over {vocab_size}. A run's vocab mapping is "
                "never rebuilt (its lm_head rows depend on it): use a new output folder for a new vocab size."
            )
        return mapping, False
    counts = count()
    if int(counts.sum()) == 0:
        raise ValueError("the training split has no loss-masked tokens: nothing to learn (check regen's loss masks)")
    mapping = build_vocab_mapping(counts, want)
    mapping.save(path)
    return mapping, True


def prepare_vocab(out: Path, files: list[Path], vocab_size: int, draft_vocab_size: int, fraction: float, seed: int):
    """Build the draft vocab from the training split once; later starts read it back (and refuse a changed size)."""
    from eaglenest.drafter.data import is_eval_sample
    from eaglenest.drafters.vocab import count_tokens_in_shards

    return _vocab(out, vocab_size, draft_vocab_size, lambda: count_tokens_in_shards(
        files, vocab_size, ids_filter=lambda i: not is_eval_sample(i, fraction, seed)))


def _init_ray(cfg: EaglenestConfig, *, online: bool) -> None:
    """A running Ray (``ray job submit`` sets RAY_ADDRESS, or ``ray start`` ran here), else a local one sized for the
    workers + headroom for the Ray Data list/read tasks (and, online, the engine actors). Called once the input
    folder has passed its checks, so a refused one costs no Ray start."""
    from eaglenest.runtime import init_ray

    tc = cfg.train
    extra = cfg.regen.num_actors * cfg.regen.num_cpus_per_actor + 1 if online else 0
    init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(tc.num_workers * tc.cpus_per_worker + 2 + extra)),
             include_dashboard=False)


def _shard_inputs(cfg: EaglenestConfig, data_dir: Path, out: Path, facts: Any) -> _Inputs:
    """Offline: a regen folder's shards, checked against the target; the held-out split by sample id."""
    from eaglenest.contracts.shards import read_manifest, shard_files
    from eaglenest.drafter.data import build_datasets, check_manifest, eval_files, split_counts

    tc = cfg.train
    manifest = read_manifest(data_dir)
    check_manifest(manifest, facts, cfg.target.aux_layer_ids)
    files = shard_files(data_dir)
    if not files:
        raise FileNotFoundError(f"{data_dir}/shards has no parquet shards (run `eaglenest regen` first)")
    mapping, built = prepare_vocab(out, files, facts.vocab_size, tc.drafter.draft_vocab_size, tc.eval_fraction,
                                   tc.seed)
    counts = split_counts(files, tc.eval_fraction, tc.seed)
    n_train, n_eval = sum(t for t, _ in counts), sum(e for _, e in counts)
    print(f"[eaglenest train] shards {len(files)} files, {manifest.num_samples} samples at layers "
          f"{manifest.aux_layer_ids} (physical)", flush=True)
    _init_ray(cfg, online=False)
    import ray.data

    data_ctx = ray.data.DataContext.get_current()
    bars = data_ctx.enable_progress_bars
    data_ctx.enable_progress_bars = False  # per-operator bars of the streaming split drown the training progress lines
    try:
        datasets = build_datasets(files, tc.eval_fraction, tc.seed,
                                  held_out_files=eval_files(files, counts, tc.eval_max_samples))
    finally:
        data_ctx.enable_progress_bars = bars
    datasets["train"] = datasets["train"].randomize_block_order(seed=tc.seed)
    if "eval" in datasets and n_eval == 0:
        del datasets["eval"]
    if "eval" in datasets and tc.eval_max_samples:
        datasets["eval"] = datasets["eval"].limit(tc.eval_max_samples)
    return _Inputs(aux_layer_ids=list(manifest.aux_layer_ids), dtype=manifest.dtype, mapping=mapping,
                   vocab_built=built, n_train=n_train, n_eval=n_eval, datasets=datasets,
                   options={"train": ray.data.ExecutionOptions(preserve_order=True),
                            "eval": ray.data.ExecutionOptions(preserve_order=True)})


def _online_inputs(cfg: EaglenestConfig, out: Path, facts: Any, limit: int | None) -> _Inputs:
    """Online: regen's plan and engine stage, streamed (see :mod:`eaglenest.drafter.online`)."""
    from eaglenest.drafter.online import count_regenerated_tokens, online_datasets, plan_online, read_resume
    from eaglenest.regen import ProgressTracker, cached_ids

    tc = cfg.train
    _init_ray(cfg, online=True)  # planning already runs on Ray Data
    plan = plan_online(cfg, out, limit)
    if not plan.train_ids:
        raise ValueError(f"the sources hold no sample to train on ({plan.inputs} inputs, {plan.quarantined_now} "
                         f"quarantined, {plan.duplicates} duplicates; see {plan.ledger}/quarantine)")
    resume = read_resume(out / "ray" / tc.run_name)
    if plan.answers_dropped:
        print(f"[eaglenest train] online: dropped {plan.answers_dropped} cached answers file(s) of other sampling or "
              "length settings (those samples are regenerated)", flush=True)
    cached = len(cached_ids(plan.ledger))
    tracker = ProgressTracker.remote()
    mapping, built = _vocab(out, facts.vocab_size, tc.drafter.draft_vocab_size,
                            lambda: count_regenerated_tokens(cfg, plan, facts.vocab_size, tracker))
    tracker.start.remote(len(plan.train_ids))
    datasets, options, n_eval, epochs = online_datasets(cfg, plan, resume, tracker)
    print(f"[eaglenest train] online: {len(plan.train_ids)} training samples planned ({plan.inputs} inputs, "
          f"{plan.duplicates} duplicates, {plan.quarantined_now} quarantined while normalizing), {n_eval} held-out "
          f"regenerated; {cached} answers cached at start (captured only); ledger {plan.ledger}", flush=True)
    if resume.checkpoint:
        per_epoch = ", ".join(f"epoch {e}: {len(v)}" for e, v in sorted(resume.consumed.items()))
        print(f"[eaglenest train] online resume from step {resume.step}: {resume.trained} samples already trained "
              f"({per_epoch}) are not regenerated; streaming epoch(s) {epochs}", flush=True)
    return _Inputs(aux_layer_ids=list(plan.identity["aux_layer_ids"]),
                   dtype=plan.identity["dtype"], mapping=mapping, vocab_built=built, n_train=len(plan.train_ids),
                   n_eval=n_eval, datasets=datasets, options=options,
                   online={"resume_step": resume.step, "consumed": resume.consumed, "tracker": tracker},
                   notes={"ledger": str(plan.ledger), "planned_train": len(plan.train_ids),
                          "planned_eval": len(plan.eval_ids), "quarantined_while_normalizing": plan.quarantined_now,
                          "answers_cached_at_start": cached, "answers_dropped_for_settings": plan.answers_dropped,
                          "resumed_from_step": resume.step if resume.checkpoint else None,
                          "already_trained_before_resume": resume.trained,
                          "already_trained_per_epoch": {e: len(v) for e, v in sorted(resume.consumed.items())}})


def train_drafter(cfg: EaglenestConfig, data_dir: str | Path | None, output_dir: str | Path, *,
                  online: bool | None = None, limit: int | None = None) -> dict[str, Any]:
    """Train (or resume) a drafter; writes checkpoints, metrics, a PNG and ``OUT/export``.

    Offline (default) it reads the shards of a regen folder ``data_dir``; ``online`` (or ``train.data: online``)
    regenerates and captures while training and writes no hidden state (``limit`` caps every source, as
    ``eaglenest regen --limit``).
    """
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafter.checkpoint import find_latest_checkpoint
    from eaglenest.drafter.export import export_checkpoint
    from eaglenest.drafter.plot import plot_training_curves
    from eaglenest.drafters.eagle3.config import DrafterModelConfig
    from eaglenest.engines.location import resolve_target_path

    t0 = time.time()
    tc = cfg.train
    online = tc.data == "online" if online is None else online
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    facts = TargetSpec.read(resolve_target_path(cfg.target))
    if not online and data_dir is None:
        raise ValueError("offline training reads a regen folder: pass --data DIR (or train online: --online)")

    inputs = (_online_inputs(cfg, out, facts, limit) if online
              else _shard_inputs(cfg, Path(data_dir).resolve(), out, facts))
    mapping, n_train, n_eval = inputs.mapping, inputs.n_train, inputs.n_eval
    model_cfg = resolve_model_config(cfg, facts, inputs.aux_layer_ids, mapping.draft_vocab_size)
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
    print(f"[eaglenest train] draft vocab {mapping.draft_vocab_size} ({'built' if inputs.vocab_built else 'reused'}, "
          f"covers {100 * mapping.coverage():.1f}% of the loss-masked tokens it was counted on); split "
          f"{n_train} train / {n_eval} held-out; {steps_per_epoch} steps/epoch"
          f"{' (planned: engine rejects end an epoch early)' if online else ''}, {total_steps} steps", flush=True)

    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig

    from eaglenest.ray_private import trainer_class  # TorchTrainer without Train V2's placement-group cleaner

    datasets = inputs.datasets
    resources = {"CPU": tc.cpus_per_worker}
    if tc.use_gpu:
        resources["GPU"] = 1
    online_cfg = None
    if inputs.online is not None:
        online_cfg = {k: v for k, v in inputs.online.items() if k != "tracker"}
    loop_config = {
        "cfg": cfg.model_dump(),
        "model_cfg": model_cfg.to_dict(),
        "vocab_path": str(out / "vocab.safetensors"),
        "out": str(out),
        "dtype": inputs.dtype,
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "online": online_cfg,
    }
    trainer = trainer_class()(
        _train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=tc.run_name,
            storage_path=str(out / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints),
            failure_config=FailureConfig(max_failures=0),
        ),
        datasets=datasets,
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
    export_dir = export_checkpoint(latest, out / "export", fmt="sglang")
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
              f"{fe['sim_accept_length']:.2f}; export {export_dir}", flush=True)
    return summary


def _online_summary(out: Path, notes: dict[str, Any], timeline: list, row_counts: dict,
                    engine_seconds: dict) -> dict[str, Any]:
    """What an online run did: samples trained per epoch, this start's engine rows per epoch (generated vs captured
    only), the ledger's quarantine and answers, engine busy time, and the hidden-state bytes found on disk under OUT
    afterwards (the mode's promise: 0)."""
    import shutil

    import pyarrow.parquet as pq

    from eaglenest.drafter.online import EPOCHS_FILE, engine_rows, hidden_state_files
    from eaglenest.regen import answer_files, cached_ids

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
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------------ worker side
class _Reporter:
    """Rank 0's sinks: metrics.jsonl, Ray metrics (Prometheus) and progress lines."""

    def __init__(self, out: Path, run_name: str, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.total = total_steps
        self.t0 = time.time()
        self.start_step = 0
        if not enabled:
            return
        from eaglenest.drafter.metrics import TrainMetrics

        m = TrainMetrics.create(run_name)
        self.g_loss, self.g_acc0, self.g_sim, self.c_nonfinite = m.loss, m.acc0, m.sim_accept_length, m.nonfinite

    def truncate_after(self, step: int) -> None:
        """Drop records a killed run wrote past the checkpoint it resumes from (-1: a fresh start, drop all)."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and step >= 0 and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))
        self.start_step = step

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if record["kind"] == "train":
            self.g_loss.set(record["loss"])
            self.g_acc0.set(record["acc_0"])
            self.g_sim.set(record["sim_accept_length"])

    def nonfinite(self) -> None:
        if self.enabled:
            self.c_nonfinite.inc(1)

    def progress(self, step: int, epoch: int, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        done = step - self.start_step
        el = time.time() - self.t0
        eta = el / max(done, 1) * (self.total - step)
        _log(f"step {step}/{self.total} ({100 * step / self.total:.0f}%) epoch {epoch} loss {rec['loss']:.4f} "
             f"acc_0 {rec['acc_0']:.3f} sim_accept {rec['sim_accept_length']:.2f} lr {rec['lr']:.2e} "
             f"{rec['tokens_per_s']:.0f} tok/s ETA {eta:.0f}s")


def _all_reduce(t, world: int):
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def _lr_lambda(total_steps: int, warmup_ratio: float):
    from eaglenest.drafter.steps import warmup_cosine

    return warmup_cosine(total_steps, math.ceil(warmup_ratio * total_steps))


@dataclass
class _TrainState:
    """Where training stands; saved in every checkpoint and restored on resume (data position included)."""

    step: int = 0
    epoch: int = 0
    epoch_batches: int = 0
    """batches of the current epoch already trained on (skipped when a resumed run replays the epoch)"""
    nonfinite_steps: int = 0

    def restore(self, saved: dict[str, Any]) -> None:
        for k, v in asdict(self).items():
            setattr(self, k, int(saved.get(k, v)))


class _Window:
    """Per-step sums (ce, correct, count) and tokens since the last train record, reduced over workers on read."""

    def __init__(self, ttt_steps: int, device: Any, world: int) -> None:
        import torch

        self.sums = torch.zeros(3, ttt_steps, dtype=torch.float64, device=device)
        self.device, self.world = device, world
        self.tokens, self.t0 = 0, time.time()
        self.wait_s = 0.0

    def add_wait(self, seconds: float) -> None:
        """Time this worker waited for its next batch (data starvation: the regen side was slower)."""
        self.wait_s += seconds

    def add_step(self, sums: Any) -> None:
        """A finite step's per-step sums (skipped steps add none)."""
        self.sums += sums

    def add_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def record(self, state: _TrainState, lr: float, step_weight_decay: float, ttt_steps: int) -> dict[str, Any]:
        """The train record of the window (every worker must call it: it all-reduces), then start a new window."""
        import torch

        from eaglenest.drafters.eagle3.ttt import step_metrics

        w = _all_reduce(self.sums.clone(), self.world)
        toks = _all_reduce(torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.device), self.world)
        m = step_metrics(w[0].cpu(), w[1].cpu(), w[2].cpu())
        elapsed = max(1e-9, time.time() - self.t0)
        rec = {"kind": "train", "step": state.step, "epoch": state.epoch, "lr": lr,
               "tokens_per_s": float(toks.item()) / elapsed, "data_wait_fraction": min(1.0, self.wait_s / elapsed),
               "nonfinite_steps": state.nonfinite_steps, "time": time.time(), **m}
        rec["loss"] = sum(step_weight_decay ** k * rec[f"loss_{k}"] for k in range(ttt_steps))
        self.sums.zero_()
        self.tokens, self.t0, self.wait_s = 0, time.time(), 0.0
        return rec


class _Worker:
    """One Ray Train worker's run: the drafter, its optimizer and data, and the step / eval / checkpoint actions."""

    def __init__(self, config: dict[str, Any]) -> None:
        import ray.train
        import ray.train.torch
        import torch

        from eaglenest.contracts.target import TargetSpec
        from eaglenest.drafter.steps import compute_dtype_for, init_drafter, make_optimizer
        from eaglenest.drafters.eagle3.config import DrafterModelConfig
        from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective
        from eaglenest.drafters.vocab import VocabMapping

        self.cfg = EaglenestConfig.model_validate(config["cfg"])
        tc = self.tc = self.cfg.train
        self.out = Path(config["out"])
        self.vocab_path = config["vocab_path"]
        self.total_steps, self.dtype_name = int(config["total_steps"]), config["dtype"]
        self.online: dict[str, Any] | None = config.get("online")
        self.consumed: dict[int, list[str]] = {}
        """online: epoch -> ids this worker trained on (rank 0 also holds those of the checkpoint it resumed)"""
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        if self.device.type != "cuda":
            torch.set_num_threads(max(1, int(tc.cpus_per_worker)))
        torch.manual_seed(tc.seed + self.rank)

        self.model_cfg = DrafterModelConfig.from_dict(config["model_cfg"])
        self.mapping = VocabMapping.load(self.vocab_path)
        embed, lm_head = TargetSpec.read(self.model_cfg.target).load_embed_and_head()
        self.drafter = init_drafter(self.model_cfg, embed, lm_head, self.mapping)
        self.compute_dtype = compute_dtype_for(self.device)
        self.teacher = TeacherHead(lm_head.to(self.compute_dtype), self.mapping).to(self.device)
        del embed, lm_head

        ckpt = self._load_checkpoint()
        self.objective = TTTObjective(self.drafter, tc.ttt_steps, tc.step_weight_decay)
        self.model = ray.train.torch.prepare_model(self.objective)
        self.trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.trainable, lr=tc.learning_rate, weight_decay=tc.weight_decay,
                                        fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           _lr_lambda(self.total_steps, tc.warmup_ratio))
        self.reporter = _Reporter(self.out, tc.run_name, self.total_steps, enabled=self.rank == 0)
        self.state = _TrainState()
        self._resume(ckpt)

    # ------------------------------------------------------------------------------------------- checkpoints
    def _load_checkpoint(self):
        """The newest checkpoint of this run (weights restored into the drafter), or None on a fresh start."""
        import ray.train

        from eaglenest.drafter.checkpoint import load_training_checkpoint, restore

        ckpt_obj = ray.train.get_checkpoint()
        if ckpt_obj is None:
            return None
        with ckpt_obj.as_directory() as d:
            ckpt = load_training_checkpoint(d)
        if ckpt.config.to_dict() != self.model_cfg.to_dict():
            raise ValueError(f"checkpoint {ckpt.path} was trained with another drafter shape; use a new output dir")
        if ckpt.mapping.fingerprint() != self.mapping.fingerprint():
            raise ValueError(
                f"checkpoint {ckpt.path} holds vocab mapping {ckpt.mapping.fingerprint()} but {self.vocab_path} "
                f"holds {self.mapping.fingerprint()}; the mapping is never rebuilt on resume. Restore the original "
                "vocab.safetensors or start a new output folder."
            )
        restore(ckpt, self.drafter)
        return ckpt

    def _resume(self, ckpt) -> None:
        """Restore optimizer, scheduler and position from ``ckpt``; trim metrics.jsonl to it; log the resume."""
        from eaglenest.drafter.checkpoint import restore, state_fingerprint

        if ckpt is None:
            self.reporter.truncate_after(-1)
            return
        restore(ckpt, self.drafter, self.optimizer, self.scheduler)
        self.state.restore(ckpt.state)
        self.reporter.truncate_after(self.state.step)
        if self.rank != 0:
            return
        record = {
            "resumed_from_step": self.state.step, "checkpoint": str(ckpt.path), "epoch": self.state.epoch,
            "epoch_batches": self.state.epoch_batches,
            "optimizer_fingerprint_checkpoint": ckpt.state.get("optimizer_fingerprint"),
            "optimizer_fingerprint_loaded": state_fingerprint(self.optimizer.state_dict()),
            "vocab_fingerprint_checkpoint": ckpt.mapping.fingerprint(),
            "vocab_fingerprint_run": self.mapping.fingerprint(), "time": time.time(),
        }
        with (self.out / "resume_log.jsonl").open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        _log(f"resumed from step {self.state.step} ({ckpt.path})")

    def checkpoint(self, metrics: dict[str, Any]) -> None:
        """Report a full training checkpoint (rank 0 writes it; every worker reports: it is a barrier)."""
        import ray.train

        from eaglenest.drafter.checkpoint import save_training_checkpoint

        state: dict[str, Any] = asdict(self.state)
        if self.online is not None:
            from eaglenest.drafter.online import STATE_KEY

            state[STATE_KEY] = {str(e): ids for e, ids in self._gather(self.consumed).items()}
        with tempfile.TemporaryDirectory(prefix="eaglenest-ckpt-") as d:
            ck = None
            if self.rank == 0:
                save_training_checkpoint(d, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                                         mapping=self.mapping, state=state)
                ck = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ck, checkpoint_dir_name=f"checkpoint_step{self.state.step:08d}")
        self._checkpointed = self.state.step

    def _gather(self, consumed: dict[int, list[str]]) -> dict[int, list[str]]:
        """Every worker's (epoch -> ids trained on), merged (all workers must call it)."""
        import torch.distributed as dist

        parts: list[Any] = [consumed]
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            parts = [None] * self.world
            dist.all_gather_object(parts, consumed)
        merged: dict[int, list[str]] = {}
        for part in parts:
            for e, ids in part.items():
                merged.setdefault(int(e), []).extend(ids)
        return merged

    def _write_epoch_records(self) -> None:
        """Online, at the end: samples trained per epoch over the whole run (resumes included) into the ledger."""
        from eaglenest.drafter.online import EPOCHS_FILE, LEDGER

        merged = self._gather(self.consumed)
        if self.rank != 0:
            return
        lines = []
        for e, ids in sorted(merged.items()):
            lines.append(json.dumps({"epoch": e, "samples": len(ids), "distinct_samples": len(set(ids))}) + "\n")
            _log(f"epoch {e}: {len(ids)} samples regenerated and trained on")
        (self.out / LEDGER / EPOCHS_FILE).write_text("".join(lines))

    # ------------------------------------------------------------------------------------------ steps and eval
    def forward(self, table: Any, module: Any):
        """The TTT objective on one shard batch: (output, real tokens in the batch)."""
        from eaglenest.drafter.data import collate
        from eaglenest.drafter.steps import autocast_for, ttt_forward

        b = collate(table, dtype=self.dtype_name, hidden_size=self.model_cfg.target_hidden_size,
                    max_seq_len=self.tc.max_seq_len).to(self.device, self.compute_dtype)
        return ttt_forward(b, self.teacher, module, autocast_for(self.device)), b.num_tokens

    def train_step(self, table: Any) -> tuple[Any, int, bool]:
        """Forward, then update unless any worker's loss is non-finite: (output, tokens, updated)."""
        import torch

        from eaglenest.drafter.steps import apply_update

        o, ntok = self.forward(table, self.model)
        finite = torch.isfinite(o.loss.detach()).double().reshape(1)
        ok = bool(_all_reduce(finite, self.world).item() == self.world)
        apply_update(self.optimizer, self.trainable, o.loss if ok else None, self.tc.max_grad_norm)
        return o, ntok, ok

    def evaluate(self, eval_batches) -> dict[str, float] | None:
        """Held-out metrics over every worker's eval shard (None without a held-out split)."""
        import torch

        from eaglenest.drafter.steps import window_sums
        from eaglenest.drafters.eagle3.ttt import step_metrics

        if eval_batches is None:
            return None
        sums = torch.zeros(3, self.tc.ttt_steps, dtype=torch.float64, device=self.device)
        self.drafter.eval()
        with torch.no_grad():
            for table in eval_batches:
                o, _ = self.forward(table, self.objective)
                sums += window_sums(o)
        self.drafter.train()
        _all_reduce(sums, self.world)
        return step_metrics(sums[0].cpu(), sums[1].cpu(), sums[2].cpu())

    def eval_and_log(self, eval_batches, step: int) -> None:
        m = self.evaluate(eval_batches)
        if m is not None:
            self.reporter.write({"kind": "eval", "step": step, "epoch": self.state.epoch, "time": time.time(), **m})
            if self.rank == 0:
                _log(f"held-out @ step {step}: acc_0 {m['acc_0']:.3f} loss_0 {m['loss_0']:.4f} "
                     f"sim_accept_length {m['sim_accept_length']:.2f}")

    def nonfinite(self) -> None:
        """Count a skipped step; too many in a row means training diverged."""
        self.state.nonfinite_steps += 1
        self._consecutive_bad += 1
        self.reporter.nonfinite()
        if self._consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
            raise FloatingPointError(
                f"{self._consecutive_bad} consecutive non-finite losses at step {self.state.step}: training diverged "
                "(lower train.learning_rate or check the shards for NaN hidden states)"
            )

    # ------------------------------------------------------------------------------------------------- the loop
    def run(self) -> None:
        import ray.train

        from eaglenest.drafter.epochs import EvalBatches

        tc = self.tc
        eval_batches = None
        if tc.eval_fraction > 0:
            try:  # the driver drops the eval dataset when the split holds no sample (small data, small fraction)
                eval_batches = EvalBatches(ray.train.get_dataset_shard("eval"), tc.batch_size, EVAL_CACHE_BYTES)
            except KeyError:
                eval_batches = None
        if self.state.step == 0:
            self.eval_and_log(eval_batches, 0)
        self.window = _Window(tc.ttt_steps, self.device, self.world)
        self._consecutive_bad = 0
        self._checkpointed = self.state.step
        self.drafter.train()
        if self.online is None:
            self._run_offline(eval_batches)
        else:
            self._run_online(eval_batches)
        if self.state.step > self._checkpointed:
            # online runs end with their stream, which may come before the planned step count (engine rejects)
            self._record(self.state.step)
            self.eval_and_log(eval_batches, self.state.step)
            self.checkpoint({"step": self.state.step})

    def _run_offline(self, eval_batches) -> None:
        """Epoch by epoch over the shards; a resumed epoch skips the batches its checkpoint trained on."""
        import ray.train

        from eaglenest.drafter.epochs import TrainEpochs

        tc, state = self.tc, self.state
        epochs = TrainEpochs(ray.train.get_dataset_shard("train"), tc.batch_size, tc.seed, TRAIN_CACHE_BYTES)
        while state.step < self.total_steps:
            skip = state.epoch_batches
            ready = time.perf_counter()
            for i, table in enumerate(epochs.epoch(state.epoch)):
                self.window.add_wait(time.perf_counter() - ready)
                if i < skip:
                    continue  # data position: the batches this epoch already trained on before the checkpoint
                state.epoch_batches = i + 1
                if self._step(table, eval_batches, stop_at_total=True):
                    return
                ready = time.perf_counter()
            state.epoch += 1
            state.epoch_batches = 0

    def _run_online(self, eval_batches) -> None:
        """One stream over every epoch left (rows tagged with their epoch); its end is the end of training."""
        import ray.train

        from eaglenest.drafter.epochs import stream_batches
        from eaglenest.drafter.online import EPOCH

        tc, state = self.tc, self.state
        if state.step != self.online["resume_step"]:
            raise RuntimeError(
                f"online resume: the driver planned this start from the checkpoint at step "
                f"{self.online['resume_step']}, but Ray Train restored step {state.step}; rerun the command "
                "(the plan is rebuilt from the checkpoint Ray Train hands out)")
        if self.rank == 0:  # what the restored checkpoint had trained on stays recorded in the next ones
            self.consumed = {int(e): list(ids) for e, ids in self.online["consumed"].items()}
        stream = stream_batches(ray.train.get_dataset_shard("train"), tc.batch_size,
                                local_shuffle_buffer_size=4 * tc.batch_size, local_shuffle_seed=tc.seed + state.step)
        ready = time.perf_counter()
        for table in stream:
            self.window.add_wait(time.perf_counter() - ready)
            for sample_id, epoch in zip(table.column("id").to_pylist(), table.column(EPOCH).to_pylist(), strict=True):
                self.consumed.setdefault(int(epoch), []).append(sample_id)
            state.epoch = max(state.epoch, _column_max(table.column(EPOCH)))
            # the planned step count is an upper bound (engine rejects shorten the stream): only train.max_steps
            # stops an online run before its stream ends
            if self._step(table, eval_batches, stop_at_total=tc.max_steps is not None):
                break
            ready = time.perf_counter()
        self._write_epoch_records()

    def _step(self, table: Any, eval_batches, *, stop_at_total: bool) -> bool:
        """One training step plus its record / eval / checkpoint; True when training is done."""
        from eaglenest.drafter.steps import window_sums

        tc, state = self.tc, self.state
        o, ntok, ok = self.train_step(table)
        if ok:
            self._consecutive_bad = 0
            self.window.add_step(window_sums(o))
        else:
            self.nonfinite()
        self.scheduler.step()
        state.step += 1
        self.window.add_tokens(ntok)
        step = state.step
        last = stop_at_total and step >= self.total_steps
        if step % tc.log_every == 0 or last:
            self._record(step)
        if step % tc.eval_every == 0 or last:
            self.eval_and_log(eval_batches, step)
        if step % tc.checkpoint_every == 0 or last:
            self.checkpoint({"step": step})
        return last

    def _record(self, step: int) -> None:
        rec = self.window.record(self.state, self.scheduler.get_last_lr()[0], self.tc.step_weight_decay,
                                 self.tc.ttt_steps)
        self.reporter.write(rec)
        self.reporter.progress(step, self.state.epoch, rec)


def _column_max(column: Any) -> int:
    import pyarrow.compute as pc

    return int(pc.max(column).as_py())


def _train_loop(config: dict[str, Any]) -> None:
    """Ray Train's per-worker entry point."""
    _Worker(config).run()
