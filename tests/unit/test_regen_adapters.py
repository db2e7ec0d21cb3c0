"""regen adapters: every fixture format normalizes, every malformed row gets its specific reason, ids are stable
content hashes, duplicates are counted (the length filter, which needs the target's tokenizer:
tests/component/test_regen_length_filter.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eaglenest.regen.formats import (
    NORMALIZED_SCHEMA,
    OK,
    REASONS,
    Conversation,
    Deduplicator,
    conversation_id,
    normalize_record,
    normalize_records,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sources"
EXPECTED = json.loads((FIX / "expected.json").read_text())
SOURCES = yaml.safe_load((FIX / "sources.yaml").read_text())["sources"]
# outcomes decided after normalization: by the engine stage (target tokens), the deduplication, the cap
LATER = {"too_long", "too_short", "token_out_of_range", "duplicate", "capped"}


def records(path: Path) -> list:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [line for line in path.read_text().splitlines() if line.strip()]


def normalized(src: dict) -> list[dict]:
    return [normalize_record(r, src["adapter"], source=src["name"], domain=src["domain"])
            for r in records(FIX / src["path"])]


@pytest.mark.parametrize("src", SOURCES, ids=[s["name"] for s in SOURCES])
def test_every_fixture_row_gets_its_expected_outcome(src):
    rows = normalized(src)
    expected = EXPECTED[src["path"]]
    assert len(rows) == len(expected)
    for i, (row, want) in enumerate(zip(rows, expected, strict=True)):
        if want == "ok" or want in LATER:
            assert row["status"] == OK, f"{src['name']} row {i}: {row['status']} {row['detail']}"
            assert row["messages"] or row["native"]
        else:
            assert row["status"] == want, f"{src['name']} row {i}: want {want}, got {row['status']} {row['detail']}"
            assert row["status"] in REASONS and row["detail"], row
            assert row["raw"] and row["id"]
    # every fixture mixes good and malformed rows
    assert any(r["status"] == OK for r in rows) and any(r["status"] != OK for r in rows)


def test_fixtures_cover_every_adapter_and_parquet():
    assert len(SOURCES) == 10
    assert {s["adapter"] for s in SOURCES} == {"sharegpt", "openai", "alpaca", "problem_solution", "tool_use",
                                               "native"}
    assert sum(s["path"].endswith(".parquet") for s in SOURCES) >= 2
    reasons = {r for exp in EXPECTED.values() for r in exp} - {"ok", "duplicate", "capped"}
    assert reasons >= {"invalid_json", "missing_field", "wrong_type", "empty_conversation", "role_order",
                       "unknown_role", "bad_tool_call", "bad_native", "too_long", "token_out_of_range"}


def test_normalized_batch_matches_the_arrow_schema():
    src = next(s for s in SOURCES if s["name"] == "swe_smith")
    table = normalize_records(records(FIX / src["path"]), src["adapter"], source=src["name"], domain=src["domain"])
    assert table.schema == NORMALIZED_SCHEMA and table.num_rows == len(EXPECTED[src["path"]])


def _ok(name: str) -> list[dict]:
    return [r for r in normalized(next(s for s in SOURCES if s["name"] == name)) if r["status"] == OK]


def test_format_specifics_are_normalized():
    think = _ok("openthoughts")[0]["messages"]
    assert [m["role"] for m in think] == ["system", "user", "assistant"]
    assert "40 times 7 = 280" in think[2]["reasoning_content"] and think[2]["content"] == "The answer is 280."
    swe = _ok("swe_smith")[0]["messages"]
    assert [m["role"] for m in swe] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    call = json.loads(swe[2]["tool_calls"])[0]
    assert call == {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
    swe_text = _ok("swe_smith")[1]["messages"]  # messages stored as JSON text
    assert json.loads(swe_text[1]["tool_calls"])[0]["function"]["arguments"] == {"city": "oslo"}
    xlam = _ok("xlam")[1]
    assert [c["function"]["name"] for c in json.loads(xlam["messages"][1]["tool_calls"])] == ["add", "get_weather"]
    assert {t["function"]["name"] for t in json.loads(xlam["tools"])} == {"get_weather", "add"}
    alpaca = _ok("code_alpaca")[1]["messages"][0]["content"]
    assert alpaca.endswith("\n\na = 1, x = 2")
    native = _ok("target_native")[0]
    assert native["native"] and len(native["native_input_ids"]) == len(native["native_loss_mask"]) > 0


def test_ids_are_stable_content_hashes():
    a = normalized(SOURCES[0])
    assert [r["id"] for r in a] == [r["id"] for r in normalized(SOURCES[0])]
    # the same prompt in ShareGPT and OpenAI form is the same sample; the original answer does not matter
    share = normalize_record({"conversations": [{"from": "human", "value": "Hi there"},
                                                {"from": "gpt", "value": "Hello!"}]}, "sharegpt", source="a",
                             domain="chat")
    oai = normalize_record({"messages": [{"role": "user", "content": "Hi there"},
                                         {"role": "assistant", "content": "Something else"}]}, "openai",
                           source="b", domain="chat")
    other = normalize_record({"messages": [{"role": "user", "content": "Hi there!"},
                                           {"role": "assistant", "content": "x"}]}, "openai", source="b",
                             domain="chat")
    assert share["id"] == oai["id"] != other["id"]
    # golden value: changing the hash would make reruns of old output folders redo every sample
    conv = Conversation([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": None}])
    assert conversation_id(conv) == share["id"] == "a708fd5069eea2595ac1026fb3a42791"
    bad = normalize_record("{broken", "sharegpt", source="a", domain="chat")
    assert bad["id"] == normalize_record("{broken", "openai", source="b", domain="chat")["id"]


def test_duplicates_are_counted_first_occurrence_wins():
    dedup = Deduplicator()
    kept = {}
    for src in SOURCES:
        for row in normalized(src):
            if dedup.first(row["id"], src["name"]):
                kept[row["id"]] = src["name"]
    want = {s["name"]: EXPECTED[s["path"]].count("duplicate") for s in SOURCES}
    assert {k: v for k, v in dedup.duplicates.items() if v} == {k: v for k, v in want.items() if v}
    # the ShareGPT copy came first, so the LMSYS duplicate is attributed to ShareGPT's sample
    lmsys_dup = normalized(next(s for s in SOURCES if s["name"] == "lmsys_chat"))[1]["id"]
    assert kept[lmsys_dup] == "sharegpt_vicuna"


@pytest.mark.parametrize("record", [None, 5, [], "null", "[]", '"text"', {"conversations": [None]},
                                    {"conversations": [{"from": "human"}]}, {"messages": {"role": "user"}},
                                    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                    {"query": "q", "tools": "[]", "answers": "[]"},
                                    {"input_ids": [1, 2], "loss_mask": [1, 2]}, {"input_ids": "1 2", "loss_mask": []}])
def test_bad_records_are_quarantined_never_raised(record):
    for adapter in ("sharegpt", "openai", "alpaca", "problem_solution", "tool_use", "native"):
        row = normalize_record(record, adapter, source="s", domain="chat")
        assert row["status"] in REASONS and row["detail"], (adapter, record, row)
