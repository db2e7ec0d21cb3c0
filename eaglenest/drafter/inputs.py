"""What ``eaglenest train`` feeds Ray Train: the draft vocab, the datasets (offline shards or the online stream) and
the split sizes.

Ray (and what imports it) is imported inside the functions, after :func:`_init_ray`: importing it costs seconds, and
the input folder is checked first, so a refused one fails at once without Ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.shards import read_manifest, shard_files
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.data import build_datasets, check_manifest, eval_files, is_eval_sample, is_kept
from eaglenest.drafter.mix import mix_groups
from eaglenest.drafter.online import count_regenerated_tokens, online_datasets, plan_online, read_resume
from eaglenest.drafters.vocab import VOCAB_FILE, VocabMapping, build_vocab_mapping, count_tokens_in_shards
from eaglenest.regen import cached_ids
from eaglenest.runtime import init_ray


@dataclass
class Inputs:
    """What the trainer is fed: datasets (+ per-dataset execution options), the draft vocab and the split sizes."""

    aux_layer_ids: list[int]
    dtype: str
    mapping: VocabMapping
    vocab_built: bool
    n_train: int
    n_eval: int
    datasets: dict[str, Any]
    options: dict[str, Any]
    online: dict[str, Any] | None = None
    """online runs: what the workers need (the restored step, the ids trained on before it) and the tracker"""
    notes: dict[str, Any] | None = None
    """online runs: the plan and resume figures that go into ``summary.json``"""


def _vocab(out: Path, vocab_size: int, draft_vocab_size: int, count: Callable[[], Any]) -> tuple[VocabMapping, bool]:
    """The run's draft vocab: read back when it exists (a changed size is refused), else built from ``count()``."""
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


def prepare_vocab(out: Path, files: list[Path], vocab_size: int, draft_vocab_size: int, fraction: float,
                  seed: int) -> tuple[VocabMapping, bool]:
    """Build the draft vocab from the training split once; later starts read it back (and refuse a changed size)."""
    return _vocab(out, vocab_size, draft_vocab_size, lambda: count_tokens_in_shards(
        files, vocab_size, ids_filter=lambda i: not is_eval_sample(i, fraction, seed)))


def _init_ray(cfg: EaglenestConfig, *, online: bool) -> None:
    """A running Ray (``ray job submit`` sets RAY_ADDRESS, or ``ray start`` ran here), else a local one sized for the
    workers + headroom for the Ray Data list/read tasks (and, online, the engine actors). Called once the input
    folder has passed its checks, so a refused one costs no Ray start."""
    tc = cfg.train
    extra = cfg.regen.num_actors * cfg.regen.num_cpus_per_actor + 1 if online else 0
    init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(tc.num_workers * tc.cpus_per_worker + 2 + extra)),
             include_dashboard=False)


def given_vocab(out: Path, mapping: VocabMapping) -> tuple[VocabMapping, bool]:
    """``train.init_from``'s draft vocab: saved on the first start, and a later start must find the same one (its
    ``lm_head`` rows depend on it)."""
    path = out / VOCAB_FILE
    if path.is_file():
        have = VocabMapping.load(path)
        if have.fingerprint() != mapping.fingerprint():
            raise ValueError(f"{path} holds draft vocab {have.fingerprint()}, but train.init_from's drafter has "
                             f"{mapping.fingerprint()}; use a new output folder to start from that drafter")
        return have, False
    mapping.save(path)
    return mapping, True


