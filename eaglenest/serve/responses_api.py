"""OpenAI's Responses API (``POST /v1/responses``) on the chat pipeline: the request becomes a chat request (same
checks, same chat template, same tool-call and reasoning parser), the output becomes ``output`` items, and a stream
becomes the API's typed events.

Why: OpenAI's newer clients and agent frameworks (the Agents SDK, Codex) speak Responses, not chat completions, and
vLLM and SGLang serve both. What this server keeps is the request's own conversation only: it stores no responses,
so ``previous_response_id`` / ``conversation`` are refused (400) with the fix, send the whole conversation as
``input`` items (messages, ``function_call`` and ``function_call_output`` items, ``reasoning`` items), and ``store``
is accepted but answered ``false``. Reasoning comes back as ``reasoning`` items whenever the target's chat template
has reasoning markers (the API has a place for it; chat completions keep it in ``content`` unless
``serve.reasoning_parser``). Function tools only (the chat template renders nothing else), text output
only; ``text.format`` (``json_schema``, ``json_object``) constrains the answer as chat's ``response_format`` does
(``serve.structured``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from eaglenest.serve.chat_parsing import Delta, Parsed, ToolCall
from eaglenest.serve.openai_protocol import APIError, ChatCompletionRequest, Usage, new_id, validation_message
from eaglenest.serve.sse import sse
from eaglenest.serve.structured import requested_schema

NOT_STORED = ("this server stores no responses; send the whole conversation as input items (messages, "
              "function_call and function_call_output items)")


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (type-checked only; value checks in :func:`to_chat_request`)."""

    model_config = ConfigDict(extra="allow")  # unknown arguments are refused by name

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    # the open-model extensions chat accepts (vLLM's and SGLang's names)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted and ignored: none of them changes the tokens decoded (of what ``include`` may ask for, only the
    # logprobs are refused, see to_chat_request)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None


class ResponseObject(BaseModel):
    """The answer of ``POST /v1/responses`` (and the ``response`` of its created / in_progress / completed /
    incomplete / failed events), as :class:`ResponseShell` fills it; output items are described in the module."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response: ``type`` names it (``response.output_text.delta``, ...), with its fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


# ------------------------------------------------------------------------------------------------------ request
def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that decodes what ``req`` asks for; what the server cannot honour is a 400 naming it."""
    unknown = sorted((req.model_extra or {}).keys())  # chat's own names too: `messages` or `n` here are unknown
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unrecognized_argument")
    for name, why in (("previous_response_id", NOT_STORED), ("conversation", NOT_STORED),
                      ("prompt", "reusable prompt templates are not supported; send instructions and input"),
                      ("max_tool_calls", "max_tool_calls is not supported; omit it")):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: {why}", param=name)
    if req.background:
        raise APIError(400, "background responses are not supported (nothing is stored to poll); send "
                            "background: false or stream: true", param="background")
    if req.truncation not in (None, "disabled"):
        raise APIError(400, "truncation 'auto' is not supported: an input over the context is refused with "
                            "context_length_exceeded; send truncation: 'disabled'", param="truncation")
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or ()):
        raise APIError(400, "logprobs are not supported on /v1/responses; use /v1/chat/completions with logprobs",
                       param="top_logprobs" if req.top_logprobs else "include")
    schema = requested_schema((req.text or {}).get("format"), param="text.format", flat=True)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream),
                            "max_completion_tokens": req.max_output_tokens, "separate_reasoning": True}
    if schema is not None:  # checked above under the Responses API's names
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") == "function" and "name" in req.tool_choice:
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}  # chat's shape
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                 "chat_template_kwargs", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e.errors(include_input=False, include_url=False))
        raise APIError(400, msg, param=param) from e


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools (``{"type": "function", "name", "parameters"}``) as chat's nested ones."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: this server renders "
                                f"function tools only", param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}] needs a name", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (``input_text`` / ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text parts are supported, got {kind!r}", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; ``function_call`` items join the assistant turn
    before them (a new one if there is none), ``function_call_output`` items become tool messages, a ``reasoning``
    item's text goes to the next assistant turn's ``reasoning_content``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must hold at least one item", param="input")
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param=f"{where}.role")
            msg: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported: send messages, function_call, "
                                f"function_call_output or reasoning items", param=f"{where}.type")
    return out


