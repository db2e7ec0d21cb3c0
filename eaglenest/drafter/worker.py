"""One Ray Train worker of ``eaglenest train``: build the run, resume it, hand its batches to the training loop.

The worker sets up the drafter, teacher head, optimizer and schedule from the driver's config (:func:`train_worker`,
Ray Train's per-worker entry), restores a checkpoint when Ray Train hands one out, and passes
:func:`eaglenest.drafter.loop.train_loop` its batch
iterator: offline, epoch after epoch over the worker's shard split, a resumed epoch skipping the batches its
checkpoint trained on; online, the one stream over every epoch left, recording the (epoch, id) pairs trained on. It
is also the loop's sinks: metrics.jsonl, Prometheus metrics and progress lines (rank 0), and full checkpoints
reported to Ray Train.

Only Ray Train workers import this module (the driver imports it after starting Ray), so Ray is imported at the top.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.batch import Batch
from eaglenest.drafter.checkpoint import (
    TrainingCheckpoint,
    load_training_checkpoint,
    restore,
    save_training_checkpoint,
    state_fingerprint,
)
from eaglenest.drafter.data import collate
from eaglenest.drafter.epochs import EvalBatches, TrainEpochs, cache_budget_bytes, stream_batches
from eaglenest.drafter.init_from import load_init_weights
from eaglenest.drafter.loop import Cadence, Parts, TrainState, train_loop
from eaglenest.drafter.metrics import TrainMetrics
from eaglenest.drafter.online import EPOCH, EPOCHS_FILE, LEDGER, STATE_KEY
from eaglenest.drafter.steps import compute_dtype_for, init_drafter, make_optimizer
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.ttt import TeacherHead, TTTObjective
from eaglenest.drafters.vocab import VocabMapping
from eaglenest.lr_schedule import warmup_cosine

"""A worker's train split up to this size is kept in memory after its first pass: restarting a Ray Data stream
costs seconds per epoch, which dominates many-epoch runs over small data (the demo)."""


def log(msg: str) -> None:
    """One progress line (written directly: Ray Train's print patch would also copy it to stderr, doubling it)."""
    sys.stdout.write(f"[eaglenest train] {msg}\n")
    sys.stdout.flush()


def train_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker entry point."""
    Worker(config).run()


class Worker:
    """One worker's run: the parts the loop steps, the batch iterator it is handed, and the loop's sinks."""

    def __init__(self, config: dict[str, Any]) -> None:
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
        device = ray.train.torch.get_device()
        if device.type != "cuda":
            torch.set_num_threads(max(1, int(tc.cpus_per_worker)))
        torch.manual_seed(tc.seed + self.rank)

        self.model_cfg = DrafterModelConfig.from_dict(config["model_cfg"])
        self.mapping = VocabMapping.load(self.vocab_path)
        embed, lm_head = TargetSpec.read(self.model_cfg.target).load_embed_and_head()
        self.drafter = init_drafter(self.model_cfg, embed, lm_head, self.mapping)
        if config.get("init_from"):  # train.init_from: a fresh run starts from that drafter (a checkpoint overrides)
            load_init_weights(self.drafter, config["init_from"], embed)
        compute_dtype = compute_dtype_for(device)
        teacher = TeacherHead(lm_head.to(compute_dtype), self.mapping).to(device)
        del embed, lm_head

        ckpt = self._load_checkpoint()
        objective = TTTObjective(self.drafter, tc.ttt_steps, tc.step_weight_decay)
        model = ray.train.torch.prepare_model(objective)
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(trainable, lr=tc.learning_rate, weight_decay=tc.weight_decay,
                                        fused=device.type == "cuda")
        warmup = warmup_cosine(self.total_steps, math.ceil(tc.warmup_ratio * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup)
        self.parts = Parts(model=model, objective=objective, teacher=teacher, params=trainable,
                           optimizer=self.optimizer, scheduler=self.scheduler, device=device, dtype=compute_dtype,
                           world=self.world)
        self.reporter = Reporter(self.out, tc.run_name, self.total_steps, enabled=self.rank == 0)
        self.state = TrainState(world=self.world)
        self.cache_bytes = cache_budget_bytes(tc.memory_cache_gib)
        """host memory this worker may keep a pass of its training rows in (and as much for its held-out rows)"""
        self._resume(ckpt)

    # ------------------------------------------------------------------------------------------------- the run
    def run(self) -> None:
        """Hand the loop this worker's batches: offline, epochs of its shard split; online, the one stream."""
        tc = self.tc
        eval_batches = None
        if tc.eval_fraction > 0:
            try:  # the driver drops the eval dataset when the split holds no sample (small data, small fraction)
                eval_batches = EvalBatches(ray.train.get_dataset_shard("eval"), tc.batch_size,
                                           self.cache_bytes)
            except KeyError:
                eval_batches = None
        cadence = Cadence(total_steps=self.total_steps, stop_at_total=self.online is None or tc.max_steps is not None,
                          log_every=tc.log_every, eval_every=tc.eval_every, checkpoint_every=tc.checkpoint_every,
                          max_grad_norm=tc.max_grad_norm)
        # the planned step count of an online run is an upper bound (engine rejects shorten the stream): only
        # train.max_steps stops it before its stream ends
        if self.online is None:
            batches = self._offline_batches()
        else:
            self._check_online_resume()
            batches = self._online_batches()
        train_loop(self.parts, batches, self.collate, self.state, cadence, self, eval_batches)
        if self.online is not None:
            self._write_epoch_records()

    def collate(self, table: pa.Table) -> Batch:
        """One shard batch as a right-padded :class:`Batch` (still on the CPU, in the storage dtype)."""
        return collate(table, dtype=self.dtype_name, hidden_size=self.model_cfg.target_hidden_size,
                       max_seq_len=self.tc.max_seq_len)

    def _offline_batches(self) -> Iterator[pa.Table]:
        """Epoch after epoch over the shards until the planned step count; a resumed epoch skips the batches its
        checkpoint trained on (the data position)."""
        tc, state = self.tc, self.state
        epochs = TrainEpochs(ray.train.get_dataset_shard("train"), tc.batch_size, tc.seed, self.cache_bytes)
        while state.step < self.total_steps:
            skip = state.epoch_batches
            for i, table in enumerate(epochs.epoch(state.epoch)):
                if i < skip:
                    continue
                state.epoch_batches = i + 1
                yield table
            state.epoch += 1
            state.epoch_batches = 0

    def _check_online_resume(self) -> None:
        """The restored step is the one the driver planned the stream from; rank 0 keeps the ids it had trained on."""
        state = self.state
        if state.step != self.online["resume_step"]:
            raise RuntimeError(
                f"online resume: the driver planned this start from the checkpoint at step "
                f"{self.online['resume_step']}, but Ray Train restored step {state.step}; rerun the command "
                "(the plan is rebuilt from the checkpoint Ray Train hands out)")
        if self.rank == 0:  # what the restored checkpoint had trained on stays recorded in the next ones
            self.consumed = {int(e): list(ids) for e, ids in self.online["consumed"].items()}

    def _online_batches(self) -> Iterator[pa.Table]:
        """One stream over every epoch left (rows tagged with their epoch); each row's (epoch, id) is recorded."""
        tc, state = self.tc, self.state
        stream = stream_batches(ray.train.get_dataset_shard("train"), tc.batch_size,
                                local_shuffle_buffer_size=4 * tc.batch_size, local_shuffle_seed=tc.seed + state.step)
        for table in stream:
            for sample_id, epoch in zip(table.column("id").to_pylist(), table.column(EPOCH).to_pylist(), strict=True):
                self.consumed.setdefault(int(epoch), []).append(sample_id)
            state.epoch = max(state.epoch, int(pc.max(table.column(EPOCH)).as_py()))
            yield table

    # ------------------------------------------------------------------------------------------- the loop's sinks
    def log(self, record: dict[str, Any]) -> None:
        """A train or eval record into metrics.jsonl (and Prometheus), with its progress line."""
        self.reporter.write(record)
        if record["kind"] == "train":
            self.reporter.progress(record["step"], self.state.epoch, record)
        elif self.rank == 0:
            log(f"held-out @ step {record['step']}: acc_0 {record['acc_0']:.3f} loss_0 {record['loss_0']:.4f} "
                f"sim_accept_length {record['sim_accept_length']:.2f}")

    def nonfinite(self) -> None:
        self.reporter.nonfinite()

    def checkpoint(self, state: TrainState) -> None:
        """Report a full training checkpoint (rank 0 writes it; every worker reports: it is a barrier)."""
        saved: dict[str, Any] = asdict(state)
        if self.online is not None:
            saved[STATE_KEY] = {str(e): ids for e, ids in self._gather(self.consumed).items()}
        with tempfile.TemporaryDirectory(prefix="eaglenest-ckpt-") as d:
            ck = None
            if self.rank == 0:
                save_training_checkpoint(d, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                                         mapping=self.mapping, state=saved)
                ck = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": state.step}, checkpoint=ck,
                             checkpoint_dir_name=f"checkpoint_step{state.step:08d}")

    # ------------------------------------------------------------------------------------------ resume and ledger
    def _load_checkpoint(self) -> TrainingCheckpoint | None:
        """The newest checkpoint of this run (weights restored into the drafter), or None on a fresh start."""
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

    def _resume(self, ckpt: TrainingCheckpoint | None) -> None:
        """Restore optimizer, scheduler and position from ``ckpt``; trim metrics.jsonl to it; log the resume."""
        if ckpt is None:
            self.reporter.truncate_after(-1)
            return
        restore(ckpt, self.drafter, self.optimizer, self.scheduler)
        self.state.restore({"world": 1, **ckpt.state})  # checkpoints from before the field: one worker
        saved_world = self.state.world
        rescaled_from = self.state.rescale_world(self.world)
        self.reporter.truncate_after(self.state.step)
        if self.rank != 0:
            return
        if rescaled_from is not None:
            log(f"resumed with {self.world} worker(s) from a checkpoint of {saved_world}: this epoch's position "
                f"{rescaled_from} batches per worker becomes {self.state.epoch_batches} (the same samples); the "
                f"run is re-planned for {self.world} worker(s): {self.total_steps} steps in all")
        record = {
            "world_size_checkpoint": saved_world, "world_size_run": self.world,
            "epoch_batches_checkpoint": rescaled_from if rescaled_from is not None else self.state.epoch_batches,
            "resumed_from_step": self.state.step, "checkpoint": str(ckpt.path), "epoch": self.state.epoch,
            "epoch_batches": self.state.epoch_batches,
            "optimizer_fingerprint_checkpoint": ckpt.state.get("optimizer_fingerprint"),
            "optimizer_fingerprint_loaded": state_fingerprint(self.optimizer.state_dict()),
            "vocab_fingerprint_checkpoint": ckpt.mapping.fingerprint(),
            "vocab_fingerprint_run": self.mapping.fingerprint(), "time": time.time(),
        }
        with (self.out / "resume_log.jsonl").open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        log(f"resumed from step {self.state.step} ({ckpt.path})")

    def _gather(self, consumed: dict[int, list[str]]) -> dict[int, list[str]]:
        """Every worker's (epoch -> ids trained on), merged (all workers must call it)."""
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
        merged = self._gather(self.consumed)
        if self.rank != 0:
            return
        lines = []
        for e, ids in sorted(merged.items()):
            lines.append(json.dumps({"epoch": e, "samples": len(ids), "distinct_samples": len(set(ids))}) + "\n")
            log(f"epoch {e}: {len(ids)} samples regenerated and trained on")
        (self.out / LEDGER / EPOCHS_FILE).write_text("".join(lines))


class Reporter:
    """Rank 0's sinks: metrics.jsonl, Ray metrics (Prometheus) and progress lines."""

    def __init__(self, out: Path, run_name: str, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.total = total_steps
        self.t0 = time.time()
        self.start_step = 0
        if not enabled:
            return
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
        log(f"step {step}/{self.total} ({100 * step / self.total:.0f}%) epoch {epoch} loss {rec['loss']:.4f} "
            f"acc_0 {rec['acc_0']:.3f} sim_accept {rec['sim_accept_length']:.2f} lr {rec['lr']:.2e} "
            f"{rec['tokens_per_s']:.0f} tok/s ETA {eta:.0f}s")
