"""Any source record -> a normalized sample or a quarantine row (never raises on bad data).

Every dataset row becomes either a normalized sample (``id``, ``source``, ``domain``, ``messages``, ``tools``,
``native``) or a quarantine record with a specific reason; nothing is dropped silently and no row can stop the job.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from eaglenest.regen.formats.chat import adapt_openai, adapt_sharegpt
from eaglenest.regen.formats.native import adapt_native
from eaglenest.regen.formats.reasons import DAMAGED_SOURCE, EMPTY_CONVERSATION, INVALID_JSON, NOT_AN_OBJECT, OK, BadRow
from eaglenest.regen.formats.repair import Repaired, repair_conversation, validate_conversation
from eaglenest.regen.formats.schema import (
    NORMALIZED_SCHEMA,
    Conversation,
    _canon,
    _hash,
    conversation_id,
    raw_id,
    raw_json,
)
from eaglenest.regen.formats.single_turn import adapt_alpaca, adapt_problem_solution, adapt_tool_use

# The record's own id, first field present wins (ShareGPT/xLAM ``id``, UltraChat ``prompt_id``, LMSYS
# ``conversation_id``, SWE-smith ``instance_id``); records without one get ``<file>#<index>``.
SOURCE_ID_FIELDS = ("id", "prompt_id", "conversation_id", "instance_id", "uuid", "question_id", "sample_id")

ADAPTERS: dict[str, Callable[[dict], Conversation]] = {
    "sharegpt": adapt_sharegpt,
    "openai": adapt_openai,
    "alpaca": adapt_alpaca,
    "problem_solution": adapt_problem_solution,
    "tool_use": adapt_tool_use,
    "native": adapt_native,
}


def source_id(row: Any, fallback: str | None) -> str | None:
    """The record's own id (:data:`SOURCE_ID_FIELDS`), else ``fallback`` (``<file>#<index>``)."""
    if isinstance(row, dict):
        for name in SOURCE_ID_FIELDS:
            v = row.get(name)
            if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip():
                return str(v)
    return fallback


def normalize_record(record: Any, adapter: str, *, source: str, domain: str,
                     fallback_id: str | None = None, where: str | None = None) -> dict[str, Any]:
    """One input record (a jsonl line as text, or a parsed row) -> a row of :data:`NORMALIZED_SCHEMA`.

    ``fallback_id`` is the ``source_id`` of a record without an id of its own; ``where`` (file and line) prefixes
    the detail of a line that is not JSON, so the operator can find it.
    """
    if isinstance(record, str):
        raw = record
        try:
            row = json.loads(record)
        except json.JSONDecodeError as e:
            at = f"{where}: " if where else ""
            return bad_row(raw, source, domain, INVALID_JSON, f"{at}line is not JSON ({e.msg} at column {e.colno})",
                        fallback_id)
    else:
        row, raw = record, raw_json(record)
    sid = source_id(row, fallback_id)
    if not isinstance(row, dict):
        return bad_row(raw, source, domain, NOT_AN_OBJECT, f"expected a JSON object, got {type(row).__name__}", sid)
    fixed = Repaired([])
    try:
        conv = ADAPTERS[adapter](row)
        if not conv.native:
            fixed = repair_conversation(conv.messages)
            conv.messages = fixed.messages
            if fixed.empty_exchanges_dropped and not any(m["role"] == "user" for m in conv.messages):
                raise BadRow(EMPTY_CONVERSATION, f"no user turn left after dropping {fixed.empty_exchanges_dropped} "
                                                 "exchange(s) with an empty turn")
            validate_conversation(conv.messages)
    except BadRow as e:
        return bad_row(raw, source, domain, e.reason, e.detail, sid)
    return {
        "id": conversation_id(conv), "source": source, "domain": domain,
        "messages": [_to_arrow_message(m) for m in conv.messages],
        "tools": None if conv.tools is None else _canon(conv.tools),
        "native": conv.native, "native_input_ids": conv.native_input_ids, "native_loss_mask": conv.native_loss_mask,
        "status": OK, "detail": None, "raw": raw, "source_id": sid,
        "leading_turns_dropped": fixed.leading_turns_dropped, "empty_exchanges_dropped": fixed.empty_exchanges_dropped,
    }


def bad_row(raw: str, source: str, domain: str, reason: str, detail: str, sid: str | None = None) -> dict[str, Any]:
    """A quarantine row of :data:`NORMALIZED_SCHEMA` (id = hash of the raw text: stable, so reruns find it done)."""
    return {"id": raw_id(raw), "source": source, "domain": domain, "messages": [], "tools": None, "native": False,
            "native_input_ids": None, "native_loss_mask": None, "status": reason, "detail": detail, "raw": raw,
            "source_id": sid, "leading_turns_dropped": 0, "empty_exchanges_dropped": 0}


def _to_arrow_message(m: dict[str, Any]) -> dict[str, Any]:
    return {"role": m["role"], "content": m.get("content"), "reasoning_content": m.get("reasoning_content"),
            "tool_calls": _canon(m["tool_calls"]) if m.get("tool_calls") else None}


def normalize_records(records: Iterable[Any], adapter: str, *, source: str, domain: str) -> pa.Table:
    """A batch of records -> a :data:`NORMALIZED_SCHEMA` table (never raises on bad data)."""
    rows = [normalize_record(r, adapter, source=source, domain=domain) for r in records]
    return pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA)


def damage_row(source: str, domain: str, *, file: str, offset: int, message: str, records_before: int) -> dict:
    """The quarantine row of a damaged file: one per (file, offset, message), so a rerun finds it already done."""
    facts = {"file": file, "offset": offset, "message": message, "records_before": records_before}
    raw = _canon(facts)
    detail = (f"{file}: damaged at byte {offset}: {message}; the {records_before} record(s) before it were read, "
              "the rest of the file was not")
    return {"id": _hash("damage", source, file, str(offset), message), "source": source, "domain": domain,
            "messages": [], "tools": None, "native": False, "native_input_ids": None, "native_loss_mask": None,
            "status": DAMAGED_SOURCE, "detail": detail, "raw": raw, "source_id": f"{Path(file).name}@{offset}",
            "leading_turns_dropped": 0, "empty_exchanges_dropped": 0}


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages -> what a chat template expects (tool calls parsed, empty optional fields left out)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            d["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls:
            d["tool_calls"] = json.loads(calls) if isinstance(calls, str) else calls
        out.append(d)
    return out


def parse_tools(tools: str | list | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return json.loads(tools) if isinstance(tools, str) else list(tools)
