"""regen reads public dumps as they are (issue #13), end to end: the job runs through the CLI on the session's Ray
with the tiny target, then again on the same folder (resume); an older shard without source_id still resumes and
trains. (The readers and normalization rules are checked directly in tests/unit/test_regen_sources.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml


def chat(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def q(i: int) -> dict:
    return chat(f"sg_{i}", ("human", f"What is {i} plus {i + 2}?"), ("gpt", f"It is {2 * i + 2}."))


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
