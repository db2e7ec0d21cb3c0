"""The bench's view of routing by live load (``serve.route``, :mod:`eaglenest.serve.routed`).

At a steady load of ``b`` concurrent requests a routing replica runs them all on its speculative engine when
``b <= limit`` and all on its plain engine otherwise (a request joins the speculative engine only while the plain
one is idle). :class:`RoutedEngine` measures exactly that: a batch of at most ``limit`` prompts on the speculative
engine, a larger one on the plain engine, each started with the settings serve gives it. One of the two is up at a
time (the bench's engines run one after another), so what it leaves out is the brief overlap while load crosses the
limit, when both engines decode and share the GPU; the served ramp measures that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from eaglenest.engines.base import SamplingParams


class RoutedEngine:
    """``generate_ids`` as a routing replica runs a batch of that size; :meth:`ready_for` switches engines (and starts
    the one needed) before a batch size's timed rounds."""

    def __init__(self, make_speculative: Callable[[], Any], make_plain: Callable[[], Any], limit: int) -> None:
        self._make = {"speculative": make_speculative, "plain": make_plain}
        self.limit = limit
        self._side: str | None = None
        self._engine: Any = None

    def side_for(self, batch_size: int) -> str:
        return "speculative" if batch_size <= self.limit else "plain"

    def ready_for(self, batch_size: int) -> Any:
        """The engine a batch of ``batch_size`` runs on, started (the other one closed first: one at a time)."""
        side = self.side_for(batch_size)
        if side != self._side:
            self.close()
            self._engine = self._make[side]()
            self._side = side
        return self._engine

    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Any]:
        return self.ready_for(len(prompts)).generate_ids(prompts, sampling)

    def close(self) -> None:
        if self._engine is not None:
            engine, self._engine, self._side = self._engine, None, None
            engine.close()


def speculative_target(target: Any, serve: Any, limit: int) -> Any:
    """The target config the speculative engine starts with: SGLang's memory share for a second engine and a KV pool
    for ``limit`` requests of the largest size serve admits (``serve.route``)."""
    route = serve.route
    pool = route.speculative_max_total_tokens or limit * (serve.max_prompt_tokens + serve.max_tokens_limit)
    sg = target.sglang
    return target.model_copy(update={"sglang": sg.model_copy(update={
        "mem_fraction_static": route.speculative_mem_fraction_static,
        "extra_args": {**sg.extra_args, "max_total_tokens": max(pool, MIN_SPECULATIVE_POOL)}})})


MIN_SPECULATIVE_POOL = 8192
"""tokens: SGLang's default chunked-prefill size, so a long prompt prefills in the chunks it would elsewhere"""
