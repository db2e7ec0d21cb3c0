"""The OpenAI-compatible HTTP handlers of one replica: :class:`Routes` over its :class:`~.core.ServerCore`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming, :mod:`eaglenest.serve.sse`),
``POST /v1/responses`` (OpenAI's Responses API on the chat pipeline, :mod:`eaglenest.serve.responses_api`),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (vLLM's spec-decode counters,
serve.vllm_metrics). Every error is an OpenAI-style JSON body ``{"error":
{"message", "type", "param", "code"}}`` with the status that fits: 400 bad parameter or type (a prompt over the
context: ``code: context_length_exceeded``, as OpenAI), 401 API key, 404 unknown model/route, 405 wrong method (with
``Allow``), 413 body over ``serve.max_request_bytes``, 415 not JSON (serve.request_body), 429 over
``serve.max_concurrent_requests`` (per replica), 503 unhealthy / shutting down; 429 and 503 carry ``Retry-After``
(:mod:`eaglenest.serve.gates`). Besides OpenAI's sampling knobs, ``ignore_eos`` (the vLLM/SGLang extension) decodes
exactly ``max_tokens`` tokens, for benchmarks; ``top_k``, ``min_p``, ``repetition_penalty`` and ``logprobs`` are
implemented, parameters that do not change decoding are ignored (serve.openai_protocol). Tool calls and reasoning in
the target's output come back as ``tool_calls`` / ``reasoning_content`` (serve.chat_parsing). Response bodies are the
pydantic models of :mod:`eaglenest.serve.openai_protocol`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from eaglenest.engines.base import OutputConstraint, reserved_template_kwargs
from eaglenest.serve.arrival import Arrival
from eaglenest.serve.chat_parsing import ChatParser, Parsed, chat_message, delta_fields, finish_reason, parse_all
from eaglenest.serve.core import Outcome, ServerCore
from eaglenest.serve.drain import RETRY_AFTER_S
from eaglenest.serve.logprobs import LogprobText, chat_logprobs, completion_logprobs
from eaglenest.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    chat_chunk,
    chat_messages,
    chat_response,
    check_sampling,
    completion_chunk,
    completion_response,
    error_body,
    models_response,
    new_id,
    now,
)
from eaglenest.serve.request_body import parse_body, read_body
from eaglenest.serve.responses_api import (
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    final_status,
    output_items,
    to_chat_request,
    usage_of,
)
from eaglenest.serve.responses_api import dumps as responses_event
from eaglenest.serve.sse import DONE, event_stream, sse
from eaglenest.serve.structured import marker_ids, output_constraint, requested_schema
from eaglenest.serve.tool_choice import forced_functions, tool_call_grammar
from eaglenest.serve.vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger("eaglenest.serve")

CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE, MODEL_ROUTE, HEALTH_ROUTE, METRICS_ROUTE = (
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health", "/metrics")
RESPONSES_ROUTE = "/v1/responses"


class Routes:
    """Parse, gate, generate and answer one HTTP request; the Ray Serve deployment delegates its routes here."""

    def __init__(self, core: ServerCore) -> None:
        self.core = core

    async def parse(self, request: Request, model: type) -> Any:
        """The body as ``model``: refused (415, 413, 400 naming the parameter) before anything is tokenised."""
        raw = await read_body(request, self.core.cfg.serve.max_request_bytes)
        return parse_body(raw, model)

    async def chat(self, request: Request) -> Response:
        arrived = self.core.arrival(request)
        try:
            self.core.check_auth(request)
            self.core.check_ready()
            req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
            self.core.check_model(req.model)
            sampling, prompt_ids = await self._chat_prompt(req)
            self.core.acquire()
        except APIError as e:
            return self.error(CHAT_ROUTE, e)
        rid, created = new_id("chatcmpl"), now()
        parser = self._chat_parser(req, prompt_ids)
        decode = self._chat_decode(parser)
        if req.stream:
            return event_stream(self._chat_stream(req, rid, created, prompt_ids, sampling, arrived, parser))

        def build(out: Outcome) -> dict[str, Any]:
            parsed = parse_all(parser, out.text) if parser is not None else None
            message = chat_message(parsed) if parsed is not None else {"content": out.text}
            lps = chat_logprobs(out.logprobs, LogprobText(self.core.token_text)) \
                if sampling.logprobs is not None else None
            return chat_response(rid, self.core.model_name, message, finish_reason(parsed, out.finish_reason),
                                 self.core.usage(len(prompt_ids), out), created, logprobs=lps)

        return await self._complete(CHAT_ROUTE, prompt_ids, sampling, arrived, build, decode=decode)

    async def _chat_prompt(self, req: ChatCompletionRequest, messages_param: str = "messages"
                           ) -> tuple[SamplingRequest, list[int]]:
        """The sampling settings and the rendered prompt of a chat request, every value checked (400 naming it)."""
        sampling = check_sampling(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                  max_tokens_limit=self.core.cfg.serve.max_tokens_limit)
        forced = forced_functions(req.tools, req.tool_choice)
        schema = requested_schema(req.response_format)
        calls_beside = schema is not None and forced is None and self._calls_parsed(req)
        if forced is not None or schema is not None:
            self.core.check_structured_output(lark=forced is not None or calls_beside,
                                              param="tool_choice" if forced is not None else "response_format")
        messages = chat_messages(req)
        reserved = reserved_template_kwargs(req.chat_template_kwargs)
        if reserved:
            raise APIError(400, f"chat_template_kwargs cannot set {reserved[0]!r}: the server sets it (send tools and "
                                f"messages as themselves)", param=f"chat_template_kwargs.{reserved[0]}")
        try:
            prompt_ids = await asyncio.to_thread(self.core.backend.render_chat, messages, req.tools,
                                                 req.chat_template_kwargs)
        except Exception as e:
            raise APIError(400, f"cannot render the conversation with the model's chat template: {e}",
                           param=messages_param) from e
        self.core.check_prompt(prompt_ids, sampling, param=messages_param)
        if forced is not None:  # the answer is calls only: no text is left for a response_format to shape
            lark = self._calls_grammar(req, forced, parallel=req.tool_choice == "required")
            constraint = self._constraint(req, prompt_ids, None, lark)
        elif calls_beside:  # tools offered with auto: a call, or the answer in the format
            names = [t["function"]["name"] for t in req.tools or ()]
            constraint = self._constraint(req, prompt_ids, None, self._calls_grammar(req, names, answer=schema))
        elif schema is not None:
            constraint = self._constraint(req, prompt_ids, schema, None)
        else:
            return sampling, prompt_ids
        return sampling.model_copy(update={"constraint": constraint}), prompt_ids

    def _calls_parsed(self, req: ChatCompletionRequest) -> bool:
        """The request offers tools whose calls the target's markers let the parser read."""
        return bool(req.tools) and req.tool_choice != "none" and self.core.chat_format.tool_call is not None

    def _calls_grammar(self, req: ChatCompletionRequest, names: list[str], *, parallel: bool = True,
                       answer: dict[str, Any] | None = None) -> str:
        """The grammar of calls of ``names`` in the target's own tool-call syntax (or JSON under ``answer``)."""
        markers = self.core.chat_format.tool_call
        if markers is None:
            raise APIError(400, "tool_choice cannot force a call: this target's chat template has no tool-call "
                                "markers (set serve.tool_call_markers); send tool_choice 'auto'", param="tool_choice")
        return tool_call_grammar(req.tools or [], names, markers=markers, answer=answer,
                                 vocab=self.core.chat_format.vocab,
                                 parallel=parallel and req.parallel_tool_calls is not False)

    def _constraint(self, req: ChatCompletionRequest, prompt_ids: list[int], schema: dict[str, Any] | None,
                    lark: str | None) -> OutputConstraint | None:
        """The answer's constraint; a reasoning block may open it where the request separates reasoning."""
        fmt = self.core.chat_format
        separate = self.core.cfg.serve.reasoning_parser if req.separate_reasoning is None else req.separate_reasoning
        think = marker_ids(fmt.vocab, fmt.reasoning) if separate else None
        opened = think is not None and fmt.starts_in_reasoning(fmt.decode(prompt_ids[-16:]))
        return output_constraint(schema, lark=lark, reasoning=think, in_reasoning=opened)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (serve.responses_api): the chat pipeline, answered as a response object or its
        typed events."""
        arrived = self.core.arrival(request)
        try:
            self.core.check_auth(request)
            self.core.check_ready()
            req: ResponsesRequest = await self.parse(request, ResponsesRequest)
            self.core.check_model(req.model)
            chat = to_chat_request(req)
            sampling, prompt_ids = await self._chat_prompt(chat, messages_param="input")
            self.core.acquire()
        except APIError as e:
            if e.param == "max_tokens" and e.code != "unrecognized_argument":  # the chat check's name for it
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
            elif e.param == "tool_choice.function.name":  # the Responses API names it at the top level
                e.param = "tool_choice.name"
            return self.error(RESPONSES_ROUTE, e)
        shell = ResponseShell(req, self.core.model_name, now())
        parser = self._chat_parser(chat, prompt_ids)
        if req.stream:
            return event_stream(self._responses_stream(shell, prompt_ids, sampling, arrived, parser))

        def build(out: Outcome) -> dict[str, Any]:
            parsed = parse_all(parser, out.text) if parser is not None else Parsed(content=out.text)
            usage = usage_of(self.core.usage(len(prompt_ids), out), self._reasoning_tokens(parsed.reasoning))
            reason = finish_reason(parsed, out.finish_reason)
            return shell.body(final_status(reason), output_items(parsed), usage)

        return await self._complete(RESPONSES_ROUTE, prompt_ids, sampling, arrived, build,
                                    decode=self._chat_decode(parser))

    def _reasoning_tokens(self, reasoning: str) -> int:
        """Responses' ``reasoning_tokens``: the reasoning text as the tokenizer counts it."""
        return len(self.core.backend.encode(reasoning)) if reasoning else 0

    async def _responses_stream(self, shell: ResponseShell, prompt_ids: list[int], sampling: SamplingRequest,
                                arrived: Arrival, parser: ChatParser | None) -> AsyncIterator[str]:
        events = ResponseEvents(shell)
        started = [events.start()]  # created and in_progress go out with the first token, as the role chunk does

        def opened(later: list[dict[str, Any]]) -> list[dict[str, Any]]:
            first, started[:] = started[:], []
            return [ev for group in first for ev in group] + later

        def pieces(piece: str, out: Outcome) -> list[dict[str, Any]]:
            return opened(events.feed(parser.feed(piece) if parser is not None else [("content", piece)]))

        def finals(out: Outcome) -> list[dict[str, Any]]:
            evs = opened(events.feed(parser.finish()) if parser is not None else [])
            parsed = parser.out if parser is not None else Parsed(content=out.text)
            usage = usage_of(self.core.usage(len(prompt_ids), out), self._reasoning_tokens(parsed.reasoning))
            return evs + events.finish(finish_reason(parsed, out.finish_reason), usage)

        def failed(status: int, message: str, code: str | None) -> list[dict[str, Any]]:
            return opened(events.failed(status, message, code))

        async for s in self._stream(RESPONSES_ROUTE, prompt_ids, sampling, arrived, pieces, finals,
                                    decode=self._chat_decode(parser), failed=failed, frame=responses_event):
            yield s

    def _chat_parser(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> ChatParser | None:
        """A parser when the target has tool-call markers (parsed into calls when the request offers tools, else
        only kept out of ``content``), or its reasoning is separated (``serve.reasoning_parser``, overridden by
        SGLang's ``separate_reasoning``) and it has markers for it."""
        fmt = self.core.chat_format
        tools = self._calls_parsed(req)
        wanted = self.core.cfg.serve.reasoning_parser if req.separate_reasoning is None else req.separate_reasoning
        reasoning = wanted and fmt.reasoning is not None
        if not reasoning and fmt.tool_call is None:
            return None
        return fmt.parser(tools=tools, reasoning=reasoning, prompt_text=fmt.decode(prompt_ids[-16:], tools=tools))

    def _chat_decode(self, parser: ChatParser | None) -> Any:
        """The text decode of a chat request: the markers its parser reads kept (tool-call markers whenever the
        target has them: the parser parses or drops them), reasoning markers too when reasoning is not separated
        (content is then the whole text, as a server without a reasoning parser returns it)."""
        fmt = self.core.chat_format
        if parser is None and fmt.reasoning is None:
            return None
        tools = parser is not None and parser.tool_call is not None
        return lambda ids: fmt.decode(ids, tools=tools)

    async def completions(self, request: Request) -> Response:
        arrived = self.core.arrival(request)
        try:
            self.core.check_auth(request)
            self.core.check_ready()
            req: CompletionRequest = await self.parse(request, CompletionRequest)
            self.core.check_model(req.model)
            sampling = check_sampling(req, max_tokens=16 if req.max_tokens is None else req.max_tokens,
                                      max_tokens_limit=self.core.cfg.serve.max_tokens_limit)
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo")
            if req.best_of not in (None, 1):
                raise APIError(400, "best_of > 1 is not supported", param="best_of")
            if req.suffix:
                raise APIError(400, "suffix is not supported", param="suffix")
            prompt_ids = await self._completion_prompt(req.prompt)
            self.core.check_prompt(prompt_ids, sampling, param="prompt")
            self.core.acquire()
        except APIError as e:
            return self.error(COMPLETIONS_ROUTE, e)
        rid, created = new_id("cmpl"), now()
        if req.stream:
            return event_stream(self._completion_stream(req, rid, created, prompt_ids, sampling, arrived))

        def build(out: Outcome) -> dict[str, Any]:
            lps = completion_logprobs(out.logprobs, LogprobText(self.core.token_text), len(out.text)) \
                if sampling.logprobs is not None else None
            return completion_response(rid, self.core.model_name, out.text, out.finish_reason,
                                       self.core.usage(len(prompt_ids), out), created, logprobs=lps)

        return await self._complete(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived, build)

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.core.backend.encode, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.core.backend.info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                               param="prompt")
            return list(prompt)
        raise APIError(400, "send exactly one prompt per request (a string or a list of token ids)", param="prompt")

    async def _complete(self, route: str, prompt_ids: list[int], sampling: SamplingRequest, arrived: Arrival,
                        build: Any, decode: Any = None) -> Response:
        out = Outcome()
        status = 200
        try:
            async for _ in self.core.generate(prompt_ids, sampling, out, stream=False, decode=decode):
                pass
            return JSONResponse(build(out))
        except APIError as e:
            status = e.status
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:
            log.exception("generation failed")
            status = 500
            return JSONResponse(error_body(500, str(e), code="generation_failed"), status_code=500)
        finally:
            self.core.release()
            self.core.metrics.request(route, status)
            if status == 200:
                self.core.record(arrived, out, route=route, prompt_ids=prompt_ids, sampling=sampling)

    async def _stream(self, route: str, prompt_ids: list[int], sampling: SamplingRequest, arrived: Arrival,
                      piece_chunks: Any, final_chunks: Any, decode: Any = None, failed: Any = None,
                      frame: Any = None) -> AsyncIterator[str]:
        """SSE of one generation: ``piece_chunks(piece, out)`` and ``final_chunks(out)`` give the chunks; a failure
        (or a drain's deadline) ends the stream with an error event, then ``[DONE]``. Responses' streams pass
        ``failed(status, message, code)`` for their error events and ``frame`` for their framing, and end
        without ``[DONE]``, as OpenAI's do."""
        out = Outcome()
        status = 200
        framed = frame or sse
        try:
            async for piece in self.core.generate(prompt_ids, sampling, out, decode=decode):
                out.first_sent_at = out.first_sent_at or time.perf_counter()  # TTFT ends here (core.record)
                for chunk in piece_chunks(piece, out):
                    yield framed(chunk)
            for chunk in final_chunks(out):
                yield framed(chunk)
            if frame is None:
                yield sse(DONE)
        except asyncio.CancelledError:
            status = 499  # the client went away; the decoder is told to stop
            raise
        except Exception as e:
            if isinstance(e, APIError):
                status, code = e.status, e.code
            else:
                log.exception("streaming generation failed")
                status, code = 500, "generation_failed"
            if failed is not None:
                for chunk in failed(status, str(e), code):
                    yield framed(chunk)
            else:
                yield sse(error_body(status, str(e), code=code))
                yield sse(DONE)
        finally:
            self.core.release()
            self.core.metrics.request(route, status)
            if status == 200:
                self.core.record(arrived, out, route=route, prompt_ids=prompt_ids, sampling=sampling)

    async def _chat_stream(self, req: ChatCompletionRequest, rid: str, created: int, prompt_ids: list[int],
                           sampling: SamplingRequest, arrived: Arrival,
                           parser: ChatParser | None) -> AsyncIterator[str]:
        # the role chunk goes out with the first token, as vLLM sends it: tools that time the first chunk (vLLM's
        # own benchmark does) then measure the time to the first token, not to the response headers
        opening = [chat_chunk(rid, self.core.model_name, created, delta={"role": "assistant", "content": ""})]
        sent, positions = [0], LogprobText(self.core.token_text)

        def opened(later: list[dict[str, Any]]) -> list[dict[str, Any]]:
            first, opening[:] = opening[:], []
            return first + later

        def new_logprobs(out: Outcome) -> dict[str, Any] | None:
            """Logprobs of the tokens not reported yet (they ride on the next chunk)."""
            if sampling.logprobs is None or sent[0] == len(out.logprobs):
                return None
            entries, sent[0] = out.logprobs[sent[0]:], len(out.logprobs)
            return chat_logprobs(entries, positions)

        def chunks(deltas: list[Any], out: Outcome) -> list[dict[str, Any]]:
            fields = [delta_fields(d, parser.out) for d in deltas] if parser is not None else \
                [{"content": text} for _, text in deltas]
            return [chat_chunk(rid, self.core.model_name, created, delta=f, logprobs=new_logprobs(out)) for f in fields]

        def pieces(piece: str, out: Outcome) -> list[dict[str, Any]]:
            return opened(chunks(parser.feed(piece) if parser is not None else [("content", piece)], out))

        def finals(out: Outcome) -> list[dict[str, Any]]:
            out_chunks = opened(chunks(parser.finish(), out) if parser is not None else [])
            reason = finish_reason(parser.out if parser is not None else None, out.finish_reason)
            out_chunks.append(chat_chunk(rid, self.core.model_name, created, delta={}, finish_reason=reason,
                                         logprobs=new_logprobs(out)))
            if req.include_usage:
                usage = self.core.usage(len(prompt_ids), out)
                out_chunks.append(chat_chunk(rid, self.core.model_name, created, usage=usage))
            return out_chunks

        decode = self._chat_decode(parser)
        async for s in self._stream(CHAT_ROUTE, prompt_ids, sampling, arrived, pieces, finals, decode=decode):
            yield s

    async def _completion_stream(self, req: CompletionRequest, rid: str, created: int, prompt_ids: list[int],
                                 sampling: SamplingRequest, arrived: Arrival) -> AsyncIterator[str]:
        sent, positions = [0], LogprobText(self.core.token_text)

        def new_logprobs(out: Outcome, final: bool = False) -> dict[str, Any] | None:
            if sampling.logprobs is None or sent[0] == len(out.logprobs):
                return None
            entries, sent[0] = out.logprobs[sent[0]:], len(out.logprobs)
            return completion_logprobs(entries, positions, len(out.text) if final else None)

        def pieces(piece: str, out: Outcome) -> list[dict[str, Any]]:
            return [completion_chunk(rid, self.core.model_name, created, text=piece, logprobs=new_logprobs(out))]

        def finals(out: Outcome) -> list[dict[str, Any]]:
            chunks = [completion_chunk(rid, self.core.model_name, created, text="", finish_reason=out.finish_reason,
                                       logprobs=new_logprobs(out, final=True))]
            if req.include_usage:
                usage = self.core.usage(len(prompt_ids), out)
                chunks.append(completion_chunk(rid, self.core.model_name, created, usage=usage))
            return chunks

        async for s in self._stream(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived, pieces, finals):
            yield s

    def models(self, request: Request) -> Response:
        try:
            self.core.check_auth(request)
        except APIError as e:
            return self.error(MODELS_ROUTE, e)
        self.core.metrics.request(MODELS_ROUTE, 200)
        return JSONResponse(models_response(self.core.model_name, self.core.created))

    def model(self, request: Request, model_id: str) -> Response:
        """``GET /v1/models/{id}``: the model card, or 404 ``model_not_found`` (OpenAI's retrieve)."""
        try:
            self.core.check_auth(request)
            self.core.check_model(model_id)
        except APIError as e:
            return self.error(MODEL_ROUTE, e)
        self.core.metrics.request(MODEL_ROUTE, 200)
        return JSONResponse(models_response(self.core.model_name, self.core.created)["data"][0])

    def health(self, request: Request) -> Response:
        """Probes need no key; with an API key set, only a caller that sends it sees more than the status (unless
        ``serve.health_details_public``)."""
        status, body = self.core.health_body()
        if not self.core.cfg.serve.health_details_public and not self.core.authorized(request):
            body = {"status": body["status"]}
        self.core.metrics.request(HEALTH_ROUTE, status)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def metrics(self) -> Response:
        """vLLM's spec-decode counters of this application, summed over its replicas (serve.vllm_metrics)."""
        try:
            body = await asyncio.wait_for(self.core.spec_counters.exposition(), timeout=10)
        except Exception as e:
            log.warning("spec-decode counters unavailable: %s", e)
            self.core.metrics.request(METRICS_ROUTE, 503)
            return JSONResponse(error_body(503, f"the spec-decode counters are unavailable: {type(e).__name__}",
                                           code="metrics_unavailable"), status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        self.core.metrics.request(METRICS_ROUTE, 200)
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    def error(self, route: str, e: APIError) -> Response:
        self.core.metrics.request(route, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
