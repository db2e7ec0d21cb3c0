"""JSONL and parquet sources read without ijson: GPU images (the H200's among them) may not ship it, and only JSON
arrays / multi-value JSON files need the streaming parser. A regen of JSONL prompts there failed at import once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eaglenest.regen.readers import Record, iter_file


def test_jsonl_reads_without_ijson_and_json_arrays_say_they_need_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ijson", None)  # `import ijson` raises ImportError, as on an image without it
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"r{i}", "conversations": []}) + "\n" for i in range(3)))
    rows = [r for r in iter_file(jsonl) if isinstance(r, Record)]
    assert [json.loads(r.value)["id"] for r in rows] == ["r0", "r1", "r2"]  # JSONL records are parsed later

    array = tmp_path / "dump.json"
    array.write_text(json.dumps([{"id": "a"}]))
    with pytest.raises(ImportError):  # missing ijson is an install problem, never reported as a damaged file
        list(iter_file(array))
