"""Many requests streamed at once from one ``sglang.Engine``, driven from a synchronous scheduler thread.

The serving scheduler steps its groups in a loop on one thread; SGLang's offline ``Engine`` runs its request
bookkeeping on an asyncio loop of its own (``Engine.loop``; its synchronous ``generate`` runs that loop until a
result is ready). :class:`SGLangStreams` does the same for many streams: ``poll`` runs the engine's loop until at
least one stream has new tokens (or a short timeout), so a request joins SGLang's running batch the moment it is
admitted and its tokens reach the client as they are decoded, instead of a whole batch returning at its end.

Used on the engine: ``Engine.loop``, ``Engine.async_generate(input_ids=, sampling_params=, stream=True, rid=)``
(awaiting it returns an async generator of cumulative chunks; a request that asks for logprobs adds
``return_logprob=, top_logprobs_num=, logprob_start_len=``) and ``Engine.tokenizer_manager.abort_request(rid)``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from eaglenest.engines.base import Generation, SamplingParams
from eaglenest.engines.sglang.args import (
    StreamedRequest,
    check_prompts,
    output_logprobs,
    per_request_sampling,
    request_kwargs,
)


@dataclass
class StreamUpdate:
    """What one stream produced since the last poll: new ids, and the Generation (or an error) once it ended."""

    key: Hashable
    token_ids: list[int]
    result: Generation | None = None
    error: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """per new token when the request asked for logprobs (see ``output_logprobs``)"""


@dataclass
class _Stream:
    rid: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    parser: StreamedRequest
    agen: Any = None
    extra: dict[str, Any] | None = None
    """more ``async_generate`` arguments (logprobs)"""


class SGLangStreams:
    """Streams keyed by the caller: ``start``, then ``poll`` repeatedly; ``abort`` drops one. One thread only."""

    def __init__(self, engine: Any, *, vocab_size: int | None, eos_token_ids: Sequence[int], decode: Any) -> None:
        self.engine = engine
        """a started ``sglang.Engine`` (or anything with its ``loop`` / ``async_generate`` / ``tokenizer_manager``)"""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.decode = decode
        self._streams: dict[Hashable, _Stream] = {}
        self._to_open: list[Hashable] = []
        self._tasks: dict[asyncio.Future, Hashable] = {}

    def start(self, key: Hashable, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queue a request; it reaches SGLang at the next ``poll``. A bad prompt raises ValueError here."""
        if key in self._streams:
            raise ValueError(f"stream {key!r} is already running")
        ids = check_prompts([prompt_ids], vocab_size=self.vocab_size)[0]
        sp = per_request_sampling(sampling, 1, stop_token_ids=self.eos_token_ids)[0]
        parser = StreamedRequest(prompt_len=len(ids), decode=self.decode, stop=sampling.stop)
        self._streams[key] = _Stream(rid=f"eaglenest-{uuid.uuid4().hex}", prompt_ids=ids, sampling=sp, parser=parser,
                                     extra=request_kwargs(sampling))
        self._to_open.append(key)

    def abort(self, key: Hashable) -> None:
        """Stop a stream (the client went away): SGLang frees its batch slot and KV cache."""
        stream = self._streams.pop(key, None)
        if stream is None:
            return
        if key in self._to_open:
            self._to_open.remove(key)
            return
        for task, k in list(self._tasks.items()):
            if k == key:
                task.cancel()
                del self._tasks[task]
        self.engine.loop.run_until_complete(self._abort(stream.rid))

    async def _abort(self, rid: str) -> None:
        """Inside the engine's loop: its ZMQ socket is asyncio-bound and needs a current loop to send on."""
        self.engine.tokenizer_manager.abort_request(rid)

    def poll(self, timeout_s: float = 0.05) -> list[StreamUpdate]:
        """Run the engine's loop until some stream has news or ``timeout_s`` passed; what every stream produced."""
        if not self._streams:
            return []
        return self.engine.loop.run_until_complete(self._poll(timeout_s))

    async def _poll(self, timeout_s: float) -> list[StreamUpdate]:
        updates: list[StreamUpdate] = []
        opening, self._to_open = self._to_open, []
        for key in opening:
            s = self._streams[key]
            try:
                s.agen = await self.engine.async_generate(input_ids=s.prompt_ids, sampling_params=s.sampling,
                                                          stream=True, rid=s.rid, **(s.extra or {}))
            except Exception as e:  # refused by the engine: this request fails, the others go on
                del self._streams[key]
                updates.append(StreamUpdate(key, [], error=f"{type(e).__name__}: {e}"))
                continue
            self._tasks[asyncio.ensure_future(s.agen.__anext__())] = key
        if not self._tasks:
            return updates
        done, _ = await asyncio.wait(list(self._tasks), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            key = self._tasks.pop(task)
            s = self._streams[key]
            try:
                chunk = task.result()
                new = s.parser.feed(chunk)
            except StopAsyncIteration:
                del self._streams[key]
                updates.append(StreamUpdate(key, [], error="sglang ended the stream without a finished chunk"))
                continue
            except Exception as e:
                del self._streams[key]
                updates.append(StreamUpdate(key, [], error=f"{type(e).__name__}: {e}"))
                continue
            lps = None
            if s.extra:
                lps = output_logprobs(chunk.get("meta_info") or {}, s.parser.sent - len(new), s.parser.sent)
            if s.parser.result is not None:
                del self._streams[key]
                updates.append(StreamUpdate(key, new, result=s.parser.result, logprobs=lps))
            else:
                self._tasks[asyncio.ensure_future(s.agen.__anext__())] = key
                if new:
                    updates.append(StreamUpdate(key, new, logprobs=lps))
        return updates
