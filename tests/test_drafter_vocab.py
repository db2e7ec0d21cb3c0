"""Draft vocab mapping, manifest checks and shard collation (no Ray)."""

from __future__ import annotations

import pytest
import torch

from eaglenest.contracts.shards import Manifest, tensor_to_bytes
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.data import DataMismatchError, check_manifest, collate, is_eval_sample
from eaglenest.drafter.train import prepare_vocab
from eaglenest.drafter.vocab import VocabMapping, build_vocab_mapping, count_tokens


def test_counts_only_loss_masked_tokens() -> None:
    counts = count_tokens([([1, 2, 2, 3], [0, 1, 1, 0]), ([3, 3], [1, 1])], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_tokens([([7], [1])], vocab_size=5)


def test_top_n_with_deterministic_ties_and_padding() -> None:
    counts = torch.tensor([5, 9, 5, 0, 5, 1, 0, 0])
    m = build_vocab_mapping(counts, 4)
    assert m.draft_ids.tolist() == [0, 1, 2, 4]  # 9, then the three 5s; ties kept by id
    assert m.d2t.tolist() == [0, 0, 0, 1]
    assert m.t2d.nonzero().flatten().tolist() == [0, 1, 2, 4]
    padded = build_vocab_mapping(counts, 7)  # fewer seen tokens than N: unseen ids fill up by id
    assert padded.draft_ids.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert build_vocab_mapping(counts, 100).draft_vocab_size == 8  # capped at the target vocab
    assert m.target_to_draft()[4] == 3 and m.target_to_draft()[3] == -1
    assert m.coverage() == pytest.approx(24 / 25)
    assert m.fingerprint() == build_vocab_mapping(counts.clone(), 4).fingerprint()


def test_mapping_round_trip_and_consistency(tmp_path) -> None:
    m = build_vocab_mapping(torch.tensor([3, 0, 7, 7, 1, 0]), 3)
    back = VocabMapping.load(m.save(tmp_path / "v.safetensors"))
    assert torch.equal(back.draft_ids, m.draft_ids) and torch.equal(back.counts, m.counts)
    bad_t2d = m.t2d.clone()
    bad_t2d[5] = True
    with pytest.raises(ValueError, match="disagree"):
        VocabMapping.from_maps(m.d2t, bad_t2d)


def test_vocab_is_never_rebuilt(tmp_path, monkeypatch) -> None:
    """A second start reads the stored mapping even if the data changed; a different size is refused."""
    m = build_vocab_mapping(torch.tensor([4, 0, 9, 1]), 2)
    m.save(tmp_path / "vocab.safetensors")

    def boom(*a, **k):
        raise AssertionError("counted the data again")

    monkeypatch.setattr("eaglenest.drafter.vocab.count_tokens_in_shards", boom)
    again, built = prepare_vocab(tmp_path, [], 4, 2, 0.1, 0)
    assert not built and again.fingerprint() == m.fingerprint()
    with pytest.raises(ValueError, match="never rebuilt"):
        prepare_vocab(tmp_path, [], 4, 3, 0.1, 0)


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


def test_collate_right_pads_and_truncates() -> None:
    import pyarrow as pa

    h = 4
    rows = []
    for n in (3, 5):
        rows.append({"id": f"s{n}", "input_ids": list(range(1, n + 1)), "loss_mask": [0] + [1] * (n - 1),
                     "aux_hidden_states": tensor_to_bytes(torch.arange(n * 3 * h).float().view(n, 3 * h), "float32"),
                     "last_hidden_state": tensor_to_bytes(torch.ones(n, h) * n, "float32")})
    b = collate(pa.Table.from_pylist(rows), dtype="float32", hidden_size=h, max_seq_len=4)
    assert b.input_ids.tolist() == [[1, 2, 3, 0], [1, 2, 3, 4]]
    assert b.lengths.tolist() == [3, 4] and b.loss_mask[0].tolist() == [False, True, True, False]
    assert b.aux[1, 3, 0] == 36 and b.aux[0, 3].abs().sum() == 0 and b.last[1, 0, 0] == 5
    rows[0]["last_hidden_state"] = tensor_to_bytes(torch.ones(2, h), "float32")
    with pytest.raises(ValueError, match="corrupt"):
        collate(pa.Table.from_pylist(rows), dtype="float32", hidden_size=h, max_seq_len=8)


def test_split_is_deterministic() -> None:
    picks = [is_eval_sample(f"id{i}", 0.25, seed=0) for i in range(400)]
    assert picks == [is_eval_sample(f"id{i}", 0.25, seed=0) for i in range(400)]
    assert 60 < sum(picks) < 140 and not any(is_eval_sample(f"id{i}", 0.0) for i in range(50))
