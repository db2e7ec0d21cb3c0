"""One replica's request-independent state and its bridge to the decoder, apart from HTTP routing and Ray Serve.

A :class:`ServerCore` runs the preflight checks (a failure stops the replica, with the fix in the message), loads the
backend, runs the self-test (:mod:`eaglenest.serve.selftest`), and then owns health, the request gates
(:mod:`eaglenest.serve.gates`), the drain (:mod:`eaglenest.serve.drain`) and the metrics; :meth:`ServerCore.generate`
turns a decoder's events into text pieces on the event loop. The HTTP handlers live in :mod:`eaglenest.serve.routes`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import SamplingParams
from eaglenest.serve.arrival import ARRIVAL_HEADER, Arrival, arrival, proxy_stamps
from eaglenest.serve.backends import make_backend
from eaglenest.serve.chat_parsing import ChatFormat
from eaglenest.serve.drain import RETRY_AFTER_S, Drain
from eaglenest.serve.gates import Admission, check_api_key, check_model, check_prompt, resolve_api_key
from eaglenest.serve.jobs import BackendBase, DecodeEvent, Job, SpecStats
from eaglenest.serve.live_stats import LiveStats
from eaglenest.serve.logprobs import TokenText
from eaglenest.serve.metrics import NullMetrics, RequestStats, ServeMetrics
from eaglenest.serve.openai_protocol import APIError, SamplingRequest, SpecUsage, Usage, error_body, now
from eaglenest.serve.schedule import log_schedule, prepare_schedule
from eaglenest.serve.selftest import SelfTest, run_self_test
from eaglenest.serve.structured import check_engine_constrains
from eaglenest.serve.text import StreamText
from eaglenest.serve.traffic_log import TrafficLog
from eaglenest.serve.vllm_metrics import SpecCounters

log = logging.getLogger("eaglenest.serve")


@dataclass
class Outcome:
    """Everything one generation produced, filled while it streams."""

    text: str = ""
    finish_reason: str = "length"
    completion_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    first_token_at: float | None = None
    """when the decoder committed the first token (perf_counter)"""
    first_sent_at: float | None = None
    """when the first token's chunk was handed to Ray Serve for the client (streams only)"""
    last_token_at: float | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """the generated ids (the traffic log's answer)"""


def model_created(*paths: str | None) -> int:
    """``created`` in /v1/models: the first local folder's modification time, so every replica (and every restart)
    reports the same value; the process's start only when nothing is local."""
    for p in paths:
        if p and os.path.exists(p):
            return int(os.stat(p).st_mtime)
    return now()


