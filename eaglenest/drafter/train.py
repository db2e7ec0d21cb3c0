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

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig

METRIC_NAMES = {
    "loss": "eaglenest_train_loss",
    "acc0": "eaglenest_train_acc0",
    "sim": "eaglenest_train_sim_accept_length",
    "nonfinite": "eaglenest_train_loss_nonfinite_total",
}
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
    from eaglenest.contracts.drafter_config import DrafterModelConfig

    d = cfg.train.drafter
    heads = d.num_heads or facts.num_attention_heads
    kv = d.num_kv_heads or (facts.num_key_value_heads if heads == facts.num_attention_heads else heads)
    head_dim = d.head_dim or (facts.head_dim if heads == facts.num_attention_heads else facts.hidden_size // heads)
    return DrafterModelConfig(
        hidden_size=facts.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=d.intermediate_size or facts.intermediate_size,
        vocab_size=facts.vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        target_hidden_size=facts.hidden_size,
        target_num_layers=facts.num_layers,
        rope_theta=facts.rope_theta,
        rms_norm_eps=facts.rms_norm_eps,
        max_position_embeddings=max(d.max_position_embeddings or 0, facts.max_position_embeddings),
        target=facts.path,
        bos_token_id=facts.bos_token_id,
        eos_token_id=facts.eos_token_id,
    )


def prepare_vocab(out: Path, files: list[Path], vocab_size: int, draft_vocab_size: int, fraction: float, seed: int):
    """Build the draft vocab from the training split once; later starts read it back (and refuse a changed size)."""
    from eaglenest.drafter.data import is_eval_sample
    from eaglenest.drafter.vocab import VOCAB_FILE, VocabMapping, build_vocab_mapping, count_tokens_in_shards

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
    counts = count_tokens_in_shards(files, vocab_size, ids_filter=lambda i: not is_eval_sample(i, fraction, seed))
    if int(counts.sum()) == 0:
        raise ValueError("the training split has no loss-masked tokens: nothing to learn (check regen's loss masks)")
    mapping = build_vocab_mapping(counts, want)
    mapping.save(path)
    return mapping, True


def ensure_ray(num_cpus_needed: float) -> None:
    """Use a running Ray (``ray job submit`` sets RAY_ADDRESS, or ``ray start`` ran here) or start a local one sized
    for the workers."""
    from eaglenest.runtime import init_ray

    init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(num_cpus_needed)), include_dashboard=False)


def _trainer_class():
    """TorchTrainer without Train V2's placement-group cleaner.

    The cleaner asks the Ray state API (with no address) whether the controller is alive. When several Ray instances
    run on one machine (CI, shared dev boxes) it can reach another instance's dashboard, which does not know our
    controller and answers "not found"; the cleaner then removes our placement group and kills the running workers.
    A job's placement groups are removed by Ray when the job ends anyway, so nothing leaks without it.
    """
    from ray.train.torch import TorchTrainer

    class EaglenestTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):  # Ray 2.60 (pinned): the trainer's default callback list
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return EaglenestTorchTrainer


