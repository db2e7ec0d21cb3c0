"""regen reads public dumps as they are (issue #13): files built with the real formats' quirks (a truncated ShareGPT
array, a BOM, a pretty-printed single object, split chats that start with a gpt turn, empty human turns, an over-long
multi-turn chat) are read incrementally, normalized by the documented rules, and a damaged file never stops the job.

The readers and the rules are checked directly; the job end to end runs through the CLI on the session's Ray with
the tiny target, then again on the same folder (resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eaglenest.regen.formats import normalize_record
from eaglenest.regen.readers import Damage, Record, iter_file


def chat(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def q(i: int) -> dict:
    return chat(f"sg_{i}", ("human", f"What is {i} plus {i + 2}?"), ("gpt", f"It is {2 * i + 2}."))


def records(items: list) -> list:
    return [x.value for x in items if isinstance(x, Record)]


# ----------------------------------------------------------------------------------------------------- readers
def test_truncated_array_yields_every_record_before_the_cut_then_one_damage(tmp_path):
    rows = [q(i) for i in range(40)]
    blob = json.dumps(rows, indent=2).encode()
    cut = blob.index(b'"sg_37"') + 3  # inside element 37
    path = tmp_path / "sharegpt.json"
    path.write_bytes(blob[:cut])
    items = list(iter_file(path))
    assert records(items) == rows[:37]
    assert items[-1] == Damage(str(path), cut, "IncompleteJSONError: parse error: premature EOF", 37)
    assert sum(isinstance(x, Damage) for x in items) == 1


def test_invalid_bytes_and_broken_elements_are_located_in_the_file(tmp_path):
    blob = json.dumps([q(i) for i in range(5)]).encode()
    at = blob.index(b"sg_3")
    path = tmp_path / "bytes.json"
    path.write_bytes(blob[:at] + b"\xff" + blob[at + 1:])
    *good, damage = iter_file(path)
    assert records(good) == [q(i) for i in range(3)]
    assert (damage.offset, damage.records_before) == (at, 3)
    assert "invalid bytes in UTF8 string" in damage.message

    broken = blob.replace(b'"id": "sg_2"', b'"id" "sg_2"')
    path.write_bytes(broken)
    *good, damage = iter_file(path)
    assert records(good) == [q(0), q(1)] and damage.records_before == 2
    bad = broken.index(b'"id" "sg_2"')  # the parser gives up at the end of the token where the colon was due
    assert "colon" in damage.message and bad < damage.offset <= bad + len(b'"id" "sg_2"')


def test_bom_array_single_object_and_json_lines_in_a_json_file(tmp_path):
    rows = [q(i) for i in range(3)]
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, indent=1).encode())
    assert records(list(iter_file(bom))) == rows
    single = tmp_path / "single.json"
    single.write_text(json.dumps(rows[0], indent=2))  # pretty-printed: one record, not one per line
    assert records(list(iter_file(single))) == [rows[0]]
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    assert records(list(iter_file(lines))) == rows
    empty = tmp_path / "empty.json"
    empty.write_text(" \n")
    assert [type(x) for x in iter_file(empty)] == [Damage]


def test_jsonl_is_read_line_by_line_and_bad_lines_are_records(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(q(0)).encode() + b"\n\n" + b'{"id": "x\xff"}\n'
                     + json.dumps(q(1)).encode() + b"\n" + b'{"id": "cut", "conv')
    items = list(iter_file(path))
    assert all(isinstance(x, Record) for x in items) and [x.index for x in items] == [0, 1, 2, 3]
    assert json.loads(items[0].value) == q(0) and json.loads(items[2].value) == q(1)
    assert items[1].error is not None and "line 3" in items[1].error and "not UTF-8" in items[1].error
    assert items[3].error is None and items[3].where.startswith("dump.jsonl line 5")
    assert [x.index for x in iter_file(path, cap=2)] == [0, 1]


def test_reading_stops_at_the_cap(tmp_path):
    """The damage after the first 5 elements is never reached when 5 records are asked for."""
    path = tmp_path / "capped.json"
    path.write_bytes(json.dumps([q(i) for i in range(5)]).encode()[:-1] + b", {broken")
    assert records(list(iter_file(path, cap=5))) == [q(i) for i in range(5)]
    assert isinstance(list(iter_file(path, cap=6))[-1], Damage)


def test_parquet_is_read_by_row_group_and_a_damaged_file_is_reported(tmp_path):
    path = tmp_path / "chats.parquet"
    table = pa.Table.from_pylist([{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]}
                                  for i in range(30)])
    pq.write_table(table, path, row_group_size=10)
    assert [r["prompt_id"] for r in records(list(iter_file(path, cap=12)))] == [f"p{i}" for i in range(12)]
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(path.read_bytes()[:-100])
    (damage,) = iter_file(cut)
    assert damage.offset == 0 and damage.records_before == 0 and damage.message


# ------------------------------------------------------------------------------------------------ normalization
def test_leading_non_user_turns_are_dropped_and_counted():
    row = normalize_record(chat("split_2", ("gpt", "...and that is the second half."), ("human", "Thanks! And 2+2?"),
                                ("gpt", "4.")), "sharegpt", source="s", domain="chat")
    assert row["status"] == "ok" and row["leading_turns_dropped"] == 1
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["source_id"] == "split_2"
    only_gpt = normalize_record(chat("g", ("gpt", "Hello!")), "sharegpt", source="s", domain="chat")
    assert only_gpt["status"] == "empty_conversation"


def test_an_empty_turn_drops_its_exchange_not_the_conversation():
    row = normalize_record(chat("e", ("human", "What is 1 plus 1?"), ("gpt", "2."), ("human", "  "), ("gpt", "?"),
                                ("human", "And 2 plus 2?"), ("gpt", "4.")), "sharegpt", source="s", domain="chat")
    assert row["status"] == "ok" and row["empty_exchanges_dropped"] == 1
    assert [m["content"] for m in row["messages"]] == ["What is 1 plus 1?", "2.", "And 2 plus 2?", "4."]
    openai = normalize_record({"prompt_id": "u1", "messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": "?"},
        {"role": "user", "content": "Hi there"}]}, "openai", source="s", domain="chat")
    assert openai["status"] == "ok" and [m["role"] for m in openai["messages"]] == ["user"]
    assert openai["source_id"] == "u1"
    nothing = normalize_record(chat("n", ("human", ""), ("gpt", "?")), "sharegpt", source="s", domain="chat")
    assert nothing["status"] == "empty_conversation" and "empty turn" in nothing["detail"]


def test_source_id_is_the_records_own_id_or_file_and_index():
    row = normalize_record({"conversations": [{"from": "human", "value": "hi"}]}, "sharegpt", source="s",
                           domain="chat", fallback_id="dump.json#7")
    assert row["source_id"] == "dump.json#7"
    bad = normalize_record('{"id": "x", "conv', "sharegpt", source="s", domain="chat", fallback_id="d.jsonl#3",
                           where="d.jsonl line 4 (byte 99)")
    assert bad["status"] == "invalid_json" and bad["source_id"] == "d.jsonl#3" and "d.jsonl line 4" in bad["detail"]


# ------------------------------------------------------------------------------------------------------ the job
LONG_ANSWER = "Here is a very long original answer. " * 120  # the target replaces it: its length must not count
LONG_QUESTION = "Please also explain every step of this again in detail. " * 60


def quirk_sources(d: Path) -> tuple[list[dict], dict]:
    """Source files with the quirks of real dumps; returns (sources, what the test expects of them)."""
    rows = [q(1), chat("split_1", ("gpt", "(continued) and so on."), ("human", "What is 5 plus 6?"), ("gpt", "11")),
            chat("empty_1", ("human", ""), ("gpt", "?"), ("human", "What is 7 plus 1?"), ("gpt", "8")),
            q(2), q(3)]
    blob = json.dumps(rows + [q(4)], indent=2).encode()
    cut = blob.index(b'"sg_4"') + 2
    (d / "sharegpt_cut.json").write_bytes(blob[:cut])
    (d / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([q(10), q(11)]).encode())
    single = {"conversations": [{"from": "human", "value": "What is 9 plus 9?"}, {"from": "gpt", "value": "18"}]}
    (d / "single.json").write_text(json.dumps(single, indent=2))
    long_chat = chat("long_1", ("human", "What is 2 plus 2?"), ("gpt", LONG_ANSWER), ("human", "And 3 plus 3?"),
                     ("gpt", LONG_ANSWER), ("human", LONG_QUESTION), ("gpt", LONG_ANSWER))
    (d / "long.jsonl").write_text(json.dumps(long_chat) + "\n")
    sources = [{"name": "sharegpt_cut", "domain": "chat", "adapter": "sharegpt", "path": str(d / "sharegpt_cut.json")},
               {"name": "bom", "domain": "chat", "adapter": "sharegpt", "path": str(d / "bom.json")},
               {"name": "single", "domain": "chat", "adapter": "sharegpt", "path": str(d / "single.json")},
               {"name": "long", "domain": "chat", "adapter": "sharegpt", "path": str(d / "long.jsonl")}]
    return sources, {"cut": cut, "source_ids": {"sg_1", "split_1", "empty_1", "sg_2", "sg_3", "sg_10", "sg_11",
                                                "single.json#0", "long_1"}}


@pytest.fixture(scope="module")
def quirk_run(ray_session, tmp_path_factory):
    from eaglenest.cli import main

    d = tmp_path_factory.mktemp("quirks")
    sources, expect = quirk_sources(d)
    cfg = {"target": {"model": "tiny", "engine": "hf", "device": "cpu", "dtype": "float32"},
           "regen": {"sources": sources, "output": str(d / "out"), "sampling": {"temperature": 0.0,
                                                                               "max_new_tokens": 8},
                     "batch_size": 4, "num_actors": 1, "num_cpus_per_actor": 0.5, "min_tokens": 4,
                     "max_tokens": 160, "rows_per_shard": 4}}
    (d / "regen.yaml").write_text(yaml.safe_dump(cfg))
    return d, expect, main


def run_cli(main, d: Path, capsys) -> tuple[int, str, dict]:
    capsys.readouterr()
    rc = main(["regen", "--config", str(d / "regen.yaml")])
    text = capsys.readouterr().out
    return rc, text, json.loads((d / "out" / "manifest.json").read_text())


def shard_rows(out: Path) -> list[dict]:
    return [r for f in sorted((out / "shards").glob("*.parquet"))
            for r in pq.read_table(f, columns=["id", "source", "source_id"]).to_pylist()]


def quarantine_rows(out: Path) -> list[dict]:
    return [r for f in sorted((out / "quarantine").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_public_dump_quirks_end_to_end_then_resume(quirk_run, capsys):
    d, expect, main = quirk_run
    out = d / "out"
    rc, text, m = run_cli(main, d, capsys)
    assert rc == 0 and "Traceback" not in text

    # the truncated array: the 5 records before the cut are used, the damage is quarantined once, named and located
    damaged = m["damaged_sources"]
    assert damaged == [{"source": "sharegpt_cut", "file": str(d / "sharegpt_cut.json"), "offset": expect["cut"],
                        "message": "IncompleteJSONError: parse error: premature EOF", "records_before": 5}]
    assert f"DAMAGED source 'sharegpt_cut': {d / 'sharegpt_cut.json'} stops being readable at byte {expect['cut']}" \
        in text
    assert m["quarantined_per_reason"] == {"damaged_source": 1}
    (q_row,) = quarantine_rows(out)
    assert q_row["reason"] == "damaged_source" and str(d / "sharegpt_cut.json") in q_row["detail"]
    assert q_row["source_id"] == f"sharegpt_cut.json@{expect['cut']}"

    # every record became a sample: split chats and empty turns kept what is usable, BOM and single object read
    assert m["inputs_per_source"] == {"sharegpt_cut": 5, "bom": 2, "single": 1, "long": 1}
    assert m["samples_per_source"] == {"sharegpt_cut": 5, "bom": 2, "single": 1, "long": 1}
    assert m["normalize_notes_per_source"]["sharegpt_cut"] == {"leading_turns_dropped": 1,
                                                               "empty_exchanges_dropped": 1}
    assert "normalized sharegpt_cut: 1 conversation(s) started with non-user turns (dropped), 1 exchange(s)" in text

    # the over-long chat (original answers far over max_tokens) keeps the exchanges that fit, the last one is cut
    assert m["last_run"]["dropped_turns"] == 1
    assert "1 turns cut at max_tokens" in text

    rows = shard_rows(out)
    assert {r["source_id"] for r in rows} == expect["source_ids"]

    # resume: nothing is read into the plan twice, nothing written twice, the damage is not quarantined again
    files = sorted(p.name for p in out.rglob("*.parquet"))
    rc, text, again = run_cli(main, d, capsys)
    assert rc == 0 and "DAMAGED source 'sharegpt_cut'" in text
    assert again["last_run"]["planned"] == 0 and again["last_run"]["already_done"] == 10
    assert sorted(p.name for p in out.rglob("*.parquet")) == files
    assert again["quarantined_per_reason"] == {"damaged_source": 1}
    ids = [r["id"] for r in shard_rows(out)] + [r["id"] for r in quarantine_rows(out)]
    assert len(ids) == len(set(ids)) == 10


def test_shards_without_source_id_still_resume_and_train(quirk_run, capsys, ray_session):
    """An older shard (written before source_id existed) is read back by resume and by training's reader."""
    from eaglenest.contracts.shards import shard_files
    from eaglenest.drafter.data import build_datasets

    d, _, main = quirk_run
    out = d / "out"
    if not (out / "manifest.json").exists():
        run_cli(main, d, capsys)
    old = shard_files(out)[0]
    table = pq.read_table(old)
    pq.write_table(table.drop_columns(["source_id"]), old)
    assert "source_id" not in pq.read_schema(old).names
    rc, _, m = run_cli(main, d, capsys)
    assert rc == 0 and m["last_run"]["planned"] == 0 and m["num_samples"] == 9
    ds = build_datasets(shard_files(out), fraction=0.0, seed=0)["train"]
    assert ds.count() == 9


def test_the_quarantine_alert_says_which_reasons_point_at_data_and_which_at_the_adapter():
    from eaglenest.regen.formats import REASON_GROUPS, REASONS

    grouped = [r for rs in REASON_GROUPS.values() for r in rs]
    assert sorted(grouped) == sorted(REASONS)  # every reason in exactly one group
    rules = yaml.safe_load((Path(__file__).resolve().parents[1] / "monitoring" / "alerts.yml").read_text())
    (alert,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "EaglenestRegenQuarantineRatioHigh"]
    text = " ".join(alert["annotations"]["description"].split())
    for group, label in (("adapter", "Points at the adapter (config):"), ("data", "Points at the data:")):
        after = text[text.index(label):]
        listed = after[:after.index(" - ")]
        assert all(r in listed for r in REASON_GROUPS[group]), group