class ServerCore:
    """Request handling independent of Ray Serve's plumbing: one per replica."""

    def __init__(self, cfg: EaglenestConfig, drafter: str | None = None, *, api_key: str | None = None,
                 use_ray_metrics: bool = True, engines: dict[str, Any] | None = None) -> None:
        """``engines``: handles to the engine deployments (``serve.route.placement: deployments``)."""
        s = cfg.serve
        self.cfg = cfg
        self.model_name = s.model_name
        self.api_key = resolve_api_key(api_key, s.api_key)
        self.drafter = drafter
        self.created = model_created(drafter, cfg.target.model)
        self.admission = Admission(s.max_concurrent_requests)
        self.proxy_stamps = proxy_stamps()
        """Serve's proxies stamp each request's arrival (serve.arrival): TTFT and queue time start there"""
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
            from eaglenest.drafters.preflight import preflight_for_config
            from eaglenest.engines.location import local_target_folder

            folder = local_target_folder(cfg)
            if folder is not None:
                self.preflight = preflight_for_config(cfg, drafter, folder=folder).raise_for_failures()
        self.schedule = prepare_schedule(cfg, drafter)  # a stale one is refused before any engine starts
        if self.schedule is not None:
            log_schedule(self.schedule)
        self.backend: BackendBase = make_backend(cfg, drafter, engines=engines)
        if hasattr(self.backend, "on_route"):  # serve.route: count each engine's requests
            self.backend.on_route = self.metrics.routed
        if drafter is not None and self.preflight is None:
            try:
                self.preflight = preflight_for_config(cfg, drafter, folder=None,
                                                      target_info=self.backend.info).raise_for_failures()
            except Exception:
                self.backend.close()
                raise
        self.chat_format = ChatFormat.from_tokenizer(self.backend.tokenizer, tool_call_markers=s.tool_call_markers,
                                                     reasoning_markers=s.reasoning_markers)
        self.token_text = TokenText(self.backend.tokenizer)
        self.spec_counters = SpecCounters(self.model_name, speculative=self.backend.speculative,
                                          positions=cfg.serve.spec.num_steps if self.schedule is None
                                          else self.schedule.schedule.largest_spec().num_steps)
        self.live = None
        if self.schedule is not None:
            from eaglenest.serve.schedule_metrics import ScheduleMonitor

            self.live = ScheduleMonitor(self.model_name, self.schedule.schedule, applied=self.schedule.applied,
                                        inflight=lambda: self.inflight, from_events=self.schedule.plan is None,
                                        use_ray=use_ray_metrics)
        """vLLM's spec-decode counters (serve.vllm_metrics); the deployment points them at its app's store"""
        self.live_stats = LiveStats(drafter if self.backend.speculative else None)
        """per-drafter served accept length (serve.live_stats), for the flywheel's post-swap watch"""
        self.traffic_log: TrafficLog | None = None
        if s.traffic_log.path:
            try:
                self.traffic_log = TrafficLog(
                    s.traffic_log, model=self.model_name, drafter=drafter, use_ray_metrics=use_ray_metrics,
                    decode=lambda ids: self.backend.tokenizer.decode(ids, skip_special_tokens=False),
                    encode=lambda text: self.backend.tokenizer.encode(text, add_special_tokens=False))
            except OSError:
                self.backend.close()
                raise
        """sampled requests + answers as a regen source (serve.traffic_log); off unless serve.traffic_log.path"""
        self.run_self_test()

    # ---- health
    def run_self_test(self) -> SelfTest:
        """Decode the fixed prompts; pooled accept length below the minimum marks the replica unhealthy."""
        minimum, alone = self.cfg.serve.self_test_min_accept_length, False
        if self.schedule is not None:  # the drafter is tested where the schedule drafts: one request at a time
            alone = True
            if self.schedule.applied(self.schedule.schedule.bucket_for(1)).off:
                minimum = 1.0  # the schedule never drafts alone: there is no accept length to require
        result = run_self_test(self.backend, minimum, one_at_a_time=alone)
        self.self_test = result
        self.unhealthy_reason = None if result.ok else result.message
        self.metrics.set_healthy(result.ok)
        log.info("%s", result.message)
        return result

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self.shutting_down and self.backend.alive

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    def health_body(self) -> tuple[int, dict[str, Any]]:
        info = {
            "model": self.model_name, "target": self.backend.info.model, "engine": self.backend.name,
            "speculative": self.backend.speculative, "algorithm": self.backend.algorithm,
            "drafter": self.drafter, "inflight": self.inflight,
            "self_test": self.self_test.to_dict() if self.self_test else None,
            "traffic_log": self.traffic_log.stats() if self.traffic_log else None,
            "schedule": None if self.schedule is None else {**self.schedule.health(), "live": self.live.live()},
        }
        route_state = getattr(self.backend, "route_state", None)
        if route_state is not None:  # serve.route: what each engine runs now and has run
            info["route"] = route_state()
        if self.healthy:
            return 200, {"status": "ok", **info}
        reason = self.unavailable_reason()
        return 503, {**error_body(503, reason, code="unhealthy"), "status": "unhealthy", **info}

    def unavailable_reason(self) -> str:
        if self.shutting_down:
            return "the server is shutting down"
        if not self.backend.alive:
            return f"the decoder is not running: {self.backend.fatal or 'stopped'}"
        return f"replica unhealthy: {self.unhealthy_reason}"

    # ---- request gates (each raises APIError with the right status; see serve.gates)
    def check_auth(self, request: Request) -> None:
        check_api_key(request.headers.get("authorization", ""), self.api_key)

    def authorized(self, request: Request) -> bool:
        try:
            self.check_auth(request)
        except APIError:
            return False
        return True

    def arrival(self, request: Request) -> Arrival:
        """When ``request`` reached Ray Serve's HTTP proxy (its handler's start when the proxy does not stamp)."""
        return arrival(request.headers.get(ARRIVAL_HEADER), trusted=self.proxy_stamps)

    def check_ready(self) -> None:
        if not self.healthy:
            raise APIError(503, self.unavailable_reason(), code="shutting_down" if self.shutting_down else "unhealthy",
                           retry_after=RETRY_AFTER_S)

    def check_model(self, model: str) -> None:
        check_model(model, self.model_name)

    def check_prompt(self, prompt_ids: list[int], sampling: SamplingRequest, *, param: str = "messages") -> None:
        check_prompt(len(prompt_ids), sampling.max_tokens, max_prompt_tokens=self.cfg.serve.max_prompt_tokens,
                     context=self.backend.info.max_position_embeddings, param=param)

    def check_structured_output(self, *, lark: bool = False, param: str = "response_format") -> None:
        """A 400 with the fix where the engine cannot constrain an answer (SGLang launched without a grammar
        backend, which would otherwise answer free text; ``lark``: a grammar of tool calls)."""
        check_engine_constrains(self.cfg.target, lark=lark, param=param)

    def acquire(self) -> None:
        self.admission.acquire()

    def release(self) -> None:
        self.admission.release()

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
            if ev.mode is not None and self.live is not None:
                self.live.observe(ev.mode)
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
                            repetition_penalty=sampling.repetition_penalty, logprobs=sampling.logprobs,
                            constraint=sampling.constraint)
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
                    out.token_ids.extend(ids)
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

    def record(self, arrived: Arrival, out: Outcome, *, route: str = "", prompt_ids: list[int] | None = None,
               sampling: SamplingRequest | None = None) -> None:
        """TTFT runs from the proxy's arrival to the first token's chunk leaving the replica (a stream's client sees
        it then); a non-streamed request's, to the decoder's first token (nothing leaves earlier)."""
        first = out.first_sent_at or out.first_token_at
        ttft = None if first is None else first - arrived.at
        decode = 0.0 if out.first_token_at is None else (out.last_token_at or out.first_token_at) - out.first_token_at
        self.metrics.finished(RequestStats(
            completion_tokens=out.completion_tokens, ttft_s=ttft, queue_s=arrived.queue_s, decode_s=decode,
            accept_length=out.stats.accept_length, draft_tokens=out.stats.draft_tokens,
            accepted_tokens=out.stats.accepted_tokens, speculative=self.backend.speculative,
            verify_steps=out.stats.verify_steps))
        self.spec_counters.record(out.stats)
        self.live_stats.record(out.stats, out.completion_tokens)
        if self.traffic_log is not None and prompt_ids is not None and sampling is not None:
            self.traffic_log.offer(
                prompt_ids=prompt_ids, answer_ids=out.token_ids, route=route, finish_reason=out.finish_reason,
                sampling={"temperature": sampling.temperature, "top_p": sampling.top_p,
                          "max_tokens": sampling.max_tokens, "seed": sampling.seed},
                spec={"verify_steps": out.stats.verify_steps, "draft_tokens": out.stats.draft_tokens,
                      "accepted_tokens": out.stats.accepted_tokens, "accept_length": out.stats.accept_length},
                arrived_at=time.time() - (time.perf_counter() - arrived.at), ttft_s=ttft)
        if self.live is not None:
            self.live.finished(out.first_token_at, out.last_token_at, out.completion_tokens)

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
        if self.traffic_log is not None:
            self.traffic_log.close()
        if self.live is not None:
            self.live.stop()
        self.backend.close()
