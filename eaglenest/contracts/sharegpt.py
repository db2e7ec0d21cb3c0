"""The ShareGPT chat format (``conversations[{from, value}]``): which speaker names mean which chat role.

One table for every reader of ShareGPT dumps: regen's ``sharegpt`` adapter (normalization, with quarantine) and the
GPU stand-in builder (pre-training text, which writes ShareGPT prompt files for regen in turn).
"""

from __future__ import annotations

from typing import Any

SPEAKER_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "tool": "tool",
    "function_response": "tool", "observation": "tool", "ipython": "tool",
}
"""ShareGPT speaker names seen in public dumps (lower-cased) -> chat roles."""


def speaker_role(who: Any) -> str | None:
    """The chat role of a turn's ``from`` value, None for a speaker the format does not define."""
    return SPEAKER_ROLES.get(str(who).lower())


def sharegpt_record(record_id: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A ShareGPT record of user/assistant ``messages`` (what regen's ``sharegpt`` adapter reads)."""
    speaker = {"user": "human", "assistant": "gpt"}
    return {"id": record_id, "conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}
