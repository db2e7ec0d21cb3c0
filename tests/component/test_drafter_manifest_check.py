"""Training refuses shards whose manifest disagrees with the target (read from the tiny target's folder).

(Moved from tests/unit/test_drafter_vocab.py: it reads the tiny target, so it belongs to the component tier.)"""

from __future__ import annotations

import pytest

from eaglenest.contracts.shards import Manifest
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.data import DataMismatchError, check_manifest


def _manifest(**kw) -> Manifest:
    base = dict(target="t", num_layers=8, hidden_size=128, vocab_size=980, aux_layer_ids=[2, 4, 5],
                dtype="bfloat16", engine="hf", engine_version="x", num_samples=3)
    base.update(kw)
    return Manifest(**base)


def test_manifest_check_refuses_mismatches(tiny_target_path) -> None:
    facts = TargetSpec.read(tiny_target_path)
    check_manifest(_manifest(vocab_size=facts.vocab_size), facts)
    with pytest.raises(DataMismatchError, match="hidden_size: shards 256, target 128"):
        check_manifest(_manifest(vocab_size=facts.vocab_size, hidden_size=256), facts)
    with pytest.raises(DataMismatchError, match="vocab_size"):
        check_manifest(_manifest(vocab_size=facts.vocab_size + 1), facts)
    with pytest.raises(DataMismatchError, match="num_layers"):
        check_manifest(_manifest(vocab_size=facts.vocab_size, num_layers=61), facts)
    with pytest.raises(DataMismatchError, match="out of range"):
        check_manifest(_manifest(vocab_size=facts.vocab_size, aux_layer_ids=[2, 4, 8]), facts)
    with pytest.raises(DataMismatchError, match=r"captured at physical layers \[2, 4, 5\], the config asks for"):
        check_manifest(_manifest(vocab_size=facts.vocab_size), facts, aux_layer_ids=[1, 3, 4])