def shard_inputs(cfg: EaglenestConfig, data_dir: Path, out: Path, facts: TargetSpec,
                 vocab: VocabMapping | None = None) -> Inputs:
    """Offline: a regen folder's shards (and ``train.mix``'s, at their shares), checked against the target; the
    held-out split by sample id. ``vocab``: the draft vocab of ``train.init_from``'s drafter (else counted)."""
    tc = cfg.train
    manifest = read_manifest(data_dir)
    check_manifest(manifest, facts, cfg.target.aux_layer_ids)
    if not shard_files(data_dir):
        raise FileNotFoundError(f"{data_dir}/shards has no parquet shards (run `eaglenest regen` first)")
    groups = mix_groups(cfg, data_dir, manifest, facts)

    def count() -> Any:
        return sum(count_tokens_in_shards(g.files, facts.vocab_size, ids_filter=lambda i, k=g.keep: (
            is_kept(i, k, tc.seed) and not is_eval_sample(i, tc.eval_fraction, tc.seed))) for g in groups)

    if vocab is not None:
        mapping, built = given_vocab(out, vocab)
    else:
        mapping, built = _vocab(out, facts.vocab_size, tc.drafter.draft_vocab_size, count)
    n_train, n_eval = sum(g.n_train for g in groups), sum(g.n_eval for g in groups)
    print(f"[eaglenest train] shards {sum(len(g.files) for g in groups)} files in {len(groups)} folder(s), "
          f"{manifest.num_samples} samples in --data at layers {manifest.aux_layer_ids} (physical)", flush=True)
    _init_ray(cfg, online=False)
    import ray.data

    data_ctx = ray.data.DataContext.get_current()
    bars = data_ctx.enable_progress_bars
    data_ctx.enable_progress_bars = False  # per-operator bars of the streaming split drown the training progress lines
    try:
        parts = [build_datasets(g.files, tc.eval_fraction, tc.seed, keep=g.keep,
                                held_out_files=eval_files(g.files, g.counts, tc.eval_max_samples)) for g in groups]
    finally:
        data_ctx.enable_progress_bars = bars
    datasets = {k: parts[0][k].union(*[p[k] for p in parts[1:]]) if len(parts) > 1 else parts[0][k]
                for k in parts[0]}
    datasets["train"] = datasets["train"].randomize_block_order(seed=tc.seed)
    if "eval" in datasets and n_eval == 0:
        del datasets["eval"]
    if "eval" in datasets and tc.eval_max_samples:
        datasets["eval"] = datasets["eval"].limit(tc.eval_max_samples)
    return Inputs(aux_layer_ids=list(manifest.aux_layer_ids), dtype=manifest.dtype, mapping=mapping,
                  vocab_built=built, n_train=n_train, n_eval=n_eval, datasets=datasets,
                  options={"train": ray.data.ExecutionOptions(preserve_order=True),
                           "eval": ray.data.ExecutionOptions(preserve_order=True)})


def online_inputs(cfg: EaglenestConfig, out: Path, facts: TargetSpec, limit: int | None,
                  vocab: VocabMapping | None = None) -> Inputs:
    """Online: regen's plan and engine stage, streamed (see :mod:`eaglenest.drafter.online`)."""
    tc = cfg.train
    _init_ray(cfg, online=True)  # planning already runs on Ray Data
    from eaglenest.regen import ProgressTracker  # a Ray actor class: imports Ray

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
    mapping, built = given_vocab(out, vocab) if vocab is not None else _vocab(
        out, facts.vocab_size, tc.drafter.draft_vocab_size,
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
    return Inputs(aux_layer_ids=list(plan.identity["aux_layer_ids"]),
                  dtype=plan.identity["dtype"], mapping=mapping, vocab_built=built, n_train=len(plan.train_ids),
                  n_eval=n_eval, datasets=datasets, options=options,
                  online={"resume_step": resume.step, "consumed": resume.consumed, "tracker": tracker},
                  notes={"ledger": str(plan.ledger), "planned_train": len(plan.train_ids),
                         "planned_eval": len(plan.eval_ids), "quarantined_while_normalizing": plan.quarantined_now,
                         "answers_cached_at_start": cached, "answers_dropped_for_settings": plan.answers_dropped,
                         "resumed_from_step": resume.step if resume.checkpoint else None,
                         "already_trained_before_resume": resume.trained,
                         "already_trained_per_epoch": {e: len(v) for e, v in sorted(resume.consumed.items())}})
