"""Conversation rules after adaptation: keep what is usable (repair), then check the role order (validate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglenest.regen.formats.reasons import EMPTY_CONVERSATION, EMPTY_MESSAGE, MISSING_FIELD, ROLE_ORDER, BadRow


@dataclass
class Repaired:
    """A conversation after the keep-what-is-usable rules, and what they removed (reported as notes, per source)."""

    messages: list[dict[str, Any]]
    leading_turns_dropped: int = 0
    empty_exchanges_dropped: int = 0


def _is_empty(m: dict[str, Any]) -> bool:
    return isinstance(m.get("content"), str) and not m["content"].strip()


def repair_conversation(messages: list[dict[str, Any]]) -> Repaired:
    """Keep what is usable, as EAGLE data pipelines do (docs/OPERATIONS.md, "Normalization rules").

    Split ShareGPT chats often start mid-exchange with a ``gpt`` turn, and dumps carry empty human turns; quarantining
    the whole conversation for either loses most of a public dump. So: an empty leading system message is dropped;
    assistant/tool turns before the first user turn are dropped; an exchange (a user turn and everything up to the
    next user turn) holding an empty user or tool turn is dropped. ``None`` content is not "empty": it stays a
    ``missing_field`` for :func:`validate_conversation`.
    """
    msgs = list(messages)
    head: list[dict[str, Any]] = []
    if msgs and msgs[0]["role"] == "system":
        first = msgs.pop(0)
        if not _is_empty(first):
            head.append(first)
    lead = 0
    while msgs and msgs[0]["role"] in ("assistant", "tool"):
        msgs.pop(0)
        lead += 1
    exchanges: list[list[dict[str, Any]]] = []
    for m in msgs:
        if m["role"] == "user" or not exchanges:
            exchanges.append([m])
        else:
            exchanges[-1].append(m)
    kept = [ex for ex in exchanges if not any(m["role"] in ("user", "tool") and _is_empty(m) for m in ex)]
    return Repaired(head + [m for ex in kept for m in ex], lead, len(exchanges) - len(kept))


def validate_conversation(messages: list[dict[str, Any]]) -> None:
    """Role order every regeneration relies on; raises :class:`BadRow` with the first problem found."""
    if not any(m["role"] == "user" for m in messages):
        raise BadRow(EMPTY_CONVERSATION, f"{len(messages)} message(s) and no user turn")
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i != 0:
            raise BadRow(ROLE_ORDER, f"system message at position {i} (only the first message may be system)")
        if role == "assistant" and prev in (None, "system"):
            raise BadRow(ROLE_ORDER, f"assistant turn at position {i} before any user turn")
        if role == "tool" and not _follows_tool_call(messages, i):
            raise BadRow(ROLE_ORDER, f"tool result at position {i} without a preceding assistant tool call")
        if role == "assistant" and prev == "assistant":
            raise BadRow(ROLE_ORDER, f"two assistant turns in a row at position {i}")
        if role in ("user", "system", "tool"):
            if m.get("content") is None:
                raise BadRow(MISSING_FIELD, f"{role} message at position {i} has no content")
            if not m["content"].strip():
                raise BadRow(EMPTY_MESSAGE, f"{role} message at position {i} is empty")
        prev = role


def _follows_tool_call(messages: list[dict], i: int) -> bool:
    j = i - 1
    while j >= 0 and messages[j]["role"] == "tool":
        j -= 1
    return j >= 0 and messages[j]["role"] == "assistant" and bool(messages[j].get("tool_calls"))
