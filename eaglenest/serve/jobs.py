"""What the HTTP layer and a decoding backend exchange: a :class:`Job` in, :class:`DecodeEvent` s out.

Both backends (:class:`eaglenest.serve.backends.Backend`, a worker thread in this process, and
:class:`eaglenest.serve.process_backend.ProcessBackend`, the decoder in a child process) implement
:class:`BackendBase`; the HTTP layer never touches torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaglenest.contracts.metrics import accept_length
from eaglenest.engines.base import Message, SamplingParams, TargetInfo, render_chat_ids

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Speculation counts of one request (target verify forwards after the prefill, draft tokens proposed/accepted).

    ``accept_length`` = mean over verify steps of (accepted + 1): tokens per target forward with the bonus token
    counted, SGLang's definition; 1.0 means no draft token was ever accepted (and is what plain decoding reports).
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    """verify steps that accepted the draft token at position k (vLLM's per-position counter); () when the engine
    does not report steps (SGLang)"""

    @property
    def accept_length(self) -> float:
        return accept_length(self.verify_steps, self.accepted_tokens)

    def __add__(self, other: SpecStats) -> SpecStats:
        a, b = self.accepted_per_pos, other.accepted_per_pos
        n = max(len(a), len(b))
        per_pos = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
        return SpecStats(self.verify_steps + other.verify_steps, self.draft_tokens + other.draft_tokens,
                         self.accepted_tokens + other.accepted_tokens, per_pos)


def accepted_per_position(accepted_per_step: list[int]) -> tuple[int, ...]:
    """Steps whose k-th draft token was accepted, for each k (a step accepting n counts at positions 0..n-1)."""
    depth = max(accepted_per_step, default=0)
    return tuple(sum(1 for n in accepted_per_step if n > k) for k in range(depth))


@dataclass
class DecodeEvent:
    """Newly committed tokens of one job; the last event of a job has ``finish_reason`` (or ``error``) set."""

    token_ids: list[int]
    finish_reason: str | None = None
    stats: SpecStats | None = None
    error: str | None = None
    at: float = field(default_factory=time.perf_counter)
    """when the decoder committed these tokens (perf_counter)"""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """per token of ``token_ids`` when the request asked for logprobs: (id, logprob, top alternatives)"""
    mode: tuple[int, int] | None = None
    """(batch size, num_steps) of the decoding step that produced the tokens (hf; 0 steps = speculation off)"""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Job:
    """One request inside the scheduler; ``emit`` is called from the worker thread."""

    prompt_ids: list[int]
    sampling: SamplingParams
    emit_fn: Callable[[DecodeEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished: bool = False
    tokens: int = 0
    on_cancel: Callable[[], None] | None = None
    """set by a backend that must pass the cancellation on (the decoder process)"""

    def cancel(self) -> None:
        """The client went away: the decoder drops the row at its next step."""
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    def emit(self, ev: DecodeEvent) -> None:
        if self.finished:
            return
        self.tokens += len(ev.token_ids)
        if ev.final:
            self.finished = True
        try:
            self.emit_fn(ev)
        except Exception:  # a consumer that went away must not break the batch
            log.debug("dropping an event for a consumer that is gone", exc_info=True)


class BackendBase:
    """What the HTTP layer uses: ``submit`` plus text helpers and blocking generation built on it."""

    name: str
    fatal: str | None

    @property
    def info(self) -> TargetInfo:
        raise NotImplementedError

    @property
    def tokenizer(self) -> Any:
        raise NotImplementedError

    @property
    def speculative(self) -> bool:
        raise NotImplementedError

    @property
    def algorithm(self) -> str | None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def submit(self, job: Job) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # ---- text
    def render_chat(self, messages: Sequence[Message], tools: Sequence[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The target's chat template, rendered exactly as every engine renders it (``template_kwargs``: a
        request's ``chat_template_kwargs``)."""
        return render_chat_ids(self.tokenizer, messages, tools=tools, add_generation_prompt=True,
                               template_kwargs=template_kwargs)

    def encode(self, text: str) -> list[int]:
        """A raw completion prompt, tokenized as the tokenizer does by default (BOS where the model adds one)."""
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- blocking use (self-test, benchmarks)
    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                 timeout: float | None = None) -> tuple[list[int], str, SpecStats]:
        """Blocking generation through the worker: (token ids, finish reason, stats)."""
        return self.generate_many([prompt_ids], sampling, timeout)[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                      timeout: float | None = None) -> list[tuple[list[int], str, SpecStats]]:
        """Submit every prompt at once (they decode together) and wait for all of them."""
        collected: list[list[DecodeEvent]] = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def sink(i: int) -> Callable[[DecodeEvent], None]:
            def put(ev: DecodeEvent) -> None:
                collected[i].append(ev)
                if ev.final:
                    done[i].set()
            return put

        for i, p in enumerate(prompts):
            self.submit(Job(list(p), sampling, sink(i)))
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for i, d in enumerate(done):
            if not d.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"generation did not finish within {timeout} s")
            last = collected[i][-1]
            if last.error:
                raise RuntimeError(last.error)
            ids = [t for ev in collected[i] for t in ev.token_ids]
            out.append((ids, str(last.finish_reason), last.stats or SpecStats(verify_steps=max(len(ids) - 1, 0))))
        return out


class RemoteEngineBackend(BackendBase):
    """A backend whose engine runs elsewhere (a child process, an engine deployment): the engine hands its facts
    over once, when it is ready, and the tokenizer loads here from the model folder it names."""

    def _take_facts(self, info: TargetInfo, speculative: bool, algorithm: str | None, model_path: str,
                    trust_remote_code: bool) -> None:
        from transformers import AutoTokenizer

        self._info, self._speculative, self._algorithm = info, speculative, algorithm
        self._tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)

    @property
    def info(self) -> TargetInfo:
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def speculative(self) -> bool:
        return self._speculative

    @property
    def algorithm(self) -> str | None:
        return self._algorithm
