"""Online training's answer cache on its own (files only, no engine): write/read, refresh on a miss, atomic files,
quarantine wins over a filed answer, answers of other settings dropped, summary row counts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.drafter.online import engine_rows, hidden_state_files
from eaglenest.regen.answers import (
    ANSWERS,
    AnswerCache,
    answer_files,
    cached_ids,
    prepare_answer_cache,
    write_answers,
)
from eaglenest.regen.output import write_quarantine

SETTINGS = {"sampling": {"chats": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0}},
            "min_tokens": 4, "max_tokens": 256}


def engine_rows_table(ids: list[str], *, hidden: bool = True) -> pa.Table:
    """Engine-stage rows as the actor has them (hidden states included): the cache must keep ids and masks only."""
    n = len(ids)
    cols = {"id": ids, "source": ["chats"] * n, "domain": ["chat"] * n,
            "input_ids": [[k, k + 1, k + 2] for k in range(n)], "loss_mask": [[0, 1, 1]] * n,
            "num_tokens": [3] * n, "generated_tokens": [2] * n, "truncated_turns": [0] * n,
            "dropped_turns": [0] * n, "epoch": [0] * n}
    if hidden:
        cols["aux_hidden_states"] = [b"\x01" * 24] * n
        cols["last_hidden_state"] = [b"\x02" * 8] * n
    return pa.table(cols)


def test_filed_answers_read_back_exactly_and_hold_no_hidden_state(tmp_path) -> None:
    path = write_answers(engine_rows_table(["a", "b", "c"]), tmp_path)
    assert path.parent == tmp_path / ANSWERS and not path.name.startswith(".")
    assert {"aux_hidden_states", "last_hidden_state"}.isdisjoint(pq.read_schema(path).names)
    assert hidden_state_files(tmp_path) == []
    found, quarantined = AnswerCache(tmp_path).lookup(["b", "c", "z"])
    assert quarantined == set()
    assert found == {"b": ([1, 2, 3], [0, 1, 1]), "c": ([2, 3, 4], [0, 1, 1])}  # z: to regenerate
    assert cached_ids(tmp_path) == {"a", "b", "c"}
    assert write_answers(engine_rows_table([]), tmp_path) is None  # a batch with nothing generated files nothing
    # the scan that guards an online run does see hidden-state columns when a file has them
    pq.write_table(engine_rows_table(["x"]), tmp_path / "stray.parquet")
    assert hidden_state_files(tmp_path) == [tmp_path / "stray.parquet"]


def test_the_index_loads_lazily_and_refreshes_only_on_a_miss(tmp_path) -> None:
    write_answers(engine_rows_table(["a"]), tmp_path)
    cache = AnswerCache(tmp_path)
    assert cache.refreshes == 0  # nothing read before the first lookup
    assert set(cache.lookup(["a"])[0]) == {"a"} and cache.refreshes == 1
    cache.lookup(["a"])
    assert cache.refreshes == 1  # every id known: no directory scan
    write_answers(engine_rows_table(["b", "c"]), tmp_path)  # another actor files a batch
    assert set(cache.lookup(["a"])[0]) == {"a"} and cache.refreshes == 1
    assert set(cache.lookup(["a", "c"])[0]) == {"a", "c"} and cache.refreshes == 2  # c missed: rescanned
    assert cache.lookup(["new"])[0] == {} and cache.refreshes == 3  # a miss that stays a miss: regenerate
    assert len(cache.indexed) == 2  # each file read once


def test_half_written_files_are_never_read_and_are_removed_at_start(tmp_path) -> None:
    path = write_answers(engine_rows_table(["a"]), tmp_path)
    assert [p.name for p in (tmp_path / ANSWERS).iterdir()] == [path.name]  # no temporary left behind
    # a killed writer leaves its dot-temporary (a complete-looking parquet even): readers skip it
    pq.write_table(engine_rows_table(["b"], hidden=False), tmp_path / ANSWERS / ".tmp-1234abcd-part-x.parquet")
    assert answer_files(tmp_path) == [path]
    assert AnswerCache(tmp_path).lookup(["b"])[0] == {}
    assert prepare_answer_cache(tmp_path, SETTINGS) == 0
    assert sorted(p.name for p in (tmp_path / ANSWERS).iterdir()) == [path.name, "settings.json"]
    # the same batch filed twice (a retried task) replaces its own file
    write_answers(engine_rows_table(["a"]), tmp_path)
    assert answer_files(tmp_path) == [path]


def test_a_quarantined_sample_gets_no_answer_even_when_one_is_filed(tmp_path) -> None:
    write_answers(engine_rows_table(["a", "b"]), tmp_path)
    cache = AnswerCache(tmp_path)
    assert set(cache.lookup(["a", "b"])[0]) == {"a", "b"}
    rejects = pa.table({"id": ["b", "q"], "source": ["chats"] * 2, "reason": ["engine_error", "too_long"],
                        "detail": ["capture failed", "long"], "raw": ["{}"] * 2, "source_id": [None, None]})
    write_quarantine(rejects, tmp_path, "regen")
    found, quarantined = cache.lookup(["a", "b", "q"])  # q is unknown to the index: the refresh finds both
    assert set(found) == {"a"} and quarantined == {"b", "q"}
    assert cache.lookup(["b"]) == ({}, {"b"})  # and it stays that way


def test_answers_of_other_settings_are_dropped_at_start(tmp_path) -> None:
    assert prepare_answer_cache(tmp_path, SETTINGS) == 0
    write_answers(engine_rows_table(["a"]), tmp_path)
    assert prepare_answer_cache(tmp_path, SETTINGS) == 0 and cached_ids(tmp_path) == {"a"}  # a resume keeps them
    longer = {**SETTINGS, "sampling": {"chats": {**SETTINGS["sampling"]["chats"], "max_new_tokens": 48}}}
    assert prepare_answer_cache(tmp_path, longer) == 1 and cached_ids(tmp_path) == set()
    write_answers(engine_rows_table(["b"]), tmp_path)
    assert prepare_answer_cache(tmp_path, longer) == 0 and cached_ids(tmp_path) == {"b"}


def test_summary_rows_per_epoch_split_generated_and_capture_only() -> None:
    counts = {"train": {1: [0, 5, 1], 0: [3, 2, 0]}, "eval": {0: [1, 2, 0]}}
    assert engine_rows(counts) == {
        "rows_per_epoch": [{"epoch": 0, "generated": 3, "capture_only": 2, "skipped_quarantined": 0},
                           {"epoch": 1, "generated": 0, "capture_only": 5, "skipped_quarantined": 1}],
        "held_out_rows": {"generated": 1, "capture_only": 2, "skipped_quarantined": 0},
        "vocab_rows": {"generated": 0, "capture_only": 0, "skipped_quarantined": 0}}
