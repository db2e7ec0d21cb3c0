"""regen reads public dumps as they are (issue #13): files built with the real formats' quirks (a truncated ShareGPT
array, a BOM, a pretty-printed single object, split chats that start with a gpt turn, empty human turns, an over-long
multi-turn chat) are read incrementally, normalized by the documented rules, and a damaged file never stops the job.

The readers and the rules are checked directly here; the job end to end (the CLI on the session's Ray with the tiny
target, then again on the same folder: resume) is tests/e2e/test_regen_sources_job.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
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


def test_the_quarantine_alert_says_which_reasons_point_at_data_and_which_at_the_adapter():
    from eaglenest.regen.formats import REASON_GROUPS, REASONS

    grouped = [r for rs in REASON_GROUPS.values() for r in rs]
    assert sorted(grouped) == sorted(REASONS)  # every reason in exactly one group
    rules = yaml.safe_load((Path(__file__).resolve().parents[2] / "monitoring" / "alerts.yml").read_text())
    (alert,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "EaglenestRegenQuarantineRatioHigh"]
    text = " ".join(alert["annotations"]["description"].split())
    for group, label in (("adapter", "Points at the adapter (config):"), ("data", "Points at the data:")):
        after = text[text.index(label):]
        listed = after[:after.index(" - ")]
        assert all(r in listed for r in REASON_GROUPS[group]), group
