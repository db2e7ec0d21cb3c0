"""Online training's data side: regen's plan and engine stage streamed into Ray Train (hidden states never written).

``eaglenest train --online`` (or ``train.data: online``) builds regen's plan from the configured sources, runs it
through the same engine actor pool as ``eaglenest regen`` (:func:`eaglenest.regen.regenerate_dataset`) and hands
the result to Ray Train as a streaming dataset, so hidden states go engine -> object store -> worker. Only the
ledger is written, under ``OUT/online``: ``run.json`` (the target identity), ``plan/`` (the work list, rebuilt by
every start), ``quarantine/`` (rows the normalizer or the engine stage rejected, as in a regen folder) and
``answers/`` (the ids and loss mask of every regenerated answer: :mod:`eaglenest.regen.answers`).

The whole run is **one stream**: the plan is read once per epoch, epoch after epoch (each epoch in its own block
order), and every row carries its epoch, so one engine pool serves every epoch and the trainer never waits for an
engine restart at an epoch boundary. Boundaries are soft: the last rows of an epoch may still be in flight when the
first of the next arrive.

What "exactly once" means here: **per epoch**, each planned training sample contributes to exactly one optimizer
step of the drafter that survives. The workers record the (epoch, id) pairs they trained on in every checkpoint; a
killed run resumes from the checkpoint Ray Train restores and streams, for every epoch, only the samples that
checkpoint has not seen (samples trained after it go through the engines again: their updates died with the run).
Quarantined samples are done for good (delete their ledger file to retry them).

A sample's answer is **generated once and re-captured** after that: the engine actors file every answer they
generate in ``answers/``, and a later row of the same sample (a later epoch, a vocab-pass sample in epoch 1, a rerun
after a kill) is captured only (the answer goes through the Regenerator as a native sample). Greedy answers come out
the same anyway, and generation is the engine's dominant cost; with sampling the cached answer keeps every epoch
on the same data, as offline training's shards do. The hidden states are captured again every epoch: caching them
would be the terabytes this mode avoids. Epochs stream back to back, so a row can reach an engine before the answer
of the same sample from the previous epoch is filed (a batch in flight on another actor): it is then generated again.
Engine time is one regen pass plus a capture pass per further epoch; `eaglenest plan` prints it.

The held-out split is streamed once per start, before training, and kept in the object store (small by
``train.eval_max_samples``). The draft vocabulary is counted on the first start from ``train.online_vocab_samples``
training samples regenerated up front (ids and loss masks counted, hidden states dropped; the answers are filed, so
epoch 0 only captures these samples): it must exist before the drafter does, and the target's own answers are what
the drafter will propose. (Counting the dataset's original answers instead covered 82% of the regenerated tokens on
the tiny target, against 100% for offline training's count, and cost 16% of held-out accept length: BENCHMARKS.md
"Online training".)

Ray, and the regen modules that import it (its plan, sources and engine stage), are imported inside the functions:
the driver imports this module before it starts Ray, and importing Ray costs seconds.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.shards import HIDDEN_COLUMNS
from eaglenest.drafter.checkpoint import STATE
from eaglenest.drafter.data import COLUMNS, is_eval_sample
from eaglenest.drafters.vocab import count_tokens

LEDGER = "online"
READ_CPUS = 0.25
EPOCHS_FILE = "epochs.jsonl"
"""ledger file, written at the end of a run: one record per epoch (samples trained on, distinct samples)"""
STATE_KEY = "online_consumed"
"""train_state.json key of a checkpoint: {epoch: ids trained on} over the run so far"""
EPOCH = "epoch"
"""the column every streamed row carries: the epoch it belongs to"""


@dataclass
class OnlineResume:
    """Where the checkpoint a rerun restores stands: its step and the ids each epoch has trained on."""

    step: int = 0
    consumed: dict[int, list[str]] = field(default_factory=dict)
    checkpoint: str | None = None

    @property
    def trained(self) -> int:
        return sum(len(v) for v in self.consumed.values())


def read_resume(run_dir: Path) -> OnlineResume:
    """The position of the checkpoint Ray Train will restore for this run (a fresh run: epoch 0, nothing consumed).

    Asked through Ray Train's own record of the run (``Result.from_path``), not the newest folder on disk: a
    checkpoint written but not yet registered when the driver died is not the one the workers get back.
    """
    from ray.train import Result

    if not run_dir.is_dir():
        return OnlineResume()
    try:
        ckpt = Result.from_path(str(run_dir)).checkpoint
    except RuntimeError:  # the run never registered a checkpoint
        return OnlineResume()
    if ckpt is None:
        return OnlineResume()
    path = Path(ckpt.path)
    state = json.loads((path / STATE).read_text())
    consumed = {int(e): list(ids) for e, ids in (state.get(STATE_KEY) or {}).items()}
    return OnlineResume(step=int(state.get("step", 0)), consumed=consumed, checkpoint=str(path))


@dataclass
class OnlinePlan:
    """The ledger folder, the target identity and the split of this start's plan."""

    ledger: Path
    identity: dict[str, Any]
    files: list[str]
    train_ids: list[str]
    eval_ids: list[str]
    quarantined_now: int
    inputs: int
    duplicates: int
    answers_dropped: int = 0
    """answers files of other sampling or length settings, deleted at this start"""


