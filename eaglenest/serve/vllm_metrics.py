"""vLLM's speculative-decoding counters on the serving port (``GET /metrics``), summed over the app's replicas.

Why: outside benchmark tools (``vllm bench serve``, NVIDIA AIPerf, dashboards built for vLLM) read a server's
acceptance from ``{base_url}/metrics`` under vLLM's names, on the port they send requests to; eaglenest's own series
(``ray_eaglenest_serve_*``) are exported by Ray's metrics agent on another port, per replica. The names, types and
labels are vLLM's (``vllm/v1/spec_decode/metrics.py``): counters ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos{position="k"}`` (exposed with ``_total``), each with ``model_name``.
A draft is one target verify step of one request, so ``1 + accepted / drafts`` is the accept length that
``usage.spec`` reports per request.

Aggregation: every replica sends each finished request's counts to one small named Ray actor per application
(:class:`SpecCounterStore`, detached, zero CPUs, created by whichever replica comes first); whichever replica answers
``GET /metrics`` reads the sums from it. Counts survive a replica's restart, start again at zero when the actor does
(a Prometheus counter reset), and are counted when a request ends (a request cut off mid-stream is not counted).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from eaglenest.serve.jobs import SpecStats

log = logging.getLogger("eaglenest.serve")

NAMESPACE = "eaglenest"
ACTOR_PREFIX = "spec-counters:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAMILIES = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "accepted_tokens"),
)
PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.")


class Counts:
    """Sums of one model's spec-decode counts (the actor's state, and the in-process store without Ray)."""

    def __init__(self, positions: int = 0) -> None:
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.per_pos = [0] * positions
        self._lock = threading.Lock()

    def add(self, drafts: int, draft_tokens: int, accepted_tokens: int, per_pos: list[int]) -> None:
        with self._lock:
            self.drafts += drafts
            self.draft_tokens += draft_tokens
            self.accepted_tokens += accepted_tokens
            if len(per_pos) > len(self.per_pos):
                self.per_pos += [0] * (len(per_pos) - len(self.per_pos))
            for i, n in enumerate(per_pos):
                self.per_pos[i] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                    "accepted_tokens": self.accepted_tokens, "per_pos": list(self.per_pos)}


class SpecCounterStore:
    """The Ray actor that sums one application's counts over its replicas."""

    def __init__(self, positions: int) -> None:
        self.counts = Counts(positions)

    def add(self, drafts: int, draft_tokens: int, accepted_tokens: int, per_pos: list[int]) -> None:
        self.counts.add(drafts, draft_tokens, accepted_tokens, per_pos)

    def snapshot(self) -> dict[str, Any]:
        return self.counts.snapshot()


def render(model_name: str, snap: dict[str, Any] | None) -> bytes:
    """Prometheus text exposition of ``snap`` (None: a server that does not speculate, which vLLM leaves empty)."""
    registry = CollectorRegistry(auto_describe=False)

    class _Collector:
        def collect(self) -> Any:
            if snap is None:
                return
            for name, help_text, key in FAMILIES:
                fam = CounterMetricFamily(name, help_text, labels=["model_name"])
                fam.add_metric([model_name], float(snap[key]))
                yield fam
            fam = CounterMetricFamily(PER_POS[0], PER_POS[1], labels=["model_name", "position"])
            for pos, n in enumerate(snap["per_pos"]):
                fam.add_metric([model_name, str(pos)], float(n))
            yield fam

    registry.register(_Collector())
    return generate_latest(registry)


def request_counts(stats: SpecStats) -> tuple[int, int, int, list[int]]:
    """(drafts, draft tokens, accepted tokens, accepted per position) of one finished request."""
    return stats.verify_steps, stats.draft_tokens, stats.accepted_tokens, list(stats.accepted_per_pos)


class SpecCounters:
    """Replica side: record each finished request, read the sums for ``GET /metrics``.

    Without ``app`` (no Ray Serve: in-process tests) the counts stay in this process.
    """

    def __init__(self, model_name: str, *, speculative: bool, positions: int, app: str | None = None) -> None:
        self.model_name = model_name
        self.speculative = speculative
        self.positions = positions
        self.app = app
        self._local = Counts(positions)
        self._actor: Any = None

    def _store(self) -> Any:
        if self._actor is None:
            import ray

            cls = ray.remote(num_cpus=0)(SpecCounterStore)
            self._actor = cls.options(name=ACTOR_PREFIX + str(self.app), namespace=NAMESPACE, lifetime="detached",
                                      get_if_exists=True).remote(self.positions)
        return self._actor

    def record(self, stats: SpecStats) -> None:
        """Count one finished request (fire and forget: a scrape may see it a moment later)."""
        if not self.speculative or stats.verify_steps == 0:
            return
        counts = request_counts(stats)
        if self.app is None:
            self._local.add(*counts)
            return
        try:
            self._store().add.remote(*counts)
        except Exception:  # the metrics must never fail a request
            log.warning("could not record spec-decode counts", exc_info=True)

    async def snapshot(self) -> dict[str, Any] | None:
        if not self.speculative:
            return None
        if self.app is None:
            return self._local.snapshot()
        snap = await self._store().snapshot.remote()
        if len(snap["per_pos"]) < self.positions:
            snap["per_pos"] += [0] * (self.positions - len(snap["per_pos"]))
        return snap

    async def exposition(self) -> bytes:
        return render(self.model_name, await self.snapshot())


def drop_stores() -> None:
    """Kill every application's counter actor (``stop_serve``: the next deployment starts from zero)."""
    import ray
    from ray.util import list_named_actors

    for entry in list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and str(entry.get("name", "")).startswith(ACTOR_PREFIX):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE))
            except Exception:
                log.debug("counter actor %s already gone", entry["name"], exc_info=True)
