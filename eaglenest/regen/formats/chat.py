"""Multi-turn chat formats: ShareGPT (``conversations[{from, value}]``) and OpenAI (``messages[{role, content}]``)."""

from __future__ import annotations

from typing import Any

from eaglenest.contracts.sharegpt import speaker_role
from eaglenest.regen.formats.fields import (
    _field,
    _maybe_json,
    _msg,
    _text,
    _tool_call,
    _tools,
    split_reasoning,
    split_tool_calls,
)
from eaglenest.regen.formats.reasons import MISSING_FIELD, UNKNOWN_ROLE, WRONG_TYPE, BadRow
from eaglenest.regen.formats.schema import Conversation


def adapt_sharegpt(row: dict) -> Conversation:
    """ShareGPT ``conversations[{from, value}]`` (+ optional top-level ``system`` as in OpenThoughts, ``tools``)."""
    turns = _maybe_json(_field(row, "conversations", "conversation", "items"), "conversations")
    if not isinstance(turns, list):
        raise BadRow(WRONG_TYPE, f"conversations must be a list, got {type(turns).__name__}")
    messages: list[dict[str, Any]] = []
    system = row.get("system")
    if system is not None and _text(system, "system", allow_empty=True).strip():
        messages.append(_msg("system", system))
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow(WRONG_TYPE, f"conversations[{i}] must be an object, got {type(t).__name__}")
        who = t.get("from", t.get("role"))
        if who is None:
            raise BadRow(MISSING_FIELD, f"conversations[{i}].from")
        role = speaker_role(who)
        if role is None:
            raise BadRow(UNKNOWN_ROLE, f"conversations[{i}].from = {who!r}")
        value = t.get("value", t.get("content"))
        if value is None:
            raise BadRow(MISSING_FIELD, f"conversations[{i}].value")
        value = _text(value, f"conversations[{i}].value", allow_empty=True)
        if role == "assistant":
            reasoning, answer = split_reasoning(value)
            answer, calls = split_tool_calls(answer)
            messages.append(_msg("assistant", answer, reasoning, calls))
        else:
            messages.append(_msg(role, value))
    return Conversation(messages, _tools(row.get("tools")))


OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool", "ipython": "tool"}


def _openai_content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow(WRONG_TYPE, f"{where}[{j}] is a {kind!r} content part; only text is supported")
            texts.append(_text(part.get("text"), f"{where}[{j}].text", allow_empty=True))
        return "".join(texts)
    raise BadRow(WRONG_TYPE, f"{where} must be a string or a list of text parts, got {type(value).__name__}")


def adapt_openai(row: dict) -> Conversation:
    """OpenAI chat ``messages[{role, content, reasoning_content, tool_calls}]`` (UltraChat, LMSYS, SWE-smith)."""
    turns = _maybe_json(_field(row, "messages", "conversation", "conversations"), "messages")
    if not isinstance(turns, list):
        raise BadRow(WRONG_TYPE, f"messages must be a list, got {type(turns).__name__}")
    messages: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow(WRONG_TYPE, f"messages[{i}] must be an object, got {type(t).__name__}")
        if t.get("role") is None:
            raise BadRow(MISSING_FIELD, f"messages[{i}].role")
        role = OPENAI_ROLES.get(str(t["role"]).lower())
        if role is None:
            raise BadRow(UNKNOWN_ROLE, f"messages[{i}].role = {t['role']!r}")
        content = _openai_content(t.get("content"), f"messages[{i}].content")
        if role != "assistant":
            messages.append(_msg(role, content))
            continue
        calls = t.get("tool_calls")
        if calls is None and isinstance(t.get("function_call"), dict):
            calls = [t["function_call"]]
        calls = _maybe_json(calls, f"messages[{i}].tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise BadRow(WRONG_TYPE, f"messages[{i}].tool_calls must be a list")
        tool_calls = [_tool_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls or [])]
        reasoning = t.get("reasoning_content", t.get("reasoning"))
        if reasoning is not None:
            reasoning = _text(reasoning, f"messages[{i}].reasoning_content", allow_empty=True) or None
        elif content:
            reasoning, content = split_reasoning(content)
        messages.append(_msg("assistant", content or "", reasoning, tool_calls))
    return Conversation(messages, _tools(row.get("tools")))
