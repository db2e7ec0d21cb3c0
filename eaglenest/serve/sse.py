"""Server-sent events as the OpenAI streaming API frames them: one ``data: <json>`` event per chunk, ``[DONE]`` last."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "[DONE]"


def sse(data: dict[str, Any] | str) -> str:
    """One event: a chunk as compact JSON, or a literal such as :data:`DONE`."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The HTTP response streaming ``events`` (already framed by :func:`sse`)."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
