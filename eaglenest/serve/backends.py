"""Serving backends: a decoder running on one worker thread per replica, fed by a small batching scheduler.

The HTTP layer never touches torch: it submits a :class:`~eaglenest.serve.jobs.Job` and receives
:class:`~eaglenest.serve.jobs.DecodeEvent` s through a callback (called from the worker thread). ``make_backend``
picks this in-process :class:`Backend` or :class:`~eaglenest.serve.process_backend.ProcessBackend` (the same
scheduler in a child process, ``serve.decoder_process``).

Jobs with equal sampling settings share one *group*, a running batch that new requests join at the next step
boundary (continuous batching, :mod:`serve.continuous`); the worker advances every group by one decoding step in
turn, keeping the rows of all groups within ``max_batch``. When idle it waits a few milliseconds after the last
arrival so that the requests of a burst are prefilled together.

Backends:

- ``hf`` (CPU default): the reference decoder of ``eaglenest.speculative`` on the transformers target, or its plain
  baseline decoder when no drafter is configured. Tokens stream as the decoder commits them.
- ``sglang`` (GPU): a thin adapter onto ``engines.sglang.engine.SGLangEngine`` (imported lazily). Every request
  streams from SGLang on its own (``eaglenest.engines.sglang.stream``): it joins SGLang's running batch when it is
  admitted and its tokens are passed on as SGLang decodes them; a cancelled request is aborted in SGLang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Protocol

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import SamplingParams, TargetEngine, TargetInfo
from eaglenest.serve.jobs import BackendBase, DecodeEvent, Job, SpecStats, accepted_per_position

log = logging.getLogger(__name__)


class Group(Protocol):
    """A running batch: ``add`` jobs at any time, ``step`` decodes one step (emitting chunks); empty when alive 0."""

    @property
    def alive(self) -> int: ...

    def add(self, job: Job) -> None: ...

    def step(self) -> None: ...

    def fail(self, message: str) -> None: ...


class Decoder(Protocol):
    """Also optional: ``warm()``, called once on the worker thread before scheduling (an engine that starts slowly
    starts with the replica, not inside its first request; an exception there marks the backend dead)."""

    max_batch: int
    speculative: bool
    algorithm: str | None

    def key(self, job: Job) -> Hashable:
        """Jobs with equal keys may share a group."""
        ...

    def new_group(self, sampling: SamplingParams) -> Group: ...


class Backend(BackendBase):
    """A target engine + a decoder + the worker thread that runs it, all in this process."""

    def __init__(self, engine: TargetEngine, decoder: Decoder, *, name: str, batch_window_s: float = 0.01,
                 max_wait_s: float = 0.05, after_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.decoder = decoder
        self.name = name
        self.after_step = after_step
        """called by the worker after every scheduler round (the decoder process sends a round's events at once)"""
        self.batch_window_s = batch_window_s
        """when idle, start once no request arrived for this long (the requests of a burst arrive ms apart)"""
        self.max_wait_s = max_wait_s
        """when idle, a burst that keeps arriving is gathered for at most this long"""
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.warmed = threading.Event()
        """set once the decoder's ``warm`` returned (at once without one), or failed (``fatal`` then says why)"""
        self._stopping = threading.Event()
        self.fatal: str | None = None

    # ---- facts
    @property
    def info(self) -> TargetInfo:
        return self.engine.info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def speculative(self) -> bool:
        return self.decoder.speculative

    @property
    def algorithm(self) -> str | None:
        return self.decoder.algorithm

    # ---- worker
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"eaglenest-{self.name}-decoder", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise RuntimeError("the backend is shutting down")
        if not self.alive:
            raise RuntimeError(f"the decoder thread is not running ({self.fatal or 'not started'})")
        self._queue.put(job)

    def _drain(self, pending: list[tuple[float, Job]], *, block: bool) -> None:
        """Move queued jobs to ``pending`` (with their arrival time); ``block`` waits up to 0.2 s for the first."""
        while True:
            try:
                job = self._queue.get(timeout=0.2) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stopping.set()
                return
            pending.append((time.perf_counter(), job))

    def _admit(self, pending: list[tuple[float, Job]], rows: int, idle: bool) -> list[Job]:
        """Jobs to add now (up to the free rows), or [] to keep them waiting."""
        for item in [p for p in pending if p[1].cancelled.is_set()]:
            pending.remove(item)
            item[1].emit(DecodeEvent([], error="cancelled before it started"))
        capacity = self.decoder.max_batch - rows
        if not pending or capacity <= 0:
            return []
        if idle and len(pending) < capacity:
            # debounce: a burst keeps extending the window while requests keep arriving, up to a bound
            now = time.perf_counter()
            if now - pending[-1][0] < self.batch_window_s and now - pending[0][0] < self.max_wait_s:
                return []
        take, pending[:] = pending[:capacity], pending[capacity:]
        return [j for _, j in take]

    def _loop(self) -> None:
        try:
            warm = getattr(self.decoder, "warm", None)
            if warm is not None:  # start the engine now, on this thread, not inside the first request
                warm()
            self.warmed.set()
            self._schedule()
        except BaseException as e:  # the scheduler itself broke: the replica must say so (check_health restarts it)
            log.exception("decoder thread died")
            self.fatal = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.warmed.set()

    def _schedule(self) -> None:
        groups: dict[Hashable, Group] = {}
        pending: list[tuple[float, Job]] = []
        while not self._stopping.is_set():
            self._drain(pending, block=not groups and not pending)
            new = self._admit(pending, sum(g.alive for g in groups.values()), idle=not groups)
            now = time.perf_counter()
            for job in new:
                job.started_at = now
                key = self.decoder.key(job)
                if key not in groups:
                    groups[key] = self.decoder.new_group(job.sampling)
                groups[key].add(job)
            if new:
                log.debug("admitted %d request(s) after %.1f ms; %d group(s), %d waiting", len(new),
                          1000 * (now - min(j.submitted_at for j in new)), len(groups), len(pending))
            elif not groups and pending:
                time.sleep(0.0005)  # idle, gathering a burst
            for key, g in list(groups.items()):  # one decoding step of every group, in turn
                try:
                    g.step()
                except Exception as e:  # one broken batch fails its requests, not the replica
                    log.exception("decoding step failed")
                    g.fail(f"{type(e).__name__}: {e}")
                    del groups[key]
                    continue
                if g.alive == 0:
                    del groups[key]
            if self.after_step is not None:
                self.after_step()
        for g in groups.values():
            g.fail("the server is shutting down")
        for _, j in pending:
            j.emit(DecodeEvent([], error="the server is shutting down"))
        if self.after_step is not None:
            self.after_step()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the running batch; queued jobs that never started get an error event."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(DecodeEvent([], error="the server is shutting down"))
        self.engine.close()


# ------------------------------------------------------------------------------------------------ hf decoder
class HFSpecDecoder:
    """The reference decoder (SpecDecoder with a drafter, BaselineDecoder without) on the hf target,
    with continuous batching (:class:`eaglenest.serve.continuous.ContinuousBatch`).

    A seeded sampled request decodes in a group of its own: its RNG is derived from its row in the prefill, and
    being alone keeps the answer independent of the traffic.
    """

    def __init__(self, dec: Any, *, speculative: bool, algorithm: str | None, max_batch: int,
                 draft_tokens_per_step: int) -> None:
        self.dec = dec
        self.speculative = speculative
        self.algorithm = algorithm
        self.max_batch = max_batch
        self.per_step = draft_tokens_per_step if speculative else 0

    def key(self, job: Job) -> Hashable:
        """Rows of different structured outputs share a group: each row carries its own constraint."""
        sampling = replace(job.sampling, constraint=None)
        if sampling.seed is not None and not sampling.greedy:
            return (sampling, id(job))
        return sampling

    def new_group(self, sampling: SamplingParams) -> Group:
        return _HFGroup(self, replace(sampling, constraint=None))


class _HFGroup:
    def __init__(self, decoder: HFSpecDecoder, sampling: SamplingParams) -> None:
        from eaglenest.serve.continuous import ContinuousBatch

        self.per_step = decoder.per_step
        self.dec = decoder.dec
        self.batch = ContinuousBatch(decoder.dec, sampling, self._chunk)
        self.jobs: dict[int, Job] = {}

    @property
    def alive(self) -> int:
        return self.batch.alive

    def add(self, job: Job) -> None:
        try:
            rid = self.batch.add(job.prompt_ids, job.sampling.constraint)
        except ValueError as e:  # a prompt or schema the decoder cannot take: this request fails, not the batch
            job.emit(DecodeEvent([], error=str(e)))
            return
        self.jobs[rid] = job

    def step(self) -> None:
        for rid, job in list(self.jobs.items()):
            if job.cancelled.is_set():  # the client went away: the row leaves the batch
                self.batch.cancel(rid)
                job.emit(DecodeEvent([], error="cancelled"))
                del self.jobs[rid]
        self.batch.step()
        for rid in [rid for rid, j in self.jobs.items() if j.finished]:
            del self.jobs[rid]

    def _chunk(self, rid: int, chunk: Any) -> None:
        stats = None
        if chunk.result is not None:
            r = chunk.result
            stats = SpecStats(verify_steps=r.draft_steps, draft_tokens=r.draft_tokens if self.per_step else 0,
                              accepted_tokens=sum(r.accepted_per_step),
                              accepted_per_pos=accepted_per_position(r.accepted_per_step))
        self.jobs[rid].emit(DecodeEvent(list(chunk.token_ids),
                                        finish_reason=chunk.finish_reason if chunk.finished else None, stats=stats,
                                        logprobs=chunk.logprobs, mode=self.dec.last_mode))

    def fail(self, message: str) -> None:
        for job in self.jobs.values():
            if not job.finished:
                job.emit(DecodeEvent([], error=message))


# --------------------------------------------------------------------------------------------- sglang adapter
class SGLangDecoder:
    """Every request streams from SGLang on its own (SGLang batches continuously inside and takes per-request
    sampling), so all jobs share one group; per-request spec counts come from the final ``meta_info``."""

    speculative = True

    def __init__(self, engine: TargetEngine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        launch = engine.launch
        self.algorithm = launch.algorithm if launch is not None else None
        self.speculative = launch is not None

    def key(self, job: Job) -> Hashable:
        return "sglang"

    def warm(self) -> None:
        """Start ``sglang.Engine`` (minutes for a large target) when the replica starts; a failure marks it dead."""
        _ = self.engine.engine

    def new_group(self, sampling: SamplingParams) -> Group:
        return _SGLangGroup(self.engine.streams())


class _SGLangGroup:
    """Admitted jobs join SGLang's running batch at the next step; each step passes on the tokens decoded since."""

    def __init__(self, streams: Any) -> None:
        self.streams = streams
        self.jobs: dict[int, Job] = {}

    @property
    def alive(self) -> int:
        return sum(not j.finished for j in self.jobs.values())

    def add(self, job: Job) -> None:
        try:
            self.streams.start(id(job), job.prompt_ids, job.sampling)
        except ValueError as e:  # a prompt the engine would refuse: this request fails, not the batch
            job.emit(DecodeEvent([], error=str(e)))
            return
        self.jobs[id(job)] = job

    def step(self) -> None:
        for key, job in list(self.jobs.items()):
            if job.cancelled.is_set() and not job.finished:  # the client went away: SGLang drops the request
                self.streams.abort(key)
                job.emit(DecodeEvent([], error="cancelled"))
        for up in self.streams.poll():
            job = self.jobs.get(up.key)
            if job is None:
                continue
            if up.error is not None:
                job.emit(DecodeEvent(up.token_ids, error=up.error))
            elif up.result is not None:
                job.emit(DecodeEvent(up.token_ids, finish_reason=up.result.finish_reason,
                                     stats=_sglang_stats(up.result), logprobs=up.logprobs))
            elif up.token_ids:
                job.emit(DecodeEvent(up.token_ids, logprobs=up.logprobs))
        for key in [k for k, j in self.jobs.items() if j.finished]:
            del self.jobs[key]

    def fail(self, message: str) -> None:
        for key, job in self.jobs.items():
            if not job.finished:
                self.streams.abort(key)
                job.emit(DecodeEvent([], error=message))


def _sglang_stats(gen: Any) -> SpecStats:
    """Speculative counts of one finished request from its ``meta_info`` (zeros without a drafter)."""
    meta = gen.meta or {}
    verify = int(meta.get("spec_verify_ct") or 0)
    accepted = meta.get("draft_tokens_accepted")
    return SpecStats(verify_steps=verify, draft_tokens=int(meta.get("draft_tokens_proposed") or 0),
                     accepted_tokens=int(accepted if accepted is not None else max(len(gen.token_ids) - verify, 0)))


# ------------------------------------------------------------------------------------------------- factory
def make_backend(cfg: EaglenestConfig, drafter: str | None, *, decoder_process: bool | None = None,
                 engines: dict[str, Any] | None = None) -> BackendBase:
    """The configured backend, started; ``drafter`` None serves the plain target (baseline decoding). A schedule
    routed by live load (``serve.route.by_load``) gets two engines (:mod:`eaglenest.serve.routed`): on this replica,
    or (``engines``: handles to the two engine deployments of ``placement: deployments``) through Ray Serve.

    ``decoder_process`` (default ``serve.decoder_process``) puts the hf decoder in a child process
    (:class:`eaglenest.serve.process_backend.ProcessBackend`); False keeps it on a thread of this process.
    """
    engine_kind = cfg.target.engine
    if drafter is not None and cfg.serve.schedule and cfg.serve.route.by_load:
        from eaglenest.serve.schedule import prepare_schedule

        sched = prepare_schedule(cfg, drafter, check=False)  # checked by the replica before any engine starts
        if sched is not None and sched.plan is not None and sched.plan.mode == "routed":
            from eaglenest.serve.routed import make_deployments_routed_backend, make_routed_backend

            if engines is not None:
                return make_deployments_routed_backend(cfg, sched.schedule, sched.plan, engines)
            return make_routed_backend(cfg, drafter, sched.plan)
    if engines is not None:
        raise ValueError("engine deployments were bound, but the schedule does not route by load here: "
                         "serve.route.placement: deployments needs serve.schedule, serve.route.by_load: true and a "
                         "drafter whose schedule speculates at low load")
    if decoder_process is None:
        decoder_process = cfg.serve.decoder_process
    if engine_kind == "hf" and decoder_process:
        from eaglenest.serve.process_backend import ProcessBackend

        return ProcessBackend(cfg, drafter)
    return make_local_backend(cfg, drafter)


def make_local_backend(cfg: EaglenestConfig, drafter: str | None, *,
                       after_step: Callable[[], None] | None = None) -> Backend:
    """The configured engine and decoder on a worker thread of this process, started."""
    engine_kind = cfg.target.engine
    if engine_kind == "hf":
        import torch

        from eaglenest.engines import load_engine

        torch.set_num_threads(cfg.target.cpu_threads or 1)
        engine = load_engine(cfg.target)
        decoder: Decoder = _hf_decoder(engine, drafter, cfg)
    elif engine_kind == "sglang":
        from eaglenest.engines.sglang.engine import SGLangEngine
        from eaglenest.serve.schedule import prepare_schedule

        sched = prepare_schedule(cfg, drafter, check=False)  # checked by the replica before any engine starts
        plan = sched.plan if sched is not None else None
        if plan is not None and plan.mode == "plain":
            engine = SGLangEngine.from_config(cfg.target)
        elif plan is not None:
            engine = SGLangEngine.speculative(cfg.target, drafter, plan.spec or cfg.serve.spec,
                                              adaptive=plan.adaptive, concurrency=cfg.serve.max_concurrent_requests)
        elif drafter is not None:
            engine = SGLangEngine.speculative(cfg.target, drafter, cfg.serve.spec,
                                              concurrency=cfg.serve.max_concurrent_requests)
        else:
            engine = SGLangEngine.from_config(cfg.target)
        decoder = SGLangDecoder(engine, max_batch=cfg.serve.max_concurrent_requests)
    else:
        raise ValueError(f"unknown target.engine {engine_kind!r}; allowed: hf, sglang")
    backend = Backend(engine, decoder, name=engine_kind, after_step=after_step)
    backend.start()
    return backend


def _hf_decoder(engine: Any, drafter: str | None, cfg: EaglenestConfig) -> Decoder:
    from eaglenest.speculative import BaselineDecoder, SpecDecoder

    spec = cfg.serve.spec
    if drafter is None:
        return HFSpecDecoder(BaselineDecoder.from_engine(engine), speculative=False, algorithm=None,
                             max_batch=cfg.serve.max_batch_size, draft_tokens_per_step=0)
    from eaglenest.drafters.eagle3.model import load_drafter
    from eaglenest.drafters.registry import EAGLE3

    model = load_drafter(drafter, device=engine.device, dtype=engine.dtype, target_embedding=engine.embed_weight())
    algorithm = spec.algorithm or EAGLE3.sglang_algorithm
    policy = None
    if cfg.serve.schedule:  # the live batch size picks each step's shape (speculation off included)
        from eaglenest.serve.schedule import prepare_schedule

        sched = prepare_schedule(cfg, drafter, check=False).schedule  # checked by the replica before loading
        spec, policy = spec.model_copy(update=sched.largest_spec().model_dump(exclude={"algorithm"})), sched.policy()
    dec = SpecDecoder.from_engine(engine, model, spec, policy=policy)
    return HFSpecDecoder(dec, speculative=True, algorithm=algorithm, max_batch=cfg.serve.max_batch_size,
                         draft_tokens_per_step=spec.num_draft_tokens - 1)