def plan_online(cfg: EaglenestConfig, out: Path, limit: int | None = None) -> OnlinePlan:
    """Normalize and dedup the sources into ``OUT/online/plan`` (quarantined ids of earlier starts are skipped)."""
    from eaglenest.regen import (
        answer_settings,
        build_plan,
        check_identity,
        check_sources,
        prepare_answer_cache,
        remove_stale_temporaries,
        resolved_sources,
        scan_completed,
        target_identity,
    )

    sources = resolved_sources(cfg)
    check_sources(sources)
    ledger = out / LEDGER
    identity = target_identity(cfg)
    check_identity(ledger, identity)
    remove_stale_temporaries(ledger)
    dropped = prepare_answer_cache(ledger, answer_settings(cfg))
    done = scan_completed(ledger)  # the ledger has no shards: its quarantined ids, done for good
    plan = build_plan(sources, ledger, limit=limit, completed=done, rows_per_file=cfg.regen.batch_size)
    tc = cfg.train
    train_ids = [i for i in plan.plan_ids if not is_eval_sample(i, tc.eval_fraction, tc.seed)]
    eval_ids = [i for i in plan.plan_ids if is_eval_sample(i, tc.eval_fraction, tc.seed)]
    return OnlinePlan(ledger=ledger, identity=identity, files=plan.files, train_ids=train_ids, eval_ids=eval_ids,
                      quarantined_now=sum(plan.quarantined_now.values()), inputs=sum(plan.inputs_per_source.values()),
                      duplicates=sum(plan.duplicates_per_source.values()), answers_dropped=dropped)


def vocab_sample(train_ids: list[str], n: int, seed: int) -> list[str]:
    """``n`` training ids spread over every source (a salted-hash order, not the plan's source order)."""
    def key(i: str) -> bytes:
        return hashlib.sha256(f"eaglenest-vocab:{seed}:{i}".encode()).digest()

    return sorted(train_ids, key=key)[:n]


def count_regenerated_tokens(cfg: EaglenestConfig, plan: OnlinePlan, vocab_size: int, tracker: Any = None) -> Any:
    """Token frequencies of regenerated answers of a sample of the training split (the draft vocab of an online run).

    The vocab must be fixed before the drafter exists, and the target's own answers are what it will draft, so
    ``train.online_vocab_samples`` training samples are regenerated once up front (hidden states dropped as they
    arrive, only ids and loss masks counted; the engines file the answers, so the stream captures them only); the
    original answers would miss the target's own token choices.
    """
    ids = frozenset(vocab_sample(plan.train_ids, cfg.train.online_vocab_samples, cfg.train.seed))
    counts = torch.zeros(vocab_size, dtype=torch.long)
    with _quiet_data():
        ds = _stream(cfg, plan, want_eval=False, epochs=[0], include=ids, tracker=tracker,
                     stream="vocab").select_columns(["input_ids", "loss_mask"])
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            counts += count_tokens(zip(batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist(),
                                       strict=True), vocab_size)
    return counts


def _split_rows(table: pa.Table, *, fraction: float, seed: int, want_eval: bool,
                exclude: frozenset[str] = frozenset(), include: frozenset[str] | None = None) -> pa.Table:
    keep = [is_eval_sample(i, fraction, seed) == want_eval and i not in exclude and (include is None or i in include)
            for i in table.column("id").to_pylist()]
    return table.filter(pa.array(keep, type=pa.bool_()))


def _plan_rows(items: pa.Table, *, fraction: float, seed: int, want_eval: bool,
               exclude: dict[int, frozenset[str]], include: frozenset[str] | None) -> pa.Table:
    """(plan file, epoch) items -> that file's rows of one side of the split, minus the epoch's exclusions, tagged
    with the epoch."""
    parts = []
    for path, epoch in zip(items.column("path").to_pylist(), items.column(EPOCH).to_pylist(), strict=True):
        rows = _split_rows(pq.read_table(path), fraction=fraction, seed=seed, want_eval=want_eval,
                           exclude=exclude.get(epoch, frozenset()), include=include)
        parts.append(rows.append_column(EPOCH, pa.array([epoch] * rows.num_rows, type=pa.int32())))
    return pa.concat_tables(parts)


def epoch_order(files: list[str], epochs: list[int], seed: int) -> list[dict[str, Any]]:
    """The stream's work list: every plan file once per epoch, epoch after epoch, each epoch in its own order."""
    items = []
    for e in epochs:
        order = list(files)
        random.Random(f"eaglenest-epoch:{seed}:{e}").shuffle(order)  # mixes sources; another order every epoch
        items += [{"path": f, EPOCH: e} for f in order]
    return items


