"""OpenAI wire format: request models (type-checked only; value checks live in ``check_*`` with a named param),
response, stream-chunk and error models (pydantic, next to the request models; the builders below fill them), and
the value checks.

Type problems (missing ``messages``, ``max_tokens: "ten"``, ``stream: "yes"``, a user message without content, a
tool without ``function``) and values the server cannot honour (``temperature: -1``, ``n: 3``, an unknown argument)
are all HTTP 400 naming the param, as OpenAI and vLLM answer; the request models are validated strictly from the
JSON (:mod:`eaglenest.serve.request_body`).

OpenAI parameters that do not change what is decoded (:data:`IGNORED_PARAMS`: storage, metadata, billing tier,
reasoning effort, user ids, cache keys) are accepted and ignored, as other open-model servers do; the open-model
sampling extensions ``top_k``, ``min_p`` and ``repetition_penalty`` (vLLM's and SGLang's names) are implemented.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from eaglenest.engines.base import OutputConstraint
from eaglenest.serve.seeds import engine_seed

IGNORED_PARAMS = ("store", "metadata", "service_tier", "reasoning_effort", "user", "prompt_cache_key",
                  "safety_identifier", "parallel_tool_calls")
"""accepted and ignored: none of them changes the tokens this server decodes"""
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}
"""OpenAI's limits: ``top_logprobs`` <= 20 on chat, ``logprobs`` <= 5 on legacy completions"""

# ------------------------------------------------------------------------------------------------------- errors
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error that becomes an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        """seconds, sent as ``Retry-After`` (429 and 503: clients back off instead of retrying at once)"""

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``, ``type`` from the status."""
    return ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                           param=param, code=code)).model_dump()


# ----------------------------------------------------------------------------------------------------- requests
class _Request(BaseModel):
    # unknown arguments are kept so they can be refused with a 400 that names them (as OpenAI does)
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool | None = None
    """extension shared with vLLM and SGLang: decode exactly ``max_tokens`` tokens (benchmarks)"""
    top_k: int | None = None
    """extension (vLLM, SGLang): sample from the k most likely tokens; -1 or 0: all"""
    min_p: float | None = None
    """extension (vLLM, SGLang): drop tokens below min_p times the most likely one's probability"""
    repetition_penalty: float | None = None
    """extension (vLLM, SGLang, transformers): penalise every token of the prompt and output so far; 1: off"""
    # accepted and ignored (IGNORED_PARAMS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def unknown_args(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        """Only an assistant turn may leave ``content`` out (when it calls tools), as OpenAI requires."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None
    separate_reasoning: bool | None = None
    """extension (SGLang): split reasoning into ``reasoning_content`` for this request (None:
    ``serve.reasoning_parser``)"""
    chat_template_kwargs: dict[str, Any] | None = None
    """extension (vLLM, SGLang): variables for the chat template, e.g. ``{"thinking": false}`` (Kimi-K2.5's instant
    mode) or ``{"enable_thinking": false}`` (Qwen3)"""

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """``{"type": "function", "function": {"name": ...}}`` each: a template cannot render anything else."""
        for i, tool in enumerate(tools or ()):
            fn = tool.get("function")
            if tool.get("type", "function") != "function":
                raise ValueError(f"tools[{i}].type must be 'function', got {tool.get('type')!r}")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}] needs a function object with a name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        return tools


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


