"""The checks a request passes before it may decode, each raising an :class:`APIError` a client can act on.

API key (401), model name (404), prompt size (400 ``context_length_exceeded``, what clients' truncation fallbacks key
on) and admission (429 + ``Retry-After`` over ``serve.max_concurrent_requests`` per replica). Readiness (503 while
unhealthy or draining) is the replica's state: :meth:`eaglenest.serve.core.ServerCore.check_ready`.
"""

from __future__ import annotations

import hmac
import os

from eaglenest.serve.drain import RETRY_AFTER_BUSY_S
from eaglenest.serve.openai_protocol import APIError

API_KEY_ENV = "EAGLENEST_API_KEY"


def resolve_api_key(*candidates: str | None) -> str | None:
    """The first configured key (argument, ``serve.api_key``), else ``$EAGLENEST_API_KEY``; None = no auth."""
    for key in candidates:
        if key:
            return key
    return os.environ.get(API_KEY_ENV) or None


def check_api_key(authorization: str, api_key: str | None) -> None:
    """``Authorization: Bearer <key>`` must carry ``api_key`` (compared in constant time); no key configured: open."""
    if not api_key:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "Missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")


def check_model(model: str, served: str) -> None:
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{served}` (GET /v1/models)",
                       param="model", code="model_not_found")


def check_prompt(n: int, max_tokens: int, *, max_prompt_tokens: int, context: int | None,
                 param: str = "messages") -> None:
    """A prompt of ``n`` tokens fits ``serve.max_prompt_tokens`` and, with ``max_tokens``, the model's context;
    ``param`` names the prompt's field (``messages`` on chat, ``prompt`` on completions)."""
    if n == 0:
        raise APIError(400, "the prompt is empty", param=param)
    if n > max_prompt_tokens:  # 400 + context_length_exceeded: what clients' truncation fallbacks key on
        raise APIError(400, f"This model's maximum context length is {max_prompt_tokens} prompt tokens "
                            f"(serve.max_prompt_tokens). However, your {param} resulted in {n} tokens. Please "
                            f"reduce the length of the {param}.", param=param,
                       code="context_length_exceeded")
    if context and n + max_tokens > context:
        raise APIError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceed the model's context "
                            f"of {context} tokens; lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")


class Admission:
    """Requests in flight on this replica; over ``limit`` a request is refused with 429 instead of queueing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0

    def acquire(self) -> None:
        if self.inflight >= self.limit:
            raise APIError(429, f"too many concurrent requests: this replica runs at most {self.limit} "
                                f"(serve.max_concurrent_requests); retry shortly", code="too_many_requests",
                           retry_after=RETRY_AFTER_BUSY_S)
        self.inflight += 1

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)
