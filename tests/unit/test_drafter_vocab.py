"""Draft vocab mapping, vocab persistence, shard collation and the eval split (no Ray, no target; the manifest
check against the tiny target is tests/component/test_drafter_manifest_check.py)."""

from __future__ import annotations

import pytest
import torch

from eaglenest.contracts.shards import tensor_to_bytes
from eaglenest.drafter.data import collate, eval_files, is_eval_sample, split_counts
from eaglenest.drafter.inputs import prepare_vocab
from eaglenest.drafters.vocab import VocabMapping, build_vocab_mapping, count_tokens


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

    monkeypatch.setattr("eaglenest.drafters.vocab.count_tokens_in_shards", boom)
    again, built = prepare_vocab(tmp_path, [], 4, 2, 0.1, 0)
    assert not built and again.fingerprint() == m.fingerprint()
    with pytest.raises(ValueError, match="never rebuilt"):
        prepare_vocab(tmp_path, [], 4, 3, 0.1, 0)


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


def test_eval_reads_only_the_files_its_limit_needs(tmp_path) -> None:
    """The first N held-out rows in file order all lie in eval_files' prefix; fewer held-out rows than N: every file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    for f in range(8):
        path = tmp_path / f"shard-{f:03d}.parquet"
        pq.write_table(pa.table({"id": [f"s{f}-{i}" for i in range(25)]}), path)
        files.append(path)
    counts = split_counts(files, 0.2, seed=1)
    assert sum(t + e for t, e in counts) == 200 and all(e > 0 for _, e in counts)
    every = [i for f in files for i in pq.read_table(f).column("id").to_pylist() if is_eval_sample(i, 0.2, 1)]
    for limit in (1, 7, 16):
        prefix = eval_files(files, counts, limit)
        assert len(prefix) < len(files) and prefix == files[: len(prefix)]
        got = [i for f in prefix for i in pq.read_table(f).column("id").to_pylist() if is_eval_sample(i, 0.2, 1)]
        assert got[:limit] == every[:limit] and len(got) >= limit
        assert sum(e for _, e in counts[: len(prefix) - 1]) < limit  # the shortest such prefix
    assert eval_files(files, counts, len(every) + 1) == files and eval_files(files, counts, None) == files
