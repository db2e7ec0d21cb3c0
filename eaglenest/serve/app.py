"""The OpenAI-compatible Ray Serve application: FastAPI ingress, limits, auth, self-test, metrics, streaming.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming), ``GET /v1/models``,
``GET /health``. Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
status that fits: 400 bad parameter (a prompt over the context: ``code: context_length_exceeded``, as OpenAI), 401
API key, 404 unknown model/route, 422 schema, 429 over ``serve.max_concurrent_requests`` (per replica), 503 unhealthy
/ shutting down; 429 and 503 carry ``Retry-After``. Besides OpenAI's sampling knobs, ``ignore_eos`` (the vLLM/SGLang
extension) decodes exactly ``max_tokens`` tokens, for benchmarks; ``top_k``, ``min_p``, ``repetition_penalty`` and
``logprobs`` are implemented, parameters that do not change decoding are ignored (serve.openai_protocol). Tool calls
and reasoning in the target's output come back as ``tool_calls`` / ``reasoning_content`` (serve.chat_parsing).
On SIGTERM / ``stop_serve`` the replica drains (serve.drain).

A replica starts by running the preflight checks (a failure stops the deployment, with the fix in the message), then
loads the backend, then decodes a few fixed prompts: below ``serve.self_test_min_accept_length`` it stays up but
reports unhealthy (``/health`` 503, ``eaglenest_serve_replica_healthy`` 0) and refuses requests with the reason.

``build_app({"config": path, "drafter": path})`` is the ``serve deploy`` entry point; ``start_serve`` /
``stop_serve`` (serve.cli) run it from Python.
"""

# no `from __future__ import annotations` here: Ray Serve's class-based FastAPI views read the route signatures at
# runtime, and string annotations would turn `request: Request` into a required query parameter.
import asyncio
import hmac
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglenest.config import EaglenestConfig, load_config
from eaglenest.engines.base import SamplingParams
from eaglenest.serve.backends import BackendBase, DecodeEvent, Job, SpecStats, make_backend
from eaglenest.serve.chat_parsing import ChatFormat, ChatParser, chat_message, delta_fields, finish_reason, parse_all
from eaglenest.serve.drain import RETRY_AFTER_BUSY_S, RETRY_AFTER_S, Drain, DrainWatcher
from eaglenest.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from eaglenest.serve.metrics import NullMetrics, RequestStats, ServeMetrics
from eaglenest.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    SpecUsage,
    Usage,
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
    validation_message,
)
from eaglenest.serve.text import StreamText

log = logging.getLogger("eaglenest.serve")

API_KEY_ENV = "EAGLENEST_API_KEY"
DEPLOYMENT_NAME = "eaglenest"
CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE, HEALTH_ROUTE = (
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health")

SELF_TEST_PROMPTS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hello! Who are you?"},),
    ({"role": "user", "content": "Write a short poem about the sea."},),
    ({"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 12 times 7? Explain briefly."}),
)
"""Fixed prompts decoded greedily at start; their pooled accept length must reach the configured minimum."""
SELF_TEST_MAX_TOKENS = 32


@dataclass
class SelfTest:
    ok: bool
    accept_length: float
    min_accept_length: float
    tokens: int
    seconds: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Outcome:
    """Everything one generation produced, filled while it streams."""

    text: str = ""
    finish_reason: str = "length"
    completion_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------------------------------- the core
