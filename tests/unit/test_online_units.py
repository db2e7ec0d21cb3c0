"""Online training's small parts without Ray: the epoch-major work list, resume exclusions, split filter, CLI."""

from __future__ import annotations

import argparse

import pyarrow as pa

from eaglenest.drafter.data import is_eval_sample
from eaglenest.drafter.online import OnlinePlan, OnlineResume, _split_rows, epoch_order, remaining_epochs


def test_the_stream_reads_every_plan_file_once_per_epoch_epoch_after_epoch() -> None:
    files = [f"plan/part-{i}.parquet" for i in range(6)]
    items = epoch_order(files, [0, 1, 2], seed=5)
    assert [it["epoch"] for it in items] == [0] * 6 + [1] * 6 + [2] * 6
    orders = [[it["path"] for it in items if it["epoch"] == e] for e in range(3)]
    assert all(sorted(o) == files for o in orders)
    assert orders[0] != orders[1] or orders[1] != orders[2]  # each epoch in its own order (fixed by the seed)
    assert items == epoch_order(files, [0, 1, 2], seed=5)


def test_a_resume_streams_only_what_each_epoch_has_not_trained_on() -> None:
    plan = OnlinePlan(ledger=None, identity={}, files=[], train_ids=["a", "b", "c"], eval_ids=[], quarantined_now=0,
                      inputs=3, duplicates=0)
    fresh = remaining_epochs(plan, OnlineResume(), 2)
    assert fresh == {0: frozenset(), 1: frozenset()}
    resumed = remaining_epochs(plan, OnlineResume(step=4, consumed={0: ["a", "b", "c"], 1: ["b"]}), 2)
    assert resumed == {1: frozenset({"b"})}  # epoch 0 complete: not streamed again


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