# ----------------------------------------------------------------------------------------------------- response
def usage_of(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    """Responses' usage names, with eaglenest's speculative counts (``spec``) as on the other routes."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens, "spec": usage.spec.model_dump()}


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(rid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": rid, "type": "message", "role": "assistant", "status": status, "content": content}


def text_item(kind: str, rid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """The item a stream's text of ``kind`` (the parser's ``content`` or ``reasoning``) becomes."""
    return message_item(rid, text, status) if kind == "content" else reasoning_item(rid, text or "", status)


def text_part(kind: str, text: str) -> dict[str, Any]:
    """The content part of an item of ``kind``, as its content_part events carry it."""
    if kind == "content":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def call_item(rid: str, call: ToolCall, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def output_items(parsed: Parsed) -> list[dict[str, Any]]:
    """The output of one generation: its reasoning, its text (left out only when the model called tools and said
    nothing), its function calls."""
    items = [reasoning_item(new_id("rs"), parsed.reasoning)] if parsed.reasoning else []
    if parsed.content or not parsed.tool_calls:
        items.append(message_item(new_id("msg"), parsed.content))
    return items + [call_item(new_id("fc"), c) for c in parsed.tool_calls]


class ResponseShell:
    """The response object's fields that echo the request; :meth:`body` fills status, output and usage."""

    def __init__(self, req: ResponsesRequest, model: str, created: int) -> None:
        self.fields = {
            "id": new_id("resp"), "object": "response", "created_at": created, "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "store": False,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}}, "truncation": "disabled",
            "metadata": req.metadata or {},
            "previous_response_id": None, "reasoning": req.reasoning, "error": None, "incomplete_details": None}

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """``status``: in_progress, completed, incomplete (cut at max_output_tokens: :func:`final_status`) or
        failed."""
        out = {**self.fields, "status": status, "output": output, "usage": usage}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            out["error"] = error
        return out


def final_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseEvents:
    """A stream's typed events from the chat parser's deltas: each output item opens (``output_item.added``), gets
    its deltas, and closes (``*.done``, ``output_item.done``) before the next; every event carries its
    ``sequence_number``. Text is a message item, reasoning a reasoning item, a tool call (the parser gives it
    whole) a function_call item with its arguments in one delta."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in order
        self.open: dict[str, Any] | None = None  # {"item", "kind", "text"}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        body = self.shell.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        o, self.open = self.open, None
        index, rid, text, kind = len(self.items), o["item"]["id"], o["text"], o["kind"]
        where = {"item_id": rid, "output_index": index}
        item = text_item(kind, rid, text)
        done = (self._event("response.output_text.done", content_index=0, text=text, logprobs=[], **where)
                if kind == "content" else
                self._event("response.reasoning_text.done", content_index=0, text=text, **where))
        self.items.append(item)
        return [done, self._event("response.content_part.done", content_index=0, part=text_part(kind, text), **where),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        index = len(self.items)
        item = text_item(kind, new_id("msg" if kind == "content" else "rs"), None, "in_progress")
        self.open = {"item": item, "kind": kind, "text": ""}
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=text_part(kind, ""))]

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        evs: list[dict[str, Any]] = []
        for kind, value in deltas:
            if kind == "tool_call":
                evs += self._close() + self._call(value)
                continue
            if self.open is None or self.open["kind"] != kind:
                evs += self._close() + self._open(kind)
            assert self.open is not None
            self.open["text"] += value
            name = "response.output_text.delta" if kind == "content" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "content" else {}
            evs.append(self._event(name, item_id=self.open["item"]["id"], output_index=len(self.items),
                                   content_index=0, delta=value, **extra))
        return evs

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        index, rid = len(self.items), new_id("fc")
        item = call_item(rid, call)
        self.items.append(item)
        where = {"item_id": rid, "output_index": index}
        return [self._event("response.output_item.added", output_index=index,
                            item=call_item(rid, call, arguments="", status="in_progress")),
                self._event("response.function_call_arguments.delta", delta=call.arguments, **where),
                self._event("response.function_call_arguments.done", arguments=call.arguments, name=call.name,
                            **where),
                self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item; ``response.completed`` (or ``response.incomplete``, cut at max_output_tokens)."""
        evs = self._close()
        if not self.items:  # nothing was said: one empty message, as the non-streamed answer has
            evs += self._open("content") + self._close()
        status = final_status(finish_reason)
        body = self.shell.body(status, self.items, usage)
        return evs + [self._event(f"response.{status}", response=body)]

    def failed(self, status: int, message: str, code: str | None) -> list[dict[str, Any]]:
        """A generation that failed mid-stream (or a drain's deadline): ``error`` with this server's code, then
        ``response.failed`` with what was said so far (an open item as ``incomplete``) and ``server_error``, the
        API's code for a failure on the server's side (its codes are a closed list)."""
        output = list(self.items)
        if self.open is not None:
            output.append(text_item(self.open["kind"], self.open["item"]["id"], self.open["text"], "incomplete"))
        error = {"code": "server_error", "message": message}
        return [self._event("error", code=code or ("server_error" if status >= 500 else "invalid_request"),
                            message=message, param=None),
                self._event("response.failed", response=self.shell.body("failed", output, error=error))]


def dumps(event: dict[str, Any]) -> str:
    """One event as OpenAI frames Responses events: ``event: <type>`` before its data."""
    return f"event: {event['type']}\n" + sse(event)