# ---------------------------------------------------------------------------------------------------- responses
class SpecUsage(BaseModel):
    """Speculative-decoding counts of one request: accept length counts the bonus token (1.0 = no draft accepted)."""

    accept_length: float
    draft_tokens: int
    accepted_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec: SpecUsage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, Any]
    """``{"role": "assistant", "content", ...}`` plus ``reasoning_content`` / ``tool_calls`` when present"""
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A legacy completion, and (with ``finish_reason`` None until the last) each of its stream chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chat_response(rid: str, model: str, message: dict[str, Any], finish_reason: str, usage: Usage,
                  created: int | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """``message``: ``{"content"}`` plus ``reasoning_content`` / ``tool_calls`` when the output had them."""
    return ChatCompletion(id=rid, created=created or now(), model=model, usage=usage, choices=[ChatChoice(
        message={"role": "assistant", **message}, logprobs=logprobs, finish_reason=finish_reason)]).model_dump()


def completion_response(rid: str, model: str, text: str, finish_reason: str, usage: Usage,
                        created: int | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return Completion(id=rid, created=created or now(), model=model, usage=usage, choices=[CompletionChoice(
        text=text, logprobs=logprobs, finish_reason=finish_reason)]).model_dump()


def chat_chunk(rid: str, model: str, created: int, *, delta: dict[str, Any] | None = None,
               finish_reason: str | None = None, usage: Usage | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; a usage-only chunk has ``choices: []`` (``stream_options.include_usage``)."""
    choices = [] if delta is None else [ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)]
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage).model_dump()


def completion_chunk(rid: str, model: str, created: int, *, text: str | None = None,
                     finish_reason: str | None = None, usage: Usage | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if text is None else [CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)]
    return Completion(id=rid, created=created, model=model, choices=choices, usage=usage).model_dump()


def models_response(model: str, created: int, owned_by: str = "eaglenest") -> dict[str, Any]:
    return ModelList(data=[ModelCard(id=model, created=created, owned_by=owned_by)]).model_dump()


class SamplingRequest(BaseModel):
    """The checked sampling knobs of one request (what the engine receives)."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """None: off; k >= 0: each token's logprob and its k most likely alternatives"""
    constraint: OutputConstraint | None = None
    """structured output (``serve.structured``): set by the chat routes after the prompt is rendered"""


def _requested_logprobs(req: _Request) -> int | None:
    """Chat: ``logprobs: true`` (+ ``top_logprobs`` <= 20); completions: ``logprobs: k`` (k <= 5)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not req.logprobs:
            return None
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS["chat"]:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS['chat']}], got {top}",
                           param="top_logprobs")
        return top
    if req.logprobs is None or req.logprobs is False:
        return None
    k = int(req.logprobs)
    if not 0 <= k <= MAX_TOP_LOGPROBS["completions"]:
        raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS['completions']}], got {k}", param="logprobs")
    return k


def _extensions(req: _Request) -> dict[str, Any]:
    """``top_k`` / ``min_p`` / ``repetition_penalty``, checked (vLLM's ranges)."""
    top_k = 0 if req.top_k in (None, -1) else int(req.top_k)
    if top_k < 0:
        raise APIError(400, f"top_k must be -1 (off) or >= 1, got {req.top_k}", param="top_k")
    min_p = 0.0 if req.min_p is None else float(req.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise APIError(400, f"min_p must be in [0, 1], got {req.min_p}", param="min_p")
    rep = 1.0 if req.repetition_penalty is None else float(req.repetition_penalty)
    if not 0.0 < rep <= 2.0:
        raise APIError(400, f"repetition_penalty must be in (0, 2], got {req.repetition_penalty}",
                       param="repetition_penalty")
    return {"top_k": top_k, "min_p": min_p, "repetition_penalty": rep}


def check_sampling(req: _Request, *, max_tokens: int | None, max_tokens_limit: int,
                   supported: tuple[str, ...] = ()) -> SamplingRequest:
    """Value checks shared by both routes; each failure is a 400 naming the parameter."""
    if req.unknown_args:
        name = req.unknown_args[0]
        raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                       code="unrecognized_argument")
    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported: this server returns one choice per request (n=1)",
                       param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported by speculative decoding here; omit it or send 0",
                           param=name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported; omit it", param="logit_bias")
    logprobs = _requested_logprobs(req)
    extensions = _extensions(req)
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if max_tokens is None:
        max_tokens = max_tokens_limit
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit of {max_tokens_limit} "
                            f"(serve.max_tokens_limit)", param="max_tokens")
    stops: tuple[str, ...] = ()
    if req.stop is not None:
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        if len(stops) > 4:
            raise APIError(400, f"at most 4 stop sequences, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must be non-empty strings", param="stop")
    try:
        seed = engine_seed(req.seed)
    except ValueError as e:
        raise APIError(400, str(e), param="seed", code="invalid_value") from e
    return SamplingRequest(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops, seed=seed,
                           ignore_eos=bool(req.ignore_eos), logprobs=logprobs, **extensions)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined, other part types refused (400)."""
    if not req.messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                                   param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        for k in ("name", "tool_call_id", "reasoning_content"):
            v = getattr(m, k)
            if v is not None:
                msg[k] = v
        if m.tool_calls:
            msg["tool_calls"] = [_template_tool_call(tc, f"messages[{i}].tool_calls[{j}]")
                                 for j, tc in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _template_tool_call(tc: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant tool call as chat templates expect it: ``arguments`` as an object, not OpenAI's JSON string
    (templates ``tojson`` it; a string would be quoted twice). vLLM does the same. A call without a named function
    or with arguments that are not a JSON object is refused (400): the template could only render it wrongly."""
    fn = tc.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs a function object with a name", param=f"{where}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}",
                           param=f"{where}.function.arguments", code="invalid_value") from e
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must encode a JSON object",
                       param=f"{where}.function.arguments", code="invalid_value")
    return {**tc, "function": {**fn, "arguments": args}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A pydantic error list as one readable message and the first offending param."""
    parts, param = [], None
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        param = param or (loc.split(".")[0] if loc else None)
        parts.append(f"{loc or '<body>'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


__all__ = [
    "IGNORED_PARAMS", "APIError",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "SamplingRequest", "SpecUsage", "Usage",
    "ChatChoice", "ChatChunkChoice", "ChatCompletion", "ChatCompletionChunk", "Completion", "CompletionChoice",
    "ErrorDetail", "ErrorResponse", "ModelCard", "ModelList",
    "chat_chunk", "chat_messages", "chat_response", "check_sampling", "completion_chunk", "completion_response",
    "error_body", "models_response", "new_id", "validation_message",
]
