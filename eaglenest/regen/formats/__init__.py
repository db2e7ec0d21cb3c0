"""Source formats -> one conversation schema, and the quarantine rules for rows that do not fit.

One module per job: :mod:`.reasons` (quarantine reasons), :mod:`.schema` (the normalized schema and content-hash
ids), :mod:`.fields` (field readers the adapters share), :mod:`.repair` (keep-what-is-usable rules and role-order
checks), the adapters by format family (:mod:`.chat`: ShareGPT, OpenAI; :mod:`.single_turn`: Alpaca,
problem/solution, xLAM tool use; :mod:`.native`: pre-tokenized), :mod:`.normalize` (record -> sample or quarantine
row) and :mod:`.filters` (length filter, deduplication).
"""

from __future__ import annotations

from eaglenest.regen.formats.chat import (
    OPENAI_ROLES,
    adapt_openai,
    adapt_sharegpt,
)
from eaglenest.regen.formats.fields import (
    split_reasoning,
    split_tool_calls,
)
from eaglenest.regen.formats.filters import (
    Deduplicator,
    conversation_tokens,
    length_problem,
)
from eaglenest.regen.formats.native import (
    adapt_native,
)
from eaglenest.regen.formats.normalize import (
    ADAPTERS,
    SOURCE_ID_FIELDS,
    bad_row,
    damage_row,
    normalize_record,
    normalize_records,
    parse_tools,
    source_id,
    template_messages,
)
from eaglenest.regen.formats.reasons import (
    ASSISTANT_RENDER_MISMATCH,
    BAD_NATIVE,
    BAD_TOOL_CALL,
    DAMAGED_SOURCE,
    EMPTY_CONVERSATION,
    EMPTY_MESSAGE,
    ENGINE_ERROR,
    INVALID_JSON,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    OK,
    REASON_GROUPS,
    REASONS,
    ROLE_ORDER,
    TEMPLATE_NOT_APPEND_ONLY,
    TOKEN_OUT_OF_RANGE,
    TOO_LONG,
    TOO_SHORT,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    BadRow,
)
from eaglenest.regen.formats.repair import (
    Repaired,
    repair_conversation,
    validate_conversation,
)
from eaglenest.regen.formats.schema import (
    MESSAGE_TYPE,
    NORMALIZED_SCHEMA,
    QUARANTINE_SCHEMA,
    ROLES,
    Conversation,
    conversation_id,
    raw_id,
    raw_json,
)
from eaglenest.regen.formats.single_turn import (
    adapt_alpaca,
    adapt_problem_solution,
    adapt_tool_use,
)

__all__ = [
    "ADAPTERS",
    "ASSISTANT_RENDER_MISMATCH",
    "BAD_NATIVE",
    "BAD_TOOL_CALL",
    "BadRow",
    "Conversation",
    "DAMAGED_SOURCE",
    "Deduplicator",
    "EMPTY_CONVERSATION",
    "EMPTY_MESSAGE",
    "ENGINE_ERROR",
    "INVALID_JSON",
    "MESSAGE_TYPE",
    "MISSING_FIELD",
    "NORMALIZED_SCHEMA",
    "NOT_AN_OBJECT",
    "OK",
    "OPENAI_ROLES",
    "QUARANTINE_SCHEMA",
    "REASONS",
    "REASON_GROUPS",
    "ROLES",
    "ROLE_ORDER",
    "Repaired",
    "SOURCE_ID_FIELDS",
    "TEMPLATE_NOT_APPEND_ONLY",
    "TOKEN_OUT_OF_RANGE",
    "TOO_LONG",
    "TOO_SHORT",
    "UNKNOWN_ROLE",
    "WRONG_TYPE",
    "adapt_alpaca",
    "adapt_native",
    "adapt_openai",
    "adapt_problem_solution",
    "adapt_sharegpt",
    "adapt_tool_use",
    "bad_row",
    "conversation_id",
    "conversation_tokens",
    "damage_row",
    "length_problem",
    "normalize_record",
    "normalize_records",
    "parse_tools",
    "raw_id",
    "raw_json",
    "repair_conversation",
    "source_id",
    "split_reasoning",
    "split_tool_calls",
    "template_messages",
    "validate_conversation",
]
