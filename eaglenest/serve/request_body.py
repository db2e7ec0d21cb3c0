"""Reading and validating one request body, so that no client input can reach a 500.

Why a module of its own: a body is refused in the order a client can act on, each time with an OpenAI error body
naming what to fix, before anything is tokenised:

1. ``Content-Type`` other than JSON (``application/json`` or ``*+json``; none sent counts as JSON) -> 415;
2. a body over ``serve.max_request_bytes`` -> 413 ``request_too_large`` (``Content-Length`` is checked first, a
   chunked body is counted while it arrives, so an oversized one is never held whole);
3. invalid JSON, including nesting deeper than the JSON parser's recursion limit -> 400 ``invalid_json``;
4. the schema, validated strictly from the JSON (``"stream": "yes"`` is not a boolean) -> 400 naming the parameter,
   as OpenAI and vLLM answer type errors.

Seeds of any 64-bit size are mapped where the sampling values are checked (:mod:`eaglenest.serve.seeds`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from eaglenest.serve.openai_protocol import APIError, validation_message


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (415, 413) before it is parsed; at most ``limit`` bytes are ever buffered."""
    ctype = request.headers.get("content-type")
    if not _is_json(ctype):
        raise APIError(415, f"Content-Type {ctype!r} is not supported: send the body as JSON with "
                            f"'Content-Type: application/json'", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError as e:
            raise APIError(400, f"invalid Content-Length {declared!r}", code="invalid_request") from e
        if size > limit:
            raise _too_large(size, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, *, at_least: bool = False) -> APIError:
    got = f"at least {size}" if at_least else str(size)
    return APIError(413, f"the request body is {got} bytes; this server accepts at most {limit} "
                         f"(serve.max_request_bytes)", code="request_too_large")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """``model`` validated strictly from the JSON text; every failure is a 400 naming the first bad parameter."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            detail = next(err for err in errors if err["type"] == "json_invalid").get("ctx", {}).get("error", "")
            raise APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json") from e
        if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            raise APIError(400, "the request body must be a JSON object", code="invalid_json") from e
        msg, param = validation_message(errors)
        kind = errors[0]["type"] if errors else ""
        code = {"missing": "missing_required_parameter", "value_error": "invalid_value",
                "literal_error": "invalid_value"}.get(kind, "invalid_type")
        raise APIError(400, msg, param=param, code=code) from e
