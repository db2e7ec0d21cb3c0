"""After normalization: the length filter (target tokens) and first-occurrence deduplication by id."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eaglenest.regen.formats.normalize import parse_tools, template_messages
from eaglenest.regen.formats.reasons import TOO_LONG, TOO_SHORT


def length_problem(num_tokens: int, min_tokens: int, max_tokens: int) -> tuple[str, str] | None:
    """The length filter: ``(reason, detail)`` for a sample outside ``[min_tokens, max_tokens]``, else None."""
    if num_tokens > max_tokens:
        return TOO_LONG, f"{num_tokens} tokens > max_tokens {max_tokens}"
    if num_tokens < min_tokens:
        return TOO_SHORT, f"{num_tokens} tokens < min_tokens {min_tokens}"
    return None


def conversation_tokens(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any) -> int:
    """Target tokens of the conversation as given (original answers), the input side of the length filter."""
    from eaglenest.engines.base import render_chat_ids

    return len(render_chat_ids(tokenizer, template_messages(messages), tools=parse_tools(tools),
                               add_generation_prompt=messages[-1]["role"] != "assistant"))


class Deduplicator:
    """First occurrence of an id wins (sources in config order, rows in file order); later ones are counted."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.duplicates: dict[str, int] = {}

    def first(self, sample_id: str, source: str) -> bool:
        if sample_id in self.seen:
            self.duplicates[source] = self.duplicates.get(source, 0) + 1
            return False
        self.seen.add(sample_id)
        return True
