"""Online training's small parts without Ray: which stream an epoch reads, the split/exclusion filter, CLI refusals."""

from __future__ import annotations

import argparse

import pyarrow as pa

from eaglenest.drafter.data import is_eval_sample
from eaglenest.drafter.epochs import OnlineEpochs
from eaglenest.drafter.online import _split_rows


class FakeShard:
    """Stands in for a Ray Train dataset shard: records how it was iterated."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def iter_batches(self, **kw):
        self.calls.append(kw)
        yield pa.table({"id": [self.name]})


def test_a_resumed_epoch_reads_the_rest_stream_and_later_epochs_the_full_one() -> None:
    train, rest = FakeShard("train"), FakeShard("rest")
    epochs = OnlineEpochs(train, rest, rest_epoch=1, batch_size=4, seed=7)
    assert [t.column("id")[0].as_py() for e in (1, 2) for t in epochs.epoch(e)] == ["rest", "train"]
    assert train.calls[0]["local_shuffle_seed"] == 7 + 2000  # a different order every epoch, fixed by the seed
    fresh = OnlineEpochs(train, None, None, batch_size=4, seed=7)
    assert [t.column("id")[0].as_py() for t in fresh.epoch(0)] == ["train"]


def test_split_rows_keeps_one_side_and_drops_excluded_ids() -> None:
    ids = [f"s{i}" for i in range(200)]
    table = pa.table({"id": ids})
    train = _split_rows(table, fraction=0.2, seed=3, want_eval=False).column("id").to_pylist()
    held = _split_rows(table, fraction=0.2, seed=3, want_eval=True).column("id").to_pylist()
    assert sorted(train + held) == sorted(ids) and held
    assert all(is_eval_sample(i, 0.2, 3) for i in held)
    rest = _split_rows(table, fraction=0.2, seed=3, want_eval=False, exclude=frozenset(train[:5]))
    assert rest.column("id").to_pylist() == train[5:]


def test_train_cli_refuses_data_with_online_and_neither(tmp_path, capsys) -> None:
    from eaglenest.drafter.cli import run_train

    cfg = tmp_path / "c.yaml"
    cfg.write_text("target: {model: tiny}\n")
    base = {"config": str(cfg), "output": str(tmp_path / "o"), "max_steps": None, "limit": None}
    assert run_train(argparse.Namespace(**base, data="x", online=True)) == 2
    assert "drop --data or --online" in capsys.readouterr().err
    assert run_train(argparse.Namespace(**base, data=None, online=False)) == 2
    assert "--online" in capsys.readouterr().err
    assert run_train(argparse.Namespace(**{**base, "limit": 3}, data="x", online=False)) == 2
    assert "--limit" in capsys.readouterr().err


def test_the_vocab_sample_is_spread_over_sources_and_fixed_by_the_seed() -> None:
    from eaglenest.drafter.online import vocab_sample

    ids = [f"a{i}" for i in range(50)] + [f"b{i}" for i in range(50)]  # plan order: source a, then source b
    pick = vocab_sample(ids, 20, seed=0)
    assert len(pick) == 20 and pick == vocab_sample(ids, 20, seed=0) != vocab_sample(ids, 20, seed=1)
    assert any(i.startswith("a") for i in pick) and any(i.startswith("b") for i in pick)
    table = pa.table({"id": ids})
    got = _split_rows(table, fraction=0.0, seed=0, want_eval=False, include=frozenset(pick))
    assert sorted(got.column("id").to_pylist()) == sorted(pick)
