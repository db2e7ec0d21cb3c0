"""The OpenAI-compatible Ray Serve application: FastAPI ingress, limits, auth, self-test, metrics, streaming.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming), ``GET /v1/models``,
``GET /health``. Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
status that fits: 400 bad parameter, 401 API key, 404 unknown model/route, 413 prompt too long, 422 schema, 429 over
``serve.max_concurrent_requests`` (per replica), 503 unhealthy / shutting down. Besides OpenAI's sampling knobs,
``ignore_eos`` (the vLLM/SGLang extension) decodes exactly ``max_tokens`` tokens, for benchmarks.

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
from serve.backends import BackendBase, DecodeEvent, Job, SpecStats, make_backend
from serve.metrics import NullMetrics, RequestStats, ServeMetrics
from serve.openai_protocol import (
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
from serve.text import StreamText

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
        self.self_test: SelfTest | None = None
        self.unhealthy_reason: str | None = "starting"
        metrics_cls = ServeMetrics if use_ray_metrics else NullMetrics
        self.metrics: ServeMetrics = metrics_cls(self.model_name, baseline_tokens_per_s=s.baseline_tokens_per_s)
        self.metrics.set_healthy(False)
        self.metrics.start_refresh()
        self.preflight = None
        if drafter is not None:  # local targets are checked before anything loads, others from the loaded engine
            from serve.preflight import local_target_folder, preflight_for_config

            if local_target_folder(cfg) is not None:
                self.preflight = preflight_for_config(cfg, drafter).raise_for_failures()
        self.backend: BackendBase = make_backend(cfg, drafter)
        if drafter is not None and self.preflight is None:
            try:
                self.preflight = preflight_for_config(cfg, drafter, target_info=self.backend.info).raise_for_failures()
            except Exception:
                self.backend.close()
                raise
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
            raise APIError(503, self._unavailable_reason(),
                           code="shutting_down" if self.shutting_down else "unhealthy")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}` "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def check_prompt(self, prompt_ids: list[int], sampling: SamplingRequest) -> None:
        s = self.cfg.serve
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if n > s.max_prompt_tokens:
            raise APIError(413, f"the prompt has {n} tokens, more than this server's limit of {s.max_prompt_tokens} "
                                f"(serve.max_prompt_tokens); shorten it", param="messages", code="prompt_too_long")
        ctx = self.backend.info.max_position_embeddings
        if ctx and n + sampling.max_tokens > ctx:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceed the model's context "
                                f"of {ctx} tokens; lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")

    def acquire(self) -> None:
        limit = self.cfg.serve.max_concurrent_requests
        if self.inflight >= limit:
            raise APIError(429, f"too many concurrent requests: this replica runs at most {limit} "
                                f"(serve.max_concurrent_requests); retry shortly", code="too_many_requests")
        self.inflight += 1

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)

    # ---- generation
    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, out: Outcome, *,
                       stream: bool = True) -> AsyncIterator[str]:
        """Yield text pieces as they become final; ``out`` holds the finish reason, counts and stats at the end.

        The decoder thread only appends to a buffer and wakes the event loop when no wake-up is pending (for a
        non-streamed request: only at the end), so decoding does not ping-pong the GIL with the loop per token.
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

        sp = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            max_new_tokens=sampling.max_tokens, seed=sampling.seed, stop=sampling.stop,
                            ignore_eos=sampling.ignore_eos)
        job = Job(prompt_ids, sp, sink)
        text = StreamText(self.backend.decode, sampling.stop)
        try:
            self.backend.submit(job)
        except RuntimeError as e:
            raise APIError(503, str(e), code="unhealthy") from e
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
                    piece = text.feed(ids)
                    if piece:
                        yield piece
                if ev.error:
                    raise RuntimeError(f"generation failed: {ev.error}")
                if ev.final:
                    out.finish_reason = "stop" if text.stopped else str(ev.finish_reason)
                    out.stats = ev.stats or SpecStats()
                    break
            tail = text.finish()
            if tail:
                yield tail
            out.text = text.text
        finally:
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
            accepted_tokens=out.stats.accepted_tokens, speculative=self.backend.speculative))

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
        if req.stream:
            return StreamingResponse(self._chat_stream(req, rid, created, prompt_ids, sampling, arrived),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._complete(CHAT_ROUTE, prompt_ids, sampling, arrived,
                                    lambda out: chat_response(rid, self.model_name, out.text, out.finish_reason,
                                                              self.usage(len(prompt_ids), out), created))

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
        return await self._complete(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived,
                                    lambda out: completion_response(rid, self.model_name, out.text, out.finish_reason,
                                                                    self.usage(len(prompt_ids), out), created))

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
                        build: Any) -> Response:
        out = Outcome()
        status = 200
        try:
            async for _ in self.generate(prompt_ids, sampling, out, stream=False):
                pass
            return JSONResponse(build(out))
        except APIError as e:
            status = e.status
            return JSONResponse(e.body(), status_code=e.status)
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
                      piece_chunk: Any, final_chunks: Any) -> AsyncIterator[str]:
        out = Outcome()
        status = 200
        try:
            async for piece in self.generate(prompt_ids, sampling, out):
                yield _sse(piece_chunk(piece))
            for chunk in final_chunks(out):
                yield _sse(chunk)
            yield _sse("[DONE]")
        except asyncio.CancelledError:
            status = 499  # the client went away; the decoder is told to stop
            raise
        except Exception as e:
            log.exception("streaming generation failed")
            status = e.status if isinstance(e, APIError) else 500
            yield _sse(error_body(status, str(e), code="generation_failed"))
            yield _sse("[DONE]")
        finally:
            self.release()
            self.metrics.request(route, status)
            if status == 200:
                self.record(arrived, out)

    async def _chat_stream(self, req: ChatCompletionRequest, rid: str, created: int, prompt_ids: list[int],
                           sampling: SamplingRequest, arrived: float) -> AsyncIterator[str]:
        yield _sse(chat_chunk(rid, self.model_name, created, delta={"role": "assistant", "content": ""}))

        def finals(out: Outcome) -> list[dict[str, Any]]:
            chunks = [chat_chunk(rid, self.model_name, created, delta={}, finish_reason=out.finish_reason)]
            if req.include_usage:
                chunks.append(chat_chunk(rid, self.model_name, created, usage=self.usage(len(prompt_ids), out)))
            return chunks

        async for s in self._stream(CHAT_ROUTE, prompt_ids, sampling, arrived,
                                    lambda p: chat_chunk(rid, self.model_name, created, delta={"content": p}),
                                    finals):
            yield s

    async def _completion_stream(self, req: CompletionRequest, rid: str, created: int, prompt_ids: list[int],
                                 sampling: SamplingRequest, arrived: float) -> AsyncIterator[str]:
        def finals(out: Outcome) -> list[dict[str, Any]]:
            chunks = [completion_chunk(rid, self.model_name, created, text="", finish_reason=out.finish_reason)]
            if req.include_usage:
                chunks.append(completion_chunk(rid, self.model_name, created, usage=self.usage(len(prompt_ids), out)))
            return chunks

        async for s in self._stream(COMPLETIONS_ROUTE, prompt_ids, sampling, arrived,
                                    lambda p: completion_chunk(rid, self.model_name, created, text=p), finals):
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
        return JSONResponse(body, status_code=status)

    def error(self, route: str, e: APIError) -> Response:
        self.metrics.request(route, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    # ---- lifecycle
    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish (bounded), then stop the decoder."""
        self.shutting_down = True
        self.metrics.set_healthy(False)
        self.metrics.stop_refresh()
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
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
    "graceful_shutdown_timeout_s": 30.0,
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
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown(timeout=DEFAULT_DEPLOYMENT_OPTIONS["graceful_shutdown_timeout_s"])


# ------------------------------------------------------------------------------------------------- building
def deployment_options(cfg: EaglenestConfig) -> dict[str, Any]:
    """Replicas, autoscaling, resources and request limits from ``serve:``."""
    s = cfg.serve
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": s.num_cpus_per_replica, "num_gpus": s.num_gpus_per_replica},
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
        from serve.preflight import local_target_folder, preflight_for_config

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
