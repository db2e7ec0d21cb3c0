"""The engine actor of online training on the real tiny target: it files every answer it generates, captures a
filed answer without generating (the rows are identical to the generated ones, hidden states included), picks up
answers other actors file while it runs, and keeps quarantined samples out. The offline actor files nothing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.config import EaglenestConfig
from eaglenest.drafter.data import COLUMNS
from eaglenest.engines.tiny import corpus_chats
from eaglenest.regen import answer_settings, target_identity
from eaglenest.regen.answers import ANSWERS, answer_files, cached_ids, prepare_answer_cache
from eaglenest.regen.formats import NORMALIZED_SCHEMA, OK, normalize_record
from eaglenest.regen.output import quarantine_files, write_quarantine
from eaglenest.regen.stage import EngineActor

COLS = [*COLUMNS, "epoch"]


@pytest.fixture(scope="module")
def cfg(tiny_target_path) -> EaglenestConfig:
    return EaglenestConfig.model_validate({
        "target": {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"},
        "regen": {"sources": [{"name": "chats", "domain": "chat", "adapter": "openai", "path": "unused.jsonl"}],
                  "sampling": {"temperature": 0.0, "max_new_tokens": 12}, "num_cpus_per_actor": 1,
                  "min_tokens": 4, "max_tokens": 96}})


def plan_rows(chats: list[dict], epoch: int = 0) -> pa.Table:
    rows = [normalize_record(json.dumps(c), "openai", source="chats", domain="chat") for c in chats]
    assert all(r["status"] == OK for r in rows)
    t = pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA)
    return t.append_column("epoch", pa.array([epoch] * t.num_rows, type=pa.int32()))


def actor(cfg: EaglenestConfig, ledger=None) -> EngineActor:
    rc = cfg.regen
    sampling = {s.name: {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0} for s in rc.sources}
    return EngineActor(cfg.target.model_dump(), rc.model_dump(), sampling, target_identity(cfg),
                       ledger=None if ledger is None else {"ledger_dir": str(ledger), "columns": COLS})


def by_id(table: pa.Table) -> dict[str, dict]:
    return {r["id"]: r for r in table.select(COLS[:-1]).to_pylist()}


def test_a_filed_answer_is_captured_only_and_gives_the_same_training_rows(cfg, tmp_path) -> None:
    prepare_answer_cache(tmp_path, answer_settings(cfg))
    batch = plan_rows(corpus_chats()[:6])
    first = actor(cfg, tmp_path)
    fresh = first(batch)
    assert fresh.num_rows == 6 and fresh.column_names == COLS
    assert first.regen.stats.generated_tokens > 0
    assert cached_ids(tmp_path) == set(fresh.column("id").to_pylist())  # filed before the rows went on
    # epoch 1, a fresh actor (another run, or another pool): nothing generated, every row captured again
    again = actor(cfg, tmp_path)
    later = again(plan_rows(corpus_chats()[:6], epoch=1))
    assert again.regen.stats.generated_tokens == 0 and again.regen.stats.captured_tokens > 0
    assert later.column("epoch").to_pylist() == [1] * 6
    assert by_id(later) == by_id(fresh)  # ids, masks and hidden-state bytes, sample for sample
    assert len(answer_files(tmp_path)) == 1  # captured rows file nothing new
    # a batch mixing a cached sample with new ones generates the new ones only, and files only them
    mixed = plan_rows(corpus_chats()[5:9])
    out = again(mixed)
    assert out.num_rows == 4 and again.regen.stats.generated_tokens > 0
    assert len(answer_files(tmp_path)) == 2 and len(cached_ids(tmp_path)) == 9


def test_a_sample_twice_in_one_batch_is_generated_once(cfg, tmp_path) -> None:
    chats = corpus_chats()[30:33]
    both = pa.concat_tables([plan_rows(chats), plan_rows(chats[:1], epoch=1)])  # an epoch boundary inside a batch
    one = actor(cfg, tmp_path)
    out = one(both)
    assert out.column("epoch").to_pylist() == [0, 0, 0, 1]
    rows = out.select(COLS[:-1]).to_pylist()
    assert rows[3] == rows[0]  # the same training row for both epochs
    assert len(cached_ids(tmp_path)) == 3 and pq.read_metadata(answer_files(tmp_path)[0]).num_rows == 3
    alone = actor(cfg, tmp_path / "alone")
    alone(plan_rows(chats))
    assert one.regen.stats.generated_tokens == alone.regen.stats.generated_tokens  # generated once, not twice


def test_an_actor_picks_up_answers_filed_after_it_loaded_its_index(cfg, tmp_path) -> None:
    reader, writer = actor(cfg, tmp_path), actor(cfg, tmp_path)
    reader(plan_rows(corpus_chats()[10:12]))  # loads its index (and files these two)
    writer(plan_rows(corpus_chats()[12:15]))  # another actor files three more
    reader(plan_rows(corpus_chats()[12:15], epoch=1))
    assert reader.regen.stats.generated_tokens == 0  # the misses rescanned the ledger and found them
    assert reader.answers.refreshes == 2


def test_quarantined_samples_stay_quarantined(cfg, tmp_path) -> None:
    long_chat = {"messages": [{"role": "user", "content": " ".join(["count the words"] * 60)},
                              {"role": "assistant", "content": "ok"}]}
    chats = [*corpus_chats()[20:23], long_chat]
    first = actor(cfg, tmp_path)
    out = first(plan_rows(chats))
    assert out.num_rows == 3  # the long one went to the ledger's quarantine, not to training
    rejected = plan_rows([long_chat]).column("id")[0].as_py()
    assert rejected not in cached_ids(tmp_path) and len(quarantine_files(tmp_path)) == 1
    # a later epoch: the rejected row is dropped before the engine (no generation, nothing filed again); the rest
    # are captured only
    again = actor(cfg, tmp_path)
    later = again(plan_rows(chats, epoch=1))
    assert later.num_rows == 3 and rejected not in later.column("id").to_pylist()
    assert again.regen.stats.generated_tokens == 0 and len(quarantine_files(tmp_path)) == 1
    # a sample quarantined after its answer was filed (e.g. a capture error in some epoch) is not captured again
    victim = out.column("id")[0].as_py()
    write_quarantine(pa.table({"id": [victim], "source": ["chats"], "reason": ["engine_error"],
                               "detail": ["capture: boom"], "raw": ["{}"], "source_id": [None]}), tmp_path, "regen")
    third = actor(cfg, tmp_path)
    rows = third(plan_rows(chats, epoch=2))
    assert sorted(rows.column("id").to_pylist()) == sorted(set(out.column("id").to_pylist()) - {victim})


def test_the_offline_actor_files_no_answers(cfg, tmp_path) -> None:
    offline = actor(cfg)
    out = offline(plan_rows(corpus_chats()[:2]))
    assert out.num_rows == 2 and "aux_hidden_states" in out.column_names  # regen's result rows, as before
    assert offline.answers is None and not (tmp_path / ANSWERS).exists()
