"""``train.mix``: more regen folders mixed into the training rows of ``--data``, each at a configured share.

Why: a drafter retrained on recent traffic alone over-specialises (a fine-tune lost to its base drafter on the next
model's traffic); the flywheel trains on traffic plus the original data. A mix folder contributes
``share / (1 - all shares)`` times the ``--data`` folder's training rows, subsampled by a salted hash of the sample id
(so the choice is the same on every rerun and resume) -- all of it when it holds fewer. Nothing is copied: the rows
are filtered as they stream, exactly as the held-out split is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.shards import Manifest, read_manifest, shard_files
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.data import check_manifest, is_eval_sample, is_kept, split_counts


@dataclass
class ShardGroup:
    """One folder's shard files and the share of its rows this run keeps (1.0: all)."""

    folder: Path
    files: list[Path]
    keep: float
    counts: list[tuple[int, int]]
    """(train, held-out) rows per file, after the keep filter"""

    @property
    def n_train(self) -> int:
        return sum(t for t, _ in self.counts)

    @property
    def n_eval(self) -> int:
        return sum(e for _, e in self.counts)


def mix_groups(cfg: EaglenestConfig, primary: Path, manifest: Manifest, facts: TargetSpec) -> list[ShardGroup]:
    """The ``--data`` folder (all of it) and every ``train.mix`` folder (checked against the target and the primary
    folder's layers and dtype, subsampled to its share)."""
    tc = cfg.train
    files = shard_files(primary)
    groups = [ShardGroup(primary, files, 1.0, split_counts(files, tc.eval_fraction, tc.seed))]
    total_share = sum(m.share for m in tc.mix)
    if total_share >= 1.0:
        raise ValueError(f"train.mix shares add up to {total_share:g}; they must stay below 1 (the rest is --data)")
    for m in tc.mix:
        folder = Path(cfg.resolve(m.data) or m.data).resolve()
        mf = read_manifest(folder)
        check_manifest(mf, facts, manifest.aux_layer_ids)
        if mf.dtype != manifest.dtype:
            raise ValueError(f"train.mix folder {folder} stores hidden states as {mf.dtype}, --data {primary} as "
                             f"{manifest.dtype}; one run reads one storage dtype (regenerate one of them)")
        mfiles = shard_files(folder)
        if not mfiles:
            raise FileNotFoundError(f"train.mix folder {folder}/shards has no parquet shards")
        full = split_counts(mfiles, tc.eval_fraction, tc.seed)
        available = sum(t for t, _ in full)
        wanted = m.share / (1.0 - total_share) * groups[0].n_train
        keep = 1.0 if available <= wanted else wanted / available
        groups.append(ShardGroup(folder, mfiles, keep, _kept_counts(mfiles, keep, tc.eval_fraction, tc.seed)
                                 if keep < 1.0 else full))
        print(f"[eaglenest train] mix: {folder} share {m.share:g}: {groups[-1].n_train} of {available} training rows "
              f"(keep {keep:.3f})", flush=True)
    return groups


def _kept_counts(files: list[Path], keep: float, fraction: float, seed: int) -> list[tuple[int, int]]:
    import pyarrow.parquet as pq

    out = []
    for f in files:
        ids = [i for i in pq.read_table(str(f), columns=["id"]).column("id").to_pylist() if is_kept(i, keep, seed)]
        n_eval = sum(is_eval_sample(i, fraction, seed) for i in ids)
        out.append((len(ids) - n_eval, n_eval))
    return out


__all__ = ["ShardGroup", "mix_groups"]
