"""Shards -> training batches: the manifest check, the held-out split, and collation of shard rows.

The held-out split is decided per sample id (a salted hash), so it is stable across reruns, shard orders and
worker counts. Batches are right-padded: the TTT loss relies on that (padding only ever follows real tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.contracts.layers import validate_aux_layer_ids
from eaglenest.contracts.shards import DTYPES, FP8, FP8_SCALE_LAYOUT, Manifest, bytes_to_tensor, fp8_parts
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.batch import Batch, pad_batch

__all__ = ["COLUMNS", "Batch", "DataMismatchError", "build_datasets", "check_manifest", "collate",
           "eval_files", "held_out_tables", "is_eval_sample", "pad_batch", "split_counts", "split_table"]

COLUMNS = ["id", "input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"]


class DataMismatchError(ValueError):
    """Shards that were not captured from this target (or with other layers); training them would be wrong."""


def check_manifest(manifest: Manifest, target: TargetSpec, aux_layer_ids: Sequence[int] | None = None) -> None:
    """Refuse shards whose layer ids, hidden size or vocab disagree with the target (or the requested taps)."""
    problems = []
    if manifest.num_layers != target.num_layers:
        problems.append(f"num_layers: shards {manifest.num_layers}, target {target.num_layers}")
    if manifest.hidden_size != target.hidden_size:
        problems.append(f"hidden_size: shards {manifest.hidden_size}, target {target.hidden_size}")
    if manifest.vocab_size != target.vocab_size:
        problems.append(f"vocab_size: shards {manifest.vocab_size}, target {target.vocab_size}")
    if manifest.dtype not in DTYPES:
        problems.append(f"dtype {manifest.dtype!r} is not one of {sorted(DTYPES)}")
    elif manifest.dtype == FP8 and getattr(manifest, "scale_layout", None) != FP8_SCALE_LAYOUT:
        problems.append(f"fp8 shards with scale layout {getattr(manifest, 'scale_layout', None)!r}: this eaglenest "
                        f"reads only {FP8_SCALE_LAYOUT!r} (regenerate, or use the eaglenest that wrote them)")
    try:
        validate_aux_layer_ids(manifest.aux_layer_ids, target.num_layers)
    except ValueError as e:
        problems.append(f"aux_layer_ids: {e}")
    if aux_layer_ids is not None and list(aux_layer_ids) != list(manifest.aux_layer_ids):
        problems.append(
            f"aux_layer_ids: shards were captured at physical layers {manifest.aux_layer_ids}, the config asks "
            f"for {list(aux_layer_ids)}"
        )
    if manifest.num_samples == 0:
        problems.append("the manifest records 0 samples")
    if problems:
        raise DataMismatchError(
            f"the shards in this folder do not match the target {target.path} "
            f"(shards were captured from {manifest.target!r}): " + "; ".join(problems)
            + ". Regenerate the shards with this target (eaglenest regen) or point target.model at the model "
            "the shards came from."
        )


def is_eval_sample(sample_id: str, fraction: float, seed: int = 0) -> bool:
    """Deterministic held-out membership from the sample id."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"eaglenest-split:{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def is_kept(sample_id: str, keep: float, seed: int) -> bool:
    """Deterministic membership of a ``train.mix`` folder's row in a run (salted apart from the held-out split)."""
    if keep >= 1.0:
        return True
    digest = hashlib.sha256(f"eaglenest-mix:{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < keep


def side_mask(ids: Sequence[str], *, fraction: float, seed: int, want_eval: bool, keep: float = 1.0) -> pa.Array:
    """Which of these sample ids are on one side of the split (``keep`` < 1 subsamples a ``train.mix`` folder
    first, :mod:`eaglenest.drafter.mix`)."""
    return pa.array([is_kept(i, keep, seed) and is_eval_sample(i, fraction, seed) == want_eval for i in ids],
                    type=pa.bool_())


def split_table(table: pa.Table, *, fraction: float, seed: int, want_eval: bool, keep: float = 1.0) -> pa.Table:
    """Keep the rows of one side of the split (a ``map_batches`` function over pyarrow tables)."""
    return table.filter(side_mask(table.column("id").to_pylist(), fraction=fraction, seed=seed, want_eval=want_eval,
                                  keep=keep))


def collate(table: pa.Table, *, dtype: str, hidden_size: int, max_seq_len: int) -> Batch:
    """Decode shard rows (pyarrow) into a right-padded batch, truncating sequences to ``max_seq_len``.

    fp8 shards are not dequantised here: the batch keeps their payload and exponents
    (:func:`~eaglenest.contracts.shards.fp8_parts`), so the host-to-device copy moves 1 byte per value, and
    :meth:`Batch.to` dequantises on the training device.
    """
    ids = table.column("input_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    auxes = table.column("aux_hidden_states").to_pylist()
    lasts = table.column("last_hidden_state").to_pylist()
    rows, exponents = [], []
    for i in range(len(ids)):
        full = len(ids[i])
        if dtype == FP8:
            a, a_exp = fp8_parts(auxes[i], 3 * hidden_size, states=3)
            h, h_exp = fp8_parts(lasts[i], hidden_size)
            exponents.append((a_exp, h_exp))
        else:
            a = bytes_to_tensor(auxes[i], dtype, 3 * hidden_size, states=3)
            h = bytes_to_tensor(lasts[i], dtype, hidden_size)
        if a.shape[0] != full or h.shape[0] != full or len(masks[i]) != full:
            sid = table.column("id")[i].as_py()
            raise ValueError(
                f"sample {sid}: {full} tokens but aux {a.shape[0]} / last {h.shape[0]} / mask {len(masks[i])} rows; "
                "the shard is corrupt (rerun regen for it)"
            )
        rows.append((ids[i], masks[i], a, h))
    return pad_batch(rows, max_seq_len=max_seq_len, exponents=exponents if dtype == FP8 else None)


def split_counts(files: Sequence[str | Path], fraction: float, seed: int) -> list[tuple[int, int]]:
    """(train rows, held-out rows) per shard file, reading only the id column."""
    out = []
    for f in files:
        ids = pq.read_table(str(f), columns=["id"]).column("id").to_pylist()
        n_eval = sum(is_eval_sample(sid, fraction, seed) for sid in ids)
        out.append((len(ids) - n_eval, n_eval))
    return out


def eval_files(files: Sequence[str | Path], counts: Sequence[tuple[int, int]],
               max_samples: int | None) -> list[str | Path]:
    """The shortest prefix of ``files`` that holds ``max_samples`` held-out rows (all files when None).

    Evaluation keeps the first ``max_samples`` held-out rows in file order, so the files after that prefix are never
    needed; without it Ray Data reads every shard (all their hidden states) to fill a limit of a few dozen rows.
    """
    if max_samples is None:
        return list(files)
    seen = 0
    for i, (_, n_eval) in enumerate(counts):
        seen += n_eval
        if seen >= max_samples:
            return list(files[: i + 1])
    return list(files)


def build_datasets(files: Sequence[str | Path], fraction: float, seed: int,
                   held_out_files: Sequence[str | Path] | None = None, keep: float = 1.0):
    """Ray datasets ``{"train": ..., "eval": ...}`` over the shard files (read lazily, streamed to workers).

    ``held_out_files``: the files the held-out side reads (default: all; see :func:`eval_files`); ``keep``: the
    share of rows kept (a ``train.mix`` folder's, :func:`is_kept`).
    """
    import ray.data  # only here: the Ray Train workers import this module for collation, which needs no Ray Data

    def side(want_eval: bool, paths: Sequence[str | Path]):
        ds = ray.data.read_parquet([str(f) for f in paths], num_cpus=0.25).select_columns(COLUMNS)  # pushed down
        return ds.map_batches(split_table, batch_format="pyarrow", num_cpus=0.25,
                              fn_kwargs={"fraction": fraction, "seed": seed, "want_eval": want_eval, "keep": keep})

    out = {"train": side(False, files)}
    if fraction > 0:
        tables = held_out_tables(files if held_out_files is None else held_out_files, fraction, seed, keep)
        out["eval"] = ray.data.from_arrow(tables)
    return out


def held_out_tables(files: Sequence[str | Path], fraction: float, seed: int, keep: float = 1.0) -> list[pa.Table]:
    """The held-out rows of ``files``, read here, row group by row group, in file order (one table per file).

    The held-out side is a few dozen rows spread over every shard: read through Ray Data it cost a whole streaming
    execution over the shards it touches before the first training step (46 s for 64 rows at Kimi-K2.5's widths on
    the H200, beside the other draft shape's job doing the same). Read directly, only the row groups that
    hold a held-out row are decoded, one at a time (each at most ``ROW_GROUP_BYTES``), and what is kept is small.
    """
    out = []
    for f in files:
        pf = pq.ParquetFile(str(f))
        parts = []
        for rg in range(pf.num_row_groups):
            ids = pf.read_row_group(rg, columns=["id"]).column("id").to_pylist()
            mask = side_mask(ids, fraction=fraction, seed=seed, want_eval=True, keep=keep)
            if mask.true_count:
                parts.append(pf.read_row_group(rg, columns=COLUMNS).filter(mask))
        out.append(pa.concat_tables(parts) if parts else pf.schema_arrow.empty_table().select(COLUMNS))
    return out
