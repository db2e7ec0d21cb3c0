"""Field readers every adapter shares: required fields, text, JSON-or-nested values, reasoning and tool calls."""

from __future__ import annotations

import json
import re
from typing import Any

from eaglenest.regen.formats.reasons import BAD_TOOL_CALL, EMPTY_MESSAGE, MISSING_FIELD, WRONG_TYPE, BadRow


def _field(row: dict, *names: str, required: bool = True) -> Any:
    for n in names:
        if row.get(n) is not None:
            return row[n]
    if required:
        raise BadRow(MISSING_FIELD, " or ".join(repr(n) for n in names))
    return None


def _text(value: Any, where: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRow(WRONG_TYPE, f"{where} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRow(EMPTY_MESSAGE, f"{where} is empty")
    return value


def _maybe_json(value: Any, where: str) -> Any:
    """Fields that datasets store either as JSON text or as nested values (xLAM ``tools``, SWE-smith ``messages``)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(WRONG_TYPE, f"{where} is a string but not valid JSON ({e.msg})") from None
    return value


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*(.*)$", re.S)
_OPENTHOUGHTS = re.compile(
    r"^\s*<\|begin_of_thought\|>(.*?)<\|end_of_thought\|>\s*(?:<\|begin_of_solution\|>(.*?)<\|end_of_solution\|>)?\s*(.*)$",
    re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of an assistant text with ``<think>`` or OpenThoughts' thought/solution markers."""
    m = _THINK.match(text)
    if m:
        return m.group(1).strip() or None, m.group(2)
    m = _OPENTHOUGHTS.match(text)
    if m:
        answer = (m.group(2) or "").strip() + (m.group(3) or "")
        return m.group(1).strip() or None, answer.strip()
    return None, text


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """``(text without calls, calls)`` for Hermes-style ``<tool_call>{json}</tool_call>`` blocks in ShareGPT values.

    A block that is not a valid call stays in the text (it is only history; the target regenerates the turn).
    """
    calls, keep, last = [], [], 0
    for m in _TOOL_CALL_TAG.finditer(text):
        try:
            call = _tool_call(json.loads(m.group(1)), "tool_call")
        except (json.JSONDecodeError, BadRow):
            continue
        calls.append(call)
        keep.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, None
    keep.append(text[last:])
    return "".join(keep).strip(), calls


def _tool_call(tc: Any, where: str) -> dict[str, Any]:
    """One OpenAI-style tool call (``{"function": {...}}`` or bare ``{"name", "arguments"}``) -> canonical form."""
    if not isinstance(tc, dict):
        raise BadRow(BAD_TOOL_CALL, f"{where} is not an object")
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadRow(BAD_TOOL_CALL, f"{where} has no function name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise BadRow(BAD_TOOL_CALL, f"{where} ({name}) arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise BadRow(BAD_TOOL_CALL, f"{where} ({name}) arguments must be a JSON object")
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _tools(value: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    value = _maybe_json(value, where)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(WRONG_TYPE, f"{where} must be a list of tool objects")
    out = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow(BAD_TOOL_CALL, f"{where}[{i}] has no name")
        out.append({"type": "function", "function": fn})
    return out


def _msg(role: str, content: str | None, reasoning: str | None = None,
         tool_calls: list[dict] | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls or None}
