"""The draft vocabulary: the N target tokens the target generates most often, and its d2t / t2d maps.

``d2t[i] = target_id(i) - i`` (int64, length Vd) and ``t2d`` (bool, length V) are what SGLang and vLLM load. The
mapping is built once per training run, stored next to the checkpoints, and always read back on resume: rebuilding
it from different data would silently misalign every trained ``lm_head`` row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_FILE = "vocab.safetensors"


@dataclass
class VocabMapping:
    """Draft vocab: ``draft_ids`` (ascending target ids), with the serving maps and the counts it came from."""

    draft_ids: torch.Tensor
    vocab_size: int
    counts: torch.Tensor

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_ids - torch.arange(self.draft_vocab_size, dtype=torch.long)

    @property
    def t2d(self) -> torch.Tensor:
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        return t2d

    def target_to_draft(self) -> torch.Tensor:
        """``[V]`` long: draft index of each target id, -1 outside the draft vocab."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.long)
        out[self.draft_ids] = torch.arange(self.draft_vocab_size, dtype=torch.long)
        return out

    def coverage(self) -> float:
        """Fraction of counted (loss-masked) tokens that the draft vocab covers."""
        total = float(self.counts.sum())
        return float(self.counts[self.draft_ids].sum()) / total if total else 0.0

    def fingerprint(self) -> str:
        blob = self.draft_ids.to(torch.int64).contiguous().view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(blob + str(self.vocab_size).encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        save_file(
            {"draft_ids": self.draft_ids.contiguous(), "d2t": self.d2t.contiguous(), "t2d": self.t2d,
             "counts": self.counts.contiguous()},
            str(path),
            metadata={"vocab_size": str(self.vocab_size), "fingerprint": self.fingerprint()},
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> VocabMapping:
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls.from_maps(t["d2t"], t["t2d"], t.get("counts"))

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor | None = None) -> VocabMapping:
        """Rebuild from serving maps, checking that they agree with each other."""
        ids = d2t.to(torch.long) + torch.arange(d2t.numel(), dtype=torch.long)
        vocab = int(t2d.numel())
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"d2t maps draft ids outside the target vocab of {vocab}")
        marked = t2d.to(torch.bool).nonzero().flatten()
        if not torch.equal(marked, ids.sort().values) or ids.unique().numel() != ids.numel():
            raise ValueError("d2t and t2d disagree: t2d must mark exactly the target ids that d2t maps to")
        return cls(ids, vocab, counts if counts is not None else torch.zeros(vocab, dtype=torch.long))


def count_tokens(samples: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """Frequency of each target id over loss-masked tokens of ``(input_ids, loss_mask)`` samples."""
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        ids = np.asarray(ids, dtype=np.int64)
        m = np.asarray(mask).astype(bool)
        if ids.shape != m.shape:
            raise ValueError(f"input_ids ({ids.shape}) and loss_mask ({m.shape}) lengths differ")
        sel = ids[m]
        if sel.size and (sel.min() < 0 or sel.max() >= vocab_size):
            raise ValueError(f"token id {int(sel.max())} outside the target vocab of {vocab_size}")
        counts += np.bincount(sel, minlength=vocab_size)
    return torch.from_numpy(counts)


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    """Top-``N`` ids by count (ties: lower id first; unseen ids fill up by id); ``N = min(draft_vocab_size, V)``."""
    import numpy as np

    vocab = int(counts.numel())
    n = min(int(draft_vocab_size), vocab)
    # stable sort on (-count) keeps ascending id order among equal counts: deterministic on every machine
    order = np.argsort(-counts.numpy().astype(np.int64), kind="stable")
    ids = torch.from_numpy(np.sort(order[:n]).astype(np.int64))
    return VocabMapping(ids, vocab, counts.to(torch.long))


def count_tokens_in_shards(files: Sequence[str | Path], vocab_size: int, ids_filter=None) -> torch.Tensor:
    """Count loss-masked tokens over shard files, reading only ``input_ids`` / ``loss_mask`` (and ``id``)."""
    import pyarrow.parquet as pq

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for f in files:
        table = pq.read_table(str(f), columns=["id", "input_ids", "loss_mask"])
        keep = None if ids_filter is None else [ids_filter(i) for i in table.column("id").to_pylist()]
        ids = table.column("input_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        rows = [(i, m) for j, (i, m) in enumerate(zip(ids, masks, strict=True)) if keep is None or keep[j]]
        counts += count_tokens(rows, vocab_size)
    return counts