def train_drafter(cfg: EaglenestConfig, data_dir: str | Path, output_dir: str | Path) -> dict[str, Any]:
    """Train (or resume) a drafter on regen shards; writes checkpoints, metrics, a PNG and ``OUT/export``."""
    from eaglenest.contracts.drafter_config import DrafterModelConfig
    from eaglenest.contracts.shards import read_manifest, shard_files
    from eaglenest.contracts.target import TargetSpec, resolve_target_path
    from eaglenest.drafter.checkpoint import find_latest_checkpoint
    from eaglenest.drafter.data import build_datasets, check_manifest, count_split_rows
    from eaglenest.drafter.export import export_checkpoint
    from eaglenest.drafter.plot import plot_training_curves

    t0 = time.time()
    tc = cfg.train
    data_dir, out = Path(data_dir).resolve(), Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    manifest = read_manifest(data_dir)
    facts = TargetSpec.read(resolve_target_path(cfg.target))
    check_manifest(manifest, facts, cfg.target.aux_layer_ids)
    files = shard_files(data_dir)
    if not files:
        raise FileNotFoundError(f"{data_dir}/shards has no parquet shards (run `eaglenest regen` first)")

    mapping, built = prepare_vocab(out, files, facts.vocab_size, tc.drafter.draft_vocab_size, tc.eval_fraction,
                                   tc.seed)
    model_cfg = resolve_model_config(cfg, facts, manifest.aux_layer_ids, mapping.draft_vocab_size)
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

    n_train, n_eval = count_split_rows(files, tc.eval_fraction, tc.seed)
    rows_per_worker = n_train // tc.num_workers
    if rows_per_worker == 0:
        raise ValueError(f"{n_train} training samples cannot feed {tc.num_workers} workers; lower train.num_workers")
    steps_per_epoch = math.ceil(rows_per_worker / tc.batch_size)
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    print(f"[eaglenest train] target {facts.path}: {facts.num_layers} layers, hidden {facts.hidden_size}, vocab "
          f"{facts.vocab_size}; shards {len(files)} files, {manifest.num_samples} samples at layers "
          f"{manifest.aux_layer_ids} (physical)", flush=True)
    print(f"[eaglenest train] draft vocab {mapping.draft_vocab_size} ({'built' if built else 'reused'}, covers "
          f"{100 * mapping.coverage():.1f}% of loss-masked tokens); split {n_train} train / {n_eval} held-out; "
          f"{steps_per_epoch} steps/epoch, {total_steps} steps", flush=True)

    import ray
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    ensure_ray(tc.num_workers * tc.cpus_per_worker + 2)  # + headroom for the Ray Data list/read tasks
    data_ctx = ray.data.DataContext.get_current()
    bars = data_ctx.enable_progress_bars
    data_ctx.enable_progress_bars = False  # per-operator bars of the streaming split drown the training progress lines
    try:
        datasets = build_datasets(files, tc.eval_fraction, tc.seed)
    finally:
        data_ctx.enable_progress_bars = bars
    datasets["train"] = datasets["train"].randomize_block_order(seed=tc.seed)
    if "eval" in datasets and n_eval == 0:
        del datasets["eval"]
    if "eval" in datasets and tc.eval_max_samples:
        datasets["eval"] = datasets["eval"].limit(tc.eval_max_samples)
    resources = {"CPU": tc.cpus_per_worker}
    if tc.use_gpu:
        resources["GPU"] = 1
    loop_config = {
        "cfg": cfg.model_dump(),
        "model_cfg": model_cfg.to_dict(),
        "vocab_path": str(out / "vocab.safetensors"),
        "out": str(out),
        "dtype": manifest.dtype,
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
    }
    trainer = _trainer_class()(
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
        dataset_config=DataConfig(
            datasets_to_split="all", execution_options=ray.data.ExecutionOptions(preserve_order=True)
        ),
    )
    result = trainer.fit()
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
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    fe = summary["final_eval"]
    if fe:
        print(f"[eaglenest train] done: step {fe['step']} held-out acc_0 {fe['acc_0']:.3f}, simulated accept length "
              f"{fe['sim_accept_length']:.2f}; export {export_dir}", flush=True)
    return summary


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
        from ray.util.metrics import Counter, Gauge

        tags = {"run": run_name}
        self.g_loss = Gauge(METRIC_NAMES["loss"], "drafter TTT training loss (weighted over steps)", ("run",))
        self.g_acc0 = Gauge(METRIC_NAMES["acc0"], "drafter step-0 top-1 agreement with the target", ("run",))
        self.g_sim = Gauge(METRIC_NAMES["sim"], "simulated accept length 1 + sum_k prod_{j<=k} acc_j", ("run",))
        self.c_nonfinite = Counter(METRIC_NAMES["nonfinite"], "training steps skipped for a non-finite loss",
                                   ("run",))
        for m in (self.g_loss, self.g_acc0, self.g_sim, self.c_nonfinite):
            m.set_default_tags(tags)

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
    warmup = math.ceil(warmup_ratio * total_steps)

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _train_loop(config: dict[str, Any]) -> None:  # noqa: C901 - one linear training loop reads best in one place
    import ray.train
    import ray.train.torch
    import torch

    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafter.checkpoint import (
        load_training_checkpoint,
        restore,
        save_training_checkpoint,
        state_fingerprint,
    )
    from eaglenest.drafter.data import collate
    from eaglenest.drafter.ttt import TeacherHead, TTTObjective, step_metrics
    from eaglenest.drafter.vocab import VocabMapping
    from eaglenest.speculative.model import DrafterModelConfig, Eagle3Drafter

    cfg = EaglenestConfig.model_validate(config["cfg"])
    tc = cfg.train
    out = Path(config["out"])
    total_steps, dtype_name = int(config["total_steps"]), config["dtype"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(max(1, int(tc.cpus_per_worker)))
    torch.manual_seed(tc.seed + rank)

    model_cfg = DrafterModelConfig.from_dict(config["model_cfg"])
    mapping = VocabMapping.load(config["vocab_path"])
    embed, lm_head = TargetSpec.read(model_cfg.target).load_embed_and_head()
    drafter = Eagle3Drafter(model_cfg)
    drafter.init_from_target(embed.float(), lm_head.float(), mapping.d2t, mapping.t2d)
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    teacher = TeacherHead(lm_head.to(compute_dtype), mapping).to(device)
    del embed, lm_head

    state = {"step": 0, "epoch": 0, "epoch_batches": 0, "nonfinite_steps": 0}
    ckpt_obj = ray.train.get_checkpoint()
    ckpt = None
    if ckpt_obj is not None:
        with ckpt_obj.as_directory() as d:
            ckpt = load_training_checkpoint(d)
        if ckpt.config.to_dict() != model_cfg.to_dict():
            raise ValueError(f"checkpoint {ckpt.path} was trained with another drafter shape; use a new output dir")
        if ckpt.mapping.fingerprint() != mapping.fingerprint():
            raise ValueError(
                f"checkpoint {ckpt.path} holds vocab mapping {ckpt.mapping.fingerprint()} but {config['vocab_path']} "
                f"holds {mapping.fingerprint()}; the mapping is never rebuilt on resume. Restore the original "
                "vocab.safetensors or start a new output folder."
            )
        restore(ckpt, drafter)

    objective = TTTObjective(drafter, tc.ttt_steps, tc.step_weight_decay)
    model = ray.train.torch.prepare_model(objective)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=tc.learning_rate, betas=(0.9, 0.95), weight_decay=tc.weight_decay,
                                  **({"fused": True} if on_gpu else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total_steps, tc.warmup_ratio))
    reporter = _Reporter(out, tc.run_name, total_steps, enabled=rank == 0)
    if ckpt is not None:
        restore(ckpt, drafter, optimizer, scheduler)
        for k in state:
            state[k] = int(ckpt.state.get(k, state[k]))
        reporter.truncate_after(state["step"])
        if rank == 0:
            record = {
                "resumed_from_step": state["step"], "checkpoint": str(ckpt.path), "epoch": state["epoch"],
                "epoch_batches": state["epoch_batches"],
                "optimizer_fingerprint_checkpoint": ckpt.state.get("optimizer_fingerprint"),
                "optimizer_fingerprint_loaded": state_fingerprint(optimizer.state_dict()),
                "vocab_fingerprint_checkpoint": ckpt.mapping.fingerprint(),
                "vocab_fingerprint_run": mapping.fingerprint(), "time": time.time(),
            }
            with (out / "resume_log.jsonl").open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            _log(f"resumed from step {state['step']} ({ckpt.path})")
    else:
        reporter.truncate_after(-1)
    del ckpt

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    train_it = ray.train.get_dataset_shard("train")
    eval_it = None
    if tc.eval_fraction > 0:
        try:  # the driver drops the eval dataset when the split holds no sample (small data, small fraction)
            eval_it = ray.train.get_dataset_shard("eval")
        except KeyError:
            eval_it = None
    hidden = model_cfg.target_hidden_size

    def batches(it, **kw):
        yield from it.iter_batches(batch_size=tc.batch_size, batch_format="pyarrow", **kw)

    def run_batch(table, module):
        b = collate(table, dtype=dtype_name, hidden_size=hidden, max_seq_len=tc.max_seq_len).to(device, compute_dtype)
        with autocast:
            targets = teacher(b.last, b.loss_mask, b.lengths)
            return module(b.input_ids, b.aux, targets), b.num_tokens

    eval_cache: list | None = None  # held-out tables kept in memory when small (restarting a stream costs seconds)

    def eval_tables():
        nonlocal eval_cache
        if eval_cache is not None:
            yield from eval_cache
            return
        kept, size = [], 0
        for table in batches(eval_it):
            size += table.nbytes
            if kept is not None:
                kept = kept + [table] if size <= EVAL_CACHE_BYTES else None
            yield table
        eval_cache = kept

    def evaluate() -> dict[str, float] | None:
        if eval_it is None:
            return None
        sums = torch.zeros(3, tc.ttt_steps, dtype=torch.float64, device=device)
        drafter.eval()
        with torch.no_grad():
            for table in eval_tables():
                o, _ = run_batch(table, objective)
                sums += torch.stack([o.ce_sum, o.correct, o.count]).double()
        drafter.train()
        _all_reduce(sums, world)
        return step_metrics(sums[0].cpu(), sums[1].cpu(), sums[2].cpu())

    def eval_and_log(step: int) -> None:
        m = evaluate()
        if m is not None:
            reporter.write({"kind": "eval", "step": step, "epoch": state["epoch"], "time": time.time(), **m})
            if rank == 0:
                _log(f"held-out @ step {step}: acc_0 {m['acc_0']:.3f} loss_0 {m['loss_0']:.4f} "
                     f"sim_accept_length {m['sim_accept_length']:.2f}")

    def checkpoint(metrics: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="eaglenest-ckpt-") as d:
            ck = None
            if rank == 0:
                save_training_checkpoint(d, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                                         mapping=mapping, state=dict(state))
                ck = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ck, checkpoint_dir_name=f"checkpoint_step{state['step']:08d}")

    if state["step"] == 0:
        eval_and_log(0)
    window = torch.zeros(3, tc.ttt_steps, dtype=torch.float64, device=device)  # ce sum, correct, count per step
    win_tokens, win_t0, consecutive_bad = 0, time.time(), 0
    drafter.train()
    train_cache: Any = None  # None: not built yet; False: too large to keep; else the worker's rows, sorted by id

    def epoch_tables(epoch: int):
        """One epoch of batches: streamed from Ray Data, or from memory once the split is known to be small.

        Cached epochs visit the rows in a permutation seeded by (seed, epoch) over rows sorted by sample id, so the
        order is a function of the data and the seed alone and a resumed run sees the same batches.
        """
        nonlocal train_cache
        if train_cache is None and epoch > 0:
            # resumed past epoch 0: rebuild the cache first, so this epoch sees the same permutation as before
            for _ in _streamed(epoch):
                if train_cache is False:
                    break  # too large to keep: stop the extra pass at once and stream as usual
        if train_cache is not None and train_cache is not False:
            import numpy as np

            order = np.random.default_rng(tc.seed + 1000 * epoch).permutation(train_cache.num_rows)
            shuffled = train_cache.take(order)
            for start in range(0, shuffled.num_rows, tc.batch_size):
                yield shuffled.slice(start, tc.batch_size)
            return
        yield from _streamed(epoch)

    def _streamed(epoch: int):
        """Stream one epoch from Ray Data, keeping the rows in memory when they fit (TRAIN_CACHE_BYTES)."""
        nonlocal train_cache
        kept, size = [], 0
        for table in batches(train_it, local_shuffle_buffer_size=4 * tc.batch_size,
                             local_shuffle_seed=tc.seed + 1000 * epoch):
            if kept is not None:
                size += table.nbytes
                kept = kept + [table] if size <= TRAIN_CACHE_BYTES else None
                if kept is None:
                    train_cache = False
            yield table
        if kept and train_cache is None:
            import pyarrow as pa

            table = pa.concat_tables(kept)
            train_cache = table.sort_by("id") if "id" in table.column_names else table

    while state["step"] < total_steps:
        skip = state["epoch_batches"]
        it = epoch_tables(state["epoch"])
        for i, table in enumerate(it):
            if i < skip:
                continue  # data position: the batches this epoch already trained on before the checkpoint
            o, ntok = run_batch(table, model)
            finite = torch.isfinite(o.loss.detach()).double().reshape(1)
            ok = bool(_all_reduce(finite, world).item() == world)
            optimizer.zero_grad(set_to_none=True)
            if ok:
                o.loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, tc.max_grad_norm)
                optimizer.step()
                consecutive_bad = 0
                window += torch.stack([o.ce_sum, o.correct, o.count]).double()
            else:
                state["nonfinite_steps"] += 1
                consecutive_bad += 1
                reporter.nonfinite()
                if consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
                    raise FloatingPointError(
                        f"{consecutive_bad} consecutive non-finite losses at step {state['step']}: training diverged "
                        "(lower train.learning_rate or check the shards for NaN hidden states)"
                    )
            scheduler.step()
            state["step"] += 1
            state["epoch_batches"] = i + 1
            win_tokens += ntok
            step = state["step"]
            last = step >= total_steps
            if step % tc.log_every == 0 or last:
                w = _all_reduce(window.clone(), world)
                toks = _all_reduce(torch.tensor([float(win_tokens)], dtype=torch.float64, device=device), world)
                m = step_metrics(w[0].cpu(), w[1].cpu(), w[2].cpu())
                rec = {"kind": "train", "step": step, "epoch": state["epoch"], "lr": scheduler.get_last_lr()[0],
                       "tokens_per_s": float(toks.item()) / max(1e-9, time.time() - win_t0),
                       "nonfinite_steps": state["nonfinite_steps"], "time": time.time(), **m}
                rec["loss"] = sum(tc.step_weight_decay ** k * rec[f"loss_{k}"] for k in range(tc.ttt_steps))
                reporter.write(rec)
                reporter.progress(step, state["epoch"], rec)
                window.zero_()
                win_tokens, win_t0 = 0, time.time()
            if step % tc.eval_every == 0 or last:
                eval_and_log(step)
            if step % tc.checkpoint_every == 0 or last:
                checkpoint({"step": step})
            if last:
                break
        else:
            state["epoch"] += 1
            state["epoch_batches"] = 0
            continue
        break
