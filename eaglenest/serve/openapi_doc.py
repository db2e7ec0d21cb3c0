"""The served ``/openapi.json``: every route's request body and every response it can give, with its content type.

Why by hand: the handlers read their raw body themselves (serve.request_body) and answer with OpenAI's error bodies,
SSE streams and Prometheus text, none of which FastAPI can infer; its document named no request bodies, only a 200
of unknown shape and a 422 no route returns. Clients generate code from this document and schema-driven fuzzers
(schemathesis, in ``tests/e2e/test_serve_api_edges.py``) check each response against it: status, content type and
body schema.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from eaglenest.serve.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from eaglenest.serve.responses_api import ResponseObject, ResponsesRequest, ResponseStreamEvent
from eaglenest.serve.sse import DONE

ERRORS = {400: "invalid parameter or type (the error names it)", 401: "missing or wrong API key",
          404: "unknown model", 413: "body over serve.max_request_bytes", 415: "body not JSON",
          429: "over serve.max_concurrent_requests (Retry-After)", 503: "unhealthy or draining (Retry-After)"}


class Health(BaseModel):
    """``GET /health``: the status, and for callers allowed to see it (serve.health_details_public or the API key)
    the model, target, engine, drafter, requests in flight and the self-test; a 503 adds OpenAI's ``error``."""

    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "unhealthy"]


def build(app: Any, routes: dict[str, str]) -> dict[str, Any]:
    """The document of ``app`` (a FastAPI app); ``routes`` maps chat, completions, responses, models, model,
    health, metrics to their paths."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)

    def ref(model: type[BaseModel]) -> dict[str, str]:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def json_body(model: type[BaseModel], why: str) -> dict[str, Any]:
        return {"description": why, "content": {"application/json": {"schema": ref(model)}}}

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): json_body(ErrorResponse, ERRORS[c]) for c in codes}

    paths = schema["paths"]
    for key, request, response, chunk in (("chat", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
                                          ("completions", CompletionRequest, Completion, None)):
        op = paths[routes[key]]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
        # OpenAPI 3.1: the schema of a text/event-stream describes one event; its data is JSON (contentSchema) or
        # the closing literal, so schema-driven checks read every chunk, not only that data is a string
        item = chunk or response
        data = {"anyOf": [{"const": DONE},
                          {"type": "string", "contentMediaType": "application/json",
                           "contentSchema": {"anyOf": [ref(item), ref(ErrorResponse)]}}],
                "description": f"a {item.__name__} as JSON, an ErrorResponse if the generation fails (or a drain's "
                               f"deadline ends it), then {DONE}"}
        stream = {"type": "object", "required": ["data"], "description": "one server-sent event",
                  "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                                 "retry": {"type": "integer"}}}
        op["responses"] = {"200": {"description": "the completion; with stream: true, a stream of chunks",
                                   "content": {"application/json": {"schema": ref(response)},
                                               "text/event-stream": {"schema": stream}}},
                           **errors(400, 401, 404, 413, 415, 429, 503)}
    op = paths[routes["responses"]]["post"]
    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(ResponsesRequest)}}}
    event = {"type": "object", "required": ["data"], "description": "one server-sent event, named by its type",
             "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                     "contentSchema": ref(ResponseStreamEvent)},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
    op["responses"] = {"200": {"description": "the response; with stream: true, its typed events (no [DONE])",
                               "content": {"application/json": {"schema": ref(ResponseObject)},
                                           "text/event-stream": {"schema": event}}},
                       **errors(400, 401, 404, 413, 415, 429, 503)}
    paths[routes["models"]]["get"]["responses"] = {"200": json_body(ModelList, "the served model"), **errors(401)}
    paths[routes["model"]]["get"]["responses"] = {"200": json_body(ModelCard, "the model card"), **errors(401, 404)}
    paths[routes["health"]]["get"]["responses"] = {"200": json_body(Health, "healthy"),
                                                   "503": json_body(Health, "unhealthy or draining (Retry-After)")}
    paths[routes["metrics"]]["get"]["responses"] = {
        "200": {"description": "vLLM's spec-decode counters, summed over the replicas (Prometheus text)",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
        "503": json_body(ErrorResponse, "the counters are unavailable (Retry-After)")}
    return schema
