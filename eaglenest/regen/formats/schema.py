"""The one conversation schema every source format becomes, and its content-hash ids.

Ids are content hashes of what regeneration depends on (system/user/tool turns, the positions of assistant turns,
the tools), so the same prompt in two datasets is one sample, and an id never changes between runs. The original
assistant answers are kept (they count for the length filter) but do not enter the id: the target replaces them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

MESSAGE_TYPE = pa.struct([
    ("role", pa.string()),
    ("content", pa.string()),
    ("reasoning_content", pa.string()),
    ("tool_calls", pa.string()),  # JSON list of {"type": "function", "function": {"name", "arguments": {...}}}
])

NORMALIZED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("domain", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("tools", pa.string()),  # JSON list of tool schemas, or null
    ("native", pa.bool_()),
    ("native_input_ids", pa.list_(pa.int32())),
    ("native_loss_mask", pa.list_(pa.int8())),
    ("status", pa.string()),  # "ok" or a quarantine reason
    ("detail", pa.string()),
    ("raw", pa.string()),  # the input row as JSON (what quarantine keeps)
    ("source_id", pa.string()),  # the record's own id, or <file>#<index>
    ("leading_turns_dropped", pa.int32()),  # non-user turns before the first user turn (normalization note)
    ("empty_exchanges_dropped", pa.int32()),  # exchanges dropped for an empty user/tool turn (normalization note)
])

QUARANTINE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("raw", pa.string()),
    ("source_id", pa.string()),  # added with issue #13; older quarantine files lack it (readers must not need it)
])

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    """A normalized conversation (``tool_calls`` parsed) or a native pre-tokenized sample."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    native_input_ids: list[int] | None = None
    native_loss_mask: list[int] | None = None

    @property
    def native(self) -> bool:
        return self.native_input_ids is not None


def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:32]


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def conversation_id(conv: Conversation) -> str:
    """Stable content hash of what regeneration depends on (assistant answers excluded: the target replaces them)."""
    if conv.native:
        return _hash("native", _canon(conv.native_input_ids), _canon(conv.native_loss_mask))
    turns = [[m["role"], None if m["role"] == "assistant" else m.get("content")] for m in conv.messages]
    return _hash("conv", _canon(turns), _canon(conv.tools))


def raw_id(raw: str) -> str:
    """Id of a row that could not be normalized: a hash of its raw text (stable, so reruns find it done)."""
    return _hash("raw", raw)


def raw_json(row: Any) -> str:
    """The raw row as JSON text (what quarantine keeps)."""
    return json.dumps(row, ensure_ascii=False, default=str)
