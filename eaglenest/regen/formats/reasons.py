"""Why a row was quarantined: the reason codes, what each points at, and the exception adapters raise."""

from __future__ import annotations

INVALID_JSON = "invalid_json"            # a jsonl line that is not JSON
NOT_AN_OBJECT = "not_an_object"          # JSON, but not an object
MISSING_FIELD = "missing_field"          # a field the format requires is absent or null
WRONG_TYPE = "wrong_type"                # a field of the wrong type (string where a list belongs, ...)
EMPTY_CONVERSATION = "empty_conversation"  # no user turn at all
UNKNOWN_ROLE = "unknown_role"            # a role/from value the format does not define
ROLE_ORDER = "role_order"                # assistant first, system in the middle, tool result without a call, ...
EMPTY_MESSAGE = "empty_message"          # a user/system/tool turn with no text
BAD_TOOL_CALL = "bad_tool_call"          # tool call without a name, arguments that are not a JSON object
BAD_NATIVE = "bad_native"                # pre-tokenized sample with mismatched ids/mask, no loss tokens, ...
TOO_LONG = "too_long"                    # length filter (target tokens)
TOO_SHORT = "too_short"                  # length filter (target tokens)
TOKEN_OUT_OF_RANGE = "token_out_of_range"  # native ids outside the target's vocabulary
TEMPLATE_NOT_APPEND_ONLY = "template_not_append_only"  # the chat template rewrites earlier turns
ASSISTANT_RENDER_MISMATCH = "assistant_render_mismatch"  # the template renders the target's answer differently
ENGINE_ERROR = "engine_error"            # the engine failed on this sample alone
DAMAGED_SOURCE = "damaged_source"        # the file is damaged here (truncated, invalid bytes): reading stopped

REASONS = (INVALID_JSON, NOT_AN_OBJECT, MISSING_FIELD, WRONG_TYPE, EMPTY_CONVERSATION, UNKNOWN_ROLE, ROLE_ORDER,
           EMPTY_MESSAGE, BAD_TOOL_CALL, BAD_NATIVE, TOO_LONG, TOO_SHORT, TOKEN_OUT_OF_RANGE,
           TEMPLATE_NOT_APPEND_ONLY, ASSISTANT_RENDER_MISMATCH, ENGINE_ERROR, DAMAGED_SOURCE)

# What a quarantine reason points at (the quarantine alert's annotation and runbook follow this split, checked by
# tests/unit/test_regen_sources.py): the dataset's rows, the adapter chosen for the source, the length settings, or the
# target/engine.
REASON_GROUPS = {
    "data": (INVALID_JSON, NOT_AN_OBJECT, EMPTY_CONVERSATION, EMPTY_MESSAGE, BAD_TOOL_CALL, BAD_NATIVE,
             TOKEN_OUT_OF_RANGE, DAMAGED_SOURCE),
    "adapter": (MISSING_FIELD, WRONG_TYPE, UNKNOWN_ROLE, ROLE_ORDER),
    "length": (TOO_LONG, TOO_SHORT),
    "target": (TEMPLATE_NOT_APPEND_ONLY, ASSISTANT_RENDER_MISMATCH, ENGINE_ERROR),
}

OK = "ok"


class BadRow(ValueError):
    """A row that cannot become a sample; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