class ServerCore:
    """Request handling independent of Ray Serve's plumbing: one per replica."""

    def __init__(self, cfg: EaglenestConfig, drafter: str | None = None, *, api_key: str | None = None,
                 use_ray_metrics: bool = True) -> None:
        s = cfg.serve
        self.cfg = cfg
        self.model_name = s.model_name
        self.api_key = api_key or s.api_key or os.environ.get(API_KEY_ENV) or None
        self.drafter = drafter
        self.created = now()
        self.inflight = 0
        self.shutting_down = False
        self.drain = Drain()
        self.self_test: SelfTest | None = None
        self.unhealthy_reason: str | None = "starting"
        metrics_cls = ServeMetrics if use_ray_metrics else NullMetrics
        self.metrics: ServeMetrics = metrics_cls(self.model_name, baseline_tokens_per_s=s.baseline_tokens_per_s)
        self.metrics.set_healthy(False)
        self.metrics.start_refresh()
        self.preflight = None
        if drafter is not None:  # local targets are checked before anything loads, others from the loaded engine
            from eaglenest.contracts.preflight import preflight_for_config
            from eaglenest.contracts.target import local_target_folder

            if local_target_folder(cfg) is not None:
                self.preflight = preflight_for_config(cfg, drafter).raise_for_failures()
        self.backend: BackendBase = make_backend(cfg, drafter)
        if drafter is not None and self.preflight is None:
            try:
                self.preflight = preflight_for_config(cfg, drafter, target_info=self.backend.info).raise_for_failures()
            except Exception:
                self.backend.close()
                raise
        self.chat_format = ChatFormat.from_tokenizer(self.backend.tokenizer, tool_call_markers=s.tool_call_markers,
                                                     reasoning_markers=s.reasoning_markers)
        self.token_text = TokenText(self.backend.tokenizer)
        self.run_self_test()

    # ---- health
    def run_self_test(self) -> SelfTest:
        """Decode the fixed prompts; pooled accept length below the minimum marks the replica unhealthy."""
        minimum = self.cfg.serve.self_test_min_accept_length
        t0 = time.perf_counter()
        tokens, pooled = 0, SpecStats()
        try:
            prompts = [self.backend.render_chat(list(conv)) for conv in SELF_TEST_PROMPTS]
            for out, _, stats in self.backend.generate_many(
                    prompts, SamplingParams(temperature=0.0, max_new_tokens=SELF_TEST_MAX_TOKENS), timeout=600):
                tokens += len(out)
                pooled = pooled + stats
        except Exception as e:  # the replica stays up and says why
            log.exception("self-test failed")
            result = SelfTest(False, 0.0, minimum, tokens, time.perf_counter() - t0,
                              f"self-test failed: {type(e).__name__}: {e}")
        else:
            acc = pooled.accept_length
            ok = acc >= minimum
            what = f"{'speculative ' + (self.backend.algorithm or '') if self.backend.speculative else 'baseline'}"
            msg = (f"self-test ({what}) accept length {acc:.2f} over {len(SELF_TEST_PROMPTS)} prompts / {tokens} "
                   f"tokens")
            if not ok:
                msg += (f" is below serve.self_test_min_accept_length {minimum}: the drafter is not helping (check "
                        f"`eaglenest preflight --target ... --drafter ...`, that the drafter was trained on this "
                        f"target, and the speculative algorithm EAGLE3)")
            result = SelfTest(ok, acc, minimum, tokens, time.perf_counter() - t0, msg)
        self.self_test = result
        self.unhealthy_reason = None if result.ok else result.message
        self.metrics.set_healthy(result.ok)
        log.info("%s", result.message)
        return result

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self.shutting_down and self.backend.alive

    def health_body(self) -> tuple[int, dict[str, Any]]:
        info = {
            "model": self.model_name, "target": self.backend.info.model, "engine": self.backend.name,
            "speculative": self.backend.speculative, "algorithm": self.backend.algorithm,
            "drafter": self.drafter, "inflight": self.inflight,
            "self_test": self.self_test.to_dict() if self.self_test else None,
        }
        if self.healthy:
            return 200, {"status": "ok", **info}
        reason = self._unavailable_reason()
        return 503, {**error_body(503, reason, code="unhealthy"), "status": "unhealthy", **info}

    def _unavailable_reason(self) -> str:
        if self.shutting_down:
            return "the server is shutting down"
        if not self.backend.alive:
            return f"the decoder is not running: {self.backend.fatal or 'stopped'}"
        return f"replica unhealthy: {self.unhealthy_reason}"

    # ---- request gates (each raises APIError with the right status)
    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    def check_ready(self) -> None:
        if not self.healthy:
            raise APIError(503, self._unavailable_reason(), code="shutting_down" if self.shutting_down else "unhealthy",
                           retry_after=RETRY_AFTER_S)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}` "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def check_prompt(self, prompt_ids: list[int], sampling: SamplingRequest) -> None:
        s = self.cfg.serve
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if n > s.max_prompt_tokens:  # 400 + context_length_exceeded: what clients' truncation fallbacks key on
            raise APIError(400, f"This model's maximum context length is {s.max_prompt_tokens} prompt tokens "
                                f"(serve.max_prompt_tokens). However, your messages resulted in {n} tokens. Please "
                                f"reduce the length of the messages.", param="messages",
                           code="context_length_exceeded")
        ctx = self.backend.info.max_position_embeddings
        if ctx and n + sampling.max_tokens > ctx:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceed the model's context "
                                f"of {ctx} tokens; lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")

    def acquire(self) -> None:
        limit = self.cfg.serve.max_concurrent_requests
        if self.inflight >= limit:
            raise APIError(429, f"too many concurrent requests: this replica runs at most {limit} "
                                f"(serve.max_concurrent_requests); retry shortly", code="too_many_requests",
                           retry_after=RETRY_AFTER_BUSY_S)
        self.inflight += 1

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)

    # ---- generation
    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, out: Outcome, *,
                       stream: bool = True, decode: Any = None) -> AsyncIterator[str]:
        """Yield text pieces as they become final; ``out`` holds the finish reason, counts and stats at the end.

        The decoder thread only appends to a buffer and wakes the event loop when no wake-up is pending (for a
        non-streamed request: only at the end), so decoding does not ping-pong the GIL with the loop per token.
        ``decode`` (default: the tokenizer's, special tokens skipped) turns the ids into text. When a drain's
        deadline passes the request is cancelled and ends with a 503 ``shutting_down`` error.
        """
        loop = asyncio.get_running_loop()
        buf: deque[DecodeEvent] = deque()
        wake = asyncio.Event()
        signalled = [False]

        def sink(ev: DecodeEvent) -> None:  # decoder thread
            buf.append(ev)
            if (stream or ev.final) and not signalled[0]:
                signalled[0] = True
                loop.call_soon_threadsafe(wake.set)

        expired = [False]

        def on_deadline() -> None:  # drain timer thread
            expired[0] = True
            loop.call_soon_threadsafe(wake.set)

        sp = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            max_new_tokens=sampling.max_tokens, seed=sampling.seed, stop=sampling.stop,
                            ignore_eos=sampling.ignore_eos, top_k=sampling.top_k, min_p=sampling.min_p,
                            repetition_penalty=sampling.repetition_penalty, logprobs=sampling.logprobs)
        job = Job(prompt_ids, sp, sink)
        text = StreamText(decode or self.backend.decode, sampling.stop)
        try:
            self.backend.submit(job)
        except RuntimeError as e:
            raise APIError(503, str(e), code="unhealthy", retry_after=RETRY_AFTER_S) from e
        self.drain.register(on_deadline)
        try:
            interval = self.cfg.serve.stream_interval_s
            sent_at = 0.0
            while True:
                await wake.wait()
                if out.first_token_at is not None and interval > 0 and not (buf and buf[-1].final):
                    # after the first token, coalesce: every chunk costs the replica, the proxy and the client
                    pause = sent_at + interval - time.perf_counter()
                    if pause > 0:
                        await asyncio.sleep(pause)
                wake.clear()
                signalled[0] = False  # cleared before draining: a later event signals again, none is lost
                batch = [buf.popleft() for _ in range(len(buf))]
                if not batch:
                    continue
                sent_at = time.perf_counter()
                ev = batch[-1]
                timed = [e.at for e in batch if e.token_ids]  # decoder-side times: coalescing does not skew metrics
                if timed:
                    out.first_token_at = out.first_token_at or timed[0]
                    out.last_token_at = timed[-1]
                    ids = [t for e in batch for t in e.token_ids]
                    out.completion_tokens += len(ids)
                    out.logprobs.extend(lp for e in batch for lp in (e.logprobs or ()))
                    piece = text.feed(ids)
                    if piece:
                        yield piece
                if ev.error:
                    raise RuntimeError(f"generation failed: {ev.error}")
                if ev.final:
                    out.finish_reason = "stop" if text.stopped else str(ev.finish_reason)
                    out.stats = ev.stats or SpecStats()
                    break
                if expired[0]:
                    raise APIError(503, f"the server is shutting down and this request did not finish within "
                                        f"serve.drain_timeout_s ({self.cfg.serve.drain_timeout_s:g} s); it was "
                                        f"cancelled after {out.completion_tokens} tokens", code="shutting_down",
                                   retry_after=RETRY_AFTER_S)
            tail = text.finish()
            if tail:
                yield tail
            out.text = text.text
        finally:
            self.drain.unregister(on_deadline)
            if not job.finished:
                job.cancel()

    def usage(self, prompt_tokens: int, out: Outcome) -> Usage:
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=out.completion_tokens,
                     total_tokens=prompt_tokens + out.completion_tokens,
                     spec=SpecUsage(accept_length=round(out.stats.accept_length, 4),
                                    draft_tokens=out.stats.draft_tokens, accepted_tokens=out.stats.accepted_tokens))

    def record(self, arrived: float, out: Outcome) -> None:
        ttft = None if out.first_token_at is None else out.first_token_at - arrived
        decode = 0.0 if out.first_token_at is None else (out.last_token_at or out.first_token_at) - out.first_token_at
        self.metrics.finished(RequestStats(
            completion_tokens=out.completion_tokens, ttft_s=ttft, decode_s=decode,
            accept_length=out.stats.accept_length, draft_tokens=out.stats.draft_tokens,
            accepted_tokens=out.stats.accepted_tokens, speculative=self.backend.speculative,
            verify_steps=out.stats.verify_steps))

    # ---- routes
    async def parse(self, request: Request, model: type) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise APIError(422, "the request body must be a JSON object", code="validation_error")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            msg, param = validation_message(e.errors())
            raise APIError(422, msg, param=param, code="validation_error") from e

    async def chat(self, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            self.check_auth(request)
            self.check_ready()
            req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
            self.check_model(req.model)
            sampling = check_sampling(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                      max_tokens_limit=self.cfg.serve.max_tokens_limit)
            if req.tools and req.tool_choice not in (None, "auto", "none"):
                raise APIError(400, "tool_choice other than auto/none is not supported", param="tool_choice")
            messages = chat_messages(req)
            try:
                prompt_ids = await asyncio.to_thread(self.backend.render_chat, messages, req.tools)
            except Exception as e:
                raise APIError(400, f"cannot render the conversation with the model's chat template: {e}",
                               param="messages") from e
            self.check_prompt(prompt_ids, sampling)
            self.acquire()
        except APIError as e:
            return self.error(CHAT_ROUTE, e)
        rid, created = new_id("chatcmpl"), now()
        parser = self._chat_parser(req, prompt_ids)
        decode = self._chat_decode(parser)
        if req.stream:
            return StreamingResponse(self._chat_stream(req, rid, created, prompt_ids, sampling, arrived, parser),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        def build(out: Outcome) -> dict[str, Any]:
            parsed = parse_all(parser, out.text) if parser is not None else None
            message = chat_message(parsed) if parsed is not None else {"content": out.text}
            lps = chat_logprobs(out.logprobs, self.token_text) if sampling.logprobs is not None else None
            return chat_response(rid, self.model_name, message, finish_reason(parsed, out.finish_reason),
                                 self.usage(len(prompt_ids), out), created, logprobs=lps)

        return await self._complete(CHAT_ROUTE, prompt_ids, sampling, arrived, build, decode=decode)

    def _chat_parser(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> ChatParser | None:
        """A parser when the target's template defines reasoning, or tool calls and the request offers tools."""
        fmt = self.chat_format
        tools = bool(req.tools) and req.tool_choice != "none" and fmt.tool_call is not None
        if fmt.reasoning is None and not tools:
            return None
        return fmt.parser(tools=tools, prompt_text=fmt.decode(prompt_ids[-16:], tools=tools))

    def _chat_decode(self, parser: ChatParser | None) -> Any:
        """The text decode of a parsed request: its markers kept (None: plain decoding)."""
        if parser is None:
            return None
        tools = parser.tool_call is not None
        return lambda ids: self.chat_format.decode(ids, tools=tools)

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            self.check_auth(request)
            self.check_ready()
            req: CompletionRequest = await self.parse(request, CompletionRequest)
            self.check_model(req.model)
            sampling = check_sampling(req, max_tokens=16 if req.max_tokens is None else req.max_tokens,
                                      max_tokens_limit=self.cfg.serve.max_tokens_limit)
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo")
            if req.best_of not in (None, 1):
                raise APIError(400, "best_of > 1 is not supported", param="best_of")
            if req.suffix:
                raise APIError(400, "suffix is not supported", param="suffix")
            prompt_ids = await self._completion_prompt(req.prompt)
            self.check_prompt(prompt_ids, sampling)
            self.acquire()
        except APIError as e:
            return self.error(COMPLETIONS_ROUTE, e)
        rid, created = new_id("cmpl"), now()
        if req.stream:
            return StreamingResponse(self._completion_stream(req, rid, created, prompt_ids, sampling, arrived),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        def build(out: Outcome) -> dict[str, Any]:
            lps = completion_logprobs(out.logprobs, self.token_text) if sampling.logprobs is not None else None
            return completion_response(rid, self.model_name, out.text, out.finish_reason,
                                       self.usage(len(prompt_ids), out), created, logprobs=lps)

        return await self._complete(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived, build)

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.backend.encode, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.backend.info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                               param="prompt")
            return list(prompt)
        raise APIError(400, "send exactly one prompt per request (a string or a list of token ids)", param="prompt")

    async def _complete(self, route: str, prompt_ids: list[int], sampling: SamplingRequest, arrived: float,
                        build: Any, decode: Any = None) -> Response:
        out = Outcome()
        status = 200
        try:
            async for _ in self.generate(prompt_ids, sampling, out, stream=False, decode=decode):
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
            self.release()
            self.metrics.request(route, status)
            if status == 200:
                self.record(arrived, out)

    async def _stream(self, route: str, prompt_ids: list[int], sampling: SamplingRequest, arrived: float,
                      piece_chunks: Any, final_chunks: Any, decode: Any = None) -> AsyncIterator[str]:
        """SSE of one generation: ``piece_chunks(piece, out)`` and ``final_chunks(out)`` give the chunks; a failure
        (or a drain's deadline) ends the stream with an error event, then ``[DONE]``."""
        out = Outcome()
        status = 200
        try:
            async for piece in self.generate(prompt_ids, sampling, out, decode=decode):
                for chunk in piece_chunks(piece, out):
                    yield _sse(chunk)
            for chunk in final_chunks(out):
                yield _sse(chunk)
            yield _sse("[DONE]")
        except asyncio.CancelledError:
            status = 499  # the client went away; the decoder is told to stop
            raise
        except Exception as e:
            if isinstance(e, APIError):
                status, code = e.status, e.code
            else:
                log.exception("streaming generation failed")
                status, code = 500, "generation_failed"
            yield _sse(error_body(status, str(e), code=code))
            yield _sse("[DONE]")
        finally:
            self.release()
            self.metrics.request(route, status)
            if status == 200:
                self.record(arrived, out)

    async def _chat_stream(self, req: ChatCompletionRequest, rid: str, created: int, prompt_ids: list[int],
                           sampling: SamplingRequest, arrived: float,
                           parser: ChatParser | None) -> AsyncIterator[str]:
        yield _sse(chat_chunk(rid, self.model_name, created, delta={"role": "assistant", "content": ""}))
        sent = [0]

        def new_logprobs(out: Outcome) -> dict[str, Any] | None:
            """Logprobs of the tokens not reported yet (they ride on the next chunk)."""
            if sampling.logprobs is None or sent[0] == len(out.logprobs):
                return None
            entries, sent[0] = out.logprobs[sent[0]:], len(out.logprobs)
            return chat_logprobs(entries, self.token_text)

        def chunks(deltas: list[Any], out: Outcome) -> list[dict[str, Any]]:
            fields = [delta_fields(d, parser.out) for d in deltas] if parser is not None else \
                [{"content": text} for _, text in deltas]
            return [chat_chunk(rid, self.model_name, created, delta=f, logprobs=new_logprobs(out)) for f in fields]

        def pieces(piece: str, out: Outcome) -> list[dict[str, Any]]:
            return chunks(parser.feed(piece) if parser is not None else [("content", piece)], out)

        def finals(out: Outcome) -> list[dict[str, Any]]:
            out_chunks = chunks(parser.finish(), out) if parser is not None else []
            reason = finish_reason(parser.out if parser is not None else None, out.finish_reason)
            out_chunks.append(chat_chunk(rid, self.model_name, created, delta={}, finish_reason=reason,
                                         logprobs=new_logprobs(out)))
            if req.include_usage:
                out_chunks.append(chat_chunk(rid, self.model_name, created, usage=self.usage(len(prompt_ids), out)))
            return out_chunks

        decode = self._chat_decode(parser)
        async for s in self._stream(CHAT_ROUTE, prompt_ids, sampling, arrived, pieces, finals, decode=decode):
            yield s

    async def _completion_stream(self, req: CompletionRequest, rid: str, created: int, prompt_ids: list[int],
                                 sampling: SamplingRequest, arrived: float) -> AsyncIterator[str]:
        sent, offset = [0], [0]

        def new_logprobs(out: Outcome) -> dict[str, Any] | None:
            if sampling.logprobs is None or sent[0] == len(out.logprobs):
                return None
            entries, sent[0] = out.logprobs[sent[0]:], len(out.logprobs)
            lps = completion_logprobs(entries, self.token_text, offset[0])
            offset[0] += sum(len(t) for t in lps["tokens"])
            return lps

        def pieces(piece: str, out: Outcome) -> list[dict[str, Any]]:
            return [completion_chunk(rid, self.model_name, created, text=piece, logprobs=new_logprobs(out))]

        def finals(out: Outcome) -> list[dict[str, Any]]:
            chunks = [completion_chunk(rid, self.model_name, created, text="", finish_reason=out.finish_reason,
                                       logprobs=new_logprobs(out))]
            if req.include_usage:
                chunks.append(completion_chunk(rid, self.model_name, created, usage=self.usage(len(prompt_ids), out)))
            return chunks

        async for s in self._stream(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived, pieces, finals):
            yield s

    def models(self, request: Request) -> Response:
        try:
            self.check_auth(request)
        except APIError as e:
            return self.error(MODELS_ROUTE, e)
        self.metrics.request(MODELS_ROUTE, 200)
        return JSONResponse(models_response(self.model_name, self.created))

    def health(self) -> Response:
        status, body = self.health_body()
        self.metrics.request(HEALTH_ROUTE, status)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    def error(self, route: str, e: APIError) -> Response:
        self.metrics.request(route, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    # ---- lifecycle
    def begin_drain(self, timeout: float | None = None) -> None:
        """Refuse new requests (503 + Retry-After); running ones may finish until ``serve.drain_timeout_s``, then
        they are cancelled, each ending with an error event (serve.drain). Safe from any thread."""
        self.shutting_down = True
        self.metrics.set_healthy(False)
        self.drain.begin(self.cfg.serve.drain_timeout_s if timeout is None else timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain (bounded by ``timeout``, default ``serve.drain_timeout_s``), then stop the decoder."""
        self.begin_drain(timeout)
        self.metrics.stop_refresh()
        until = (self.drain.deadline or time.monotonic()) + 2.0  # cancelled requests need a moment to end
        while self.inflight and time.monotonic() < until:
            time.sleep(0.05)
        self.drain.cancel()
        self.backend.close()


# ----------------------------------------------------------------------------------------------- FastAPI app
api = FastAPI(title="eaglenest", description="OpenAI-compatible API with EAGLE-3 speculative decoding")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown routes and wrong methods get OpenAI-style bodies too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = (f"no route {request.method} {request.url.path}; this server has POST {CHAT_ROUTE}, POST "
           f"{COMPLETIONS_ROUTE}, GET {MODELS_ROUTE}, GET {HEALTH_ROUTE}") if exc.status_code in (404, 405) \
        else str(exc.detail)
    _shared_metrics_request("other", exc.status_code)
    return JSONResponse(error_body(exc.status_code, msg, code=code), status_code=exc.status_code)


_CORE: ServerCore | None = None


def _shared_metrics_request(route: str, status: int) -> None:
    if _CORE is not None:
        _CORE.metrics.request(route, status)


DEFAULT_DEPLOYMENT_OPTIONS: dict[str, Any] = {
    "graceful_shutdown_timeout_s": 35.0,  # serve.drain_timeout_s + 5 (deployment_options follows the config)
    "graceful_shutdown_wait_loop_s": 1.0,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "max_constructor_retry_count": 2,
}


@serve.deployment(name=DEPLOYMENT_NAME, **DEFAULT_DEPLOYMENT_OPTIONS)
@serve.ingress(api)
class EaglenestDeployment:
    """One replica: a ServerCore behind the FastAPI routes."""

    def __init__(self, config: dict[str, Any], drafter: str | None = None, api_key: str | None = None) -> None:
        global _CORE
        logging.basicConfig(level=logging.INFO)
        cfg = EaglenestConfig.model_validate(config)
        self.core = ServerCore(cfg, drafter, api_key=api_key)
        _CORE = self.core
        ctx = serve.get_replica_context()
        rid = f"{ctx.app_name}#{ctx.replica_id.unique_id}"
        self.drain_watcher = DrainWatcher(rid, self.core.begin_drain, lambda: self.core.inflight,
                                          self.core.drain).start()

    @api.post(CHAT_ROUTE)
    async def chat_completions(self, request: Request) -> Response:
        return await self.core.chat(request)

    @api.post(COMPLETIONS_ROUTE)
    async def completions(self, request: Request) -> Response:
        return await self.core.completions(request)

    @api.get(MODELS_ROUTE)
    async def models(self, request: Request) -> Response:
        return self.core.models(request)

    @api.get(HEALTH_ROUTE)
    async def health(self) -> Response:
        return self.core.health()

    def check_health(self) -> None:
        """Ray Serve's probe: only a dead decoder restarts the replica (a failed self-test is reported, not looped)."""
        if not self.core.backend.alive and not self.core.shutting_down:
            raise RuntimeError(f"decoder thread is not running: {self.core.backend.fatal}")

    def __del__(self) -> None:
        """Serve's own shutdown (``serve shutdown``, a redeploy) ends here after waiting for running requests."""
        watcher = getattr(self, "drain_watcher", None)
        if watcher is not None:
            watcher.stop()
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()


# ------------------------------------------------------------------------------------------------- building
def deployment_options(cfg: EaglenestConfig) -> dict[str, Any]:
    """Replicas, autoscaling, resources and request limits from ``serve:``."""
    s = cfg.serve
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": s.num_cpus_per_replica, "num_gpus": s.num_gpus_per_replica},
        # Serve's own shutdown waits this long for running requests before it kills the replica
        "graceful_shutdown_timeout_s": s.drain_timeout_s + 5.0,
        # a little headroom over our own limit so excess requests reach the replica and get a clear 429
        "max_ongoing_requests": s.max_concurrent_requests + max(4, s.max_concurrent_requests // 8),
    }
    if s.autoscaling:  # Serve refuses num_replicas next to autoscaling_config
        opts["autoscaling_config"] = dict(s.autoscaling)
    else:
        opts["num_replicas"] = s.num_replicas
    return opts


def resolve_drafter(cfg: EaglenestConfig, drafter: str | None) -> str | None:
    """The drafter folder: the explicit argument, else ``serve.drafter`` (relative to the config file)."""
    path = drafter or cfg.resolve(cfg.serve.drafter)
    if path is None:
        return None
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise FileNotFoundError(f"drafter folder {p} does not exist; export one with `eaglenest export` or pass "
                                f"--drafter DIR")
    return str(p)


def make_app(cfg: EaglenestConfig, drafter: str | None = None, *, check: bool = True) -> Any:
    """The bound Serve application; the preflight runs here first when the target is a local folder."""
    drafter = resolve_drafter(cfg, drafter)
    if check and drafter is not None:
        from eaglenest.contracts.preflight import preflight_for_config
        from eaglenest.contracts.target import local_target_folder

        if local_target_folder(cfg) is not None:  # remote targets are checked by the replica once loaded
            preflight_for_config(cfg, drafter).raise_for_failures()
    api_key = cfg.serve.api_key or os.environ.get(API_KEY_ENV) or None
    return EaglenestDeployment.options(**deployment_options(cfg)).bind(cfg.model_dump(), drafter, api_key)


def build_app(args: dict[str, Any]) -> Any:
    """``serve deploy`` entry point: ``args = {"config": path, "drafter": path (optional)}``."""
    unknown = sorted(set(args) - {"config", "drafter"})
    if unknown:
        raise ValueError(f"unknown application args {unknown}; allowed: config, drafter")
    cfg = load_config(args.get("config"))
    return make_app(cfg, args.get("drafter"))