def _quiet_data() -> Any:
    """Ray Data options of every online stream (no per-operator bars: the trainer's lines are the progress)."""
    from eaglenest.regen import data_context

    return data_context(preserve_order=False, use_datasource_v2=False, enable_progress_bars=False)


def _stream(cfg: EaglenestConfig, plan: OnlinePlan, *, want_eval: bool, epochs: list[int],
            exclude: dict[int, frozenset[str]] | None = None, include: frozenset[str] | None = None,
            limit: int | None = None, tracker: Any = None, stream: str = "train") -> Any:
    """Plan rows of one side of the split, for ``epochs`` -> engine stage -> ledger: regenerated rows in
    ``COLUMNS`` + their epoch (the engines report their rows to ``tracker`` as ``stream``)."""
    import ray.data

    from eaglenest.regen import regenerate_dataset

    tc = cfg.train
    items = epoch_order(plan.files, epochs, tc.seed)
    ds = ray.data.from_items(items, override_num_blocks=len(items)) if items else ray.data.from_items([])
    ds = ds.map_batches(_plan_rows, batch_size=1, batch_format="pyarrow", num_cpus=READ_CPUS,
                        fn_kwargs={"fraction": tc.eval_fraction, "seed": tc.seed, "want_eval": want_eval,
                                   "exclude": exclude or {}, "include": include})
    if limit is not None:
        ds = ds.limit(limit)
    return regenerate_dataset(ds, cfg, plan.identity, tracker, ledger_dir=str(plan.ledger), columns=[*COLUMNS, EPOCH],
                              stream=stream)


def remaining_epochs(plan: OnlinePlan, resume: OnlineResume, epochs: int) -> dict[int, frozenset[str]]:
    """Epochs with samples left to train on -> the ids each has already trained on (to skip)."""
    todo = set(plan.train_ids)
    out = {}
    for e in range(epochs):
        done = frozenset(resume.consumed.get(e, ()))
        if todo - done:
            out[e] = done
    return out


def online_datasets(cfg: EaglenestConfig, plan: OnlinePlan, resume: OnlineResume,
                    tracker: Any = None) -> tuple[dict[str, Any], dict[str, Any], int, list[int]]:
    """Ray Train's datasets and their execution options; the held-out one is regenerated now (materialized).

    ``train`` is one stream over every epoch that has samples left (all of them on a fresh start). Returns
    (datasets, execution options per dataset, held-out rows regenerated, the epochs streamed).
    """
    from ray.data import ExecutionOptions, ExecutionResources

    tc = cfg.train
    buffer = ExecutionOptions(resource_limits=ExecutionResources(object_store_memory=tc.online_buffer_mb << 20),
                              preserve_order=False)
    todo = remaining_epochs(plan, resume, tc.epochs)
    datasets: dict[str, Any] = {}
    n_eval = 0
    with _quiet_data():
        if plan.eval_ids and tc.eval_fraction > 0:
            datasets["eval"] = _stream(cfg, plan, want_eval=True, epochs=[0], limit=tc.eval_max_samples,
                                       tracker=tracker, stream="eval").materialize()
            n_eval = datasets["eval"].count()
            if n_eval == 0:
                del datasets["eval"]
        datasets["train"] = _stream(cfg, plan, want_eval=False, epochs=sorted(todo), exclude=todo, tracker=tracker)
    return datasets, {"train": buffer}, n_eval, sorted(todo)



ROW_KINDS = ("generated", "capture_only", "skipped_quarantined")
"""what an engine did with a row: generated its answer (then captured), captured a filed answer (or a native
sample) only, or dropped it because the ledger holds the sample in quarantine"""


def engine_rows(counts: dict[str, dict[int, list[int]]]) -> dict[str, Any]:
    """The tracker's row counts -> ``summary.json``'s: the training stream per epoch, the held-out split and the
    draft-vocab pass (this start's engines only)."""
    def named(c: list[int]) -> dict[str, int]:
        return dict(zip(ROW_KINDS, c, strict=True))

    def total(per_epoch: dict[int, list[int]]) -> dict[str, int]:
        return named([sum(c[k] for c in per_epoch.values()) for k in range(len(ROW_KINDS))])

    return {"rows_per_epoch": [{"epoch": int(e), **named(c)} for e, c in sorted(counts.get("train", {}).items())],
            "held_out_rows": total(counts.get("eval", {})), "vocab_rows": total(counts.get("vocab", {}))}


def hidden_state_files(out: Path) -> list[Path]:
    """Parquet files under ``out`` that hold hidden states (an online run must leave none; its answers files hold
    ids and masks only)."""
    found = []
    for p in out.rglob("*.parquet"):
        try:
            if set(HIDDEN_COLUMNS) & set(pq.read_schema(p).names):
                found.append(p)
        except Exception:  # noqa: BLE001 - an unreadable file holds no readable hidden states either
            continue
    return found
