"""Where the next request goes when a speculative and a plain engine both serve (``serve.route``): the two rules.

- **One GPU group** (``placement: replica``, two engines on the replica's GPUs): the speculative engine while it runs
  fewer than ``limit`` requests *and the plain engine is idle*, else the plain one. Two engines decoding at once
  time-slice the GPU, so the load is never split (:mod:`eaglenest.serve.routed`).
- **Separate GPUs** (``placement: deployments``, a speculative and a plain deployment, each with GPUs of its own; the
  only way for a target that fills its tensor-parallel group, such as Kimi-K2.5): both engines decode at once without
  slowing each other, so the question is which one gains more from one more request. The tuned schedule measured
  tokens/s against the batch size for the plain engine (``baseline_tok_per_s``) and for the speculative shape; each
  request goes where the measured curve rises more (the marginal throughput), the speculative side only while it runs
  fewer than ``limit`` (its safe range). For curves that flatten as the batch grows (every engine's) joining the
  larger gain one arrival at a time gives the split of the live load with the most total tokens/s the curves allow.

Several routing ingress replicas (``serve.num_replicas``): each counts only the requests it routed itself, and Ray
Serve's proxies spread requests over the ingress replicas by their queue lengths, so each sees about one
``routers``-th of the load. Each therefore routes over its share of the engines (both curves pooled over
``replicas / routers``) and of the speculative range (``limit // routers``, at least one: the speculative side never
runs more than its safe range in all, :func:`ingress_share`).

At low load the speculative curve rises faster (1.96x at batch 1 on the Llama stand-in), so it takes the requests;
as its gain per request falls below the plain engine's, requests spill to the plain deployment. Against the
reference (the same GPUs all plain, load shared evenly), by the curves, this split is never slower while the load
is at most twice the speculative range and the drafter's curve is at least the baseline's there; above it the plain
side carries more than half the load, and the start-up log and /health say what the curves predict
(:func:`predicted_ratios`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

SPECULATIVE, PLAIN = "speculative", "plain"


@dataclass(frozen=True)
class Curve:
    """Tokens/s of an engine against its running requests, from measured ``(batch, tok/s)`` points: linear between
    them, through ``(0, 0)``, and flat beyond the last one (no gain is assumed where nothing was measured)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a throughput curve needs at least one measured point")
        if any(b <= 0 or t < 0 for b, t in self.points) or list(self.points) != sorted(self.points):
            raise ValueError(f"curve points must be (batch > 0, tok/s >= 0) in ascending batch: {self.points}")

    def __call__(self, n: float) -> float:
        if n <= 0:
            return 0.0
        xs = [0, *(b for b, _ in self.points)]
        ys = [0.0, *(t for _, t in self.points)]
        if n >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def pooled(self, copies: float) -> Curve:
        """``copies`` replicas sharing a load evenly: ``copies x T(n / copies)`` at each of their points. A fraction
        is one router's share of the replicas when several routers split the load evenly (1 / routers)."""
        return Curve(tuple((b * copies, t * copies) for b, t in self.points)) if copies != 1 else self


class SharedGpuPolicy:
    """Two engines on the same GPUs: never split the load (module docstring)."""

    placement = "replica"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def choose(self, speculative: int, plain: int) -> str:
        return SPECULATIVE if plain == 0 and speculative < self.limit else PLAIN


class MarginalPolicy:
    """Two deployments on separate GPUs: the side whose measured curve gains more from one more request; the
    speculative side only below ``limit``, ties to it (module docstring)."""

    placement = "deployments"

    def __init__(self, speculative: Curve, plain: Curve, limit: int) -> None:
        self.speculative_curve, self.plain_curve, self.limit = speculative, plain, limit

    def choose(self, speculative: int, plain: int) -> str:
        if speculative >= self.limit:
            return PLAIN
        gain_spec = self.speculative_curve(speculative + 1) - self.speculative_curve(speculative)
        gain_plain = self.plain_curve(plain + 1) - self.plain_curve(plain)
        return SPECULATIVE if gain_spec >= gain_plain else PLAIN

    def split(self, load: int) -> tuple[int, int]:
        """How ``load`` requests arriving one by one (none finishing) end up: (speculative, plain)."""
        s = p = 0
        for _ in range(load):
            if self.choose(s, p) == SPECULATIVE:
                s += 1
            else:
                p += 1
        return s, p


def predicted_ratios(policy: MarginalPolicy, baseline: Curve, copies: int, loads: Sequence[int],
                     routers: int = 1) -> dict[int, float]:
    """Per load: the routed deployments' tokens/s as the curves predict them, over the same ``copies`` of the target
    all plain with the load shared evenly (the "no speculation" reference). ``routers`` ingress replicas each route
    their even share of the load by ``policy`` (its curves are one router's share of the engines)."""
    spec_all = policy.speculative_curve.pooled(routers)
    plain_all = policy.plain_curve.pooled(routers)
    out = {}
    for n in loads:
        s = p = 0
        for i in range(routers):
            a, b = policy.split(n // routers + (1 if i < n % routers else 0))
            s, p = s + a, p + b
        ref = copies * baseline(n / copies)
        out[n] = (spec_all(s) + plain_all(p)) / ref if ref > 0 else 1.0
    return out


def schedule_curves(buckets: Sequence[object], label: str) -> tuple[Curve, Curve] | None:
    """(speculative, plain) curves from a tuned schedule's buckets: the plain engine's measured tok/s at each
    measured bucket's top, and option ``label``'s; None when either has no measured point."""
    spec: list[tuple[int, float]] = []
    plain: list[tuple[int, float]] = []
    for b in buckets:
        top = getattr(b, "max_batch", None)
        if top is None:
            continue
        if getattr(b, "baseline_tok_per_s", None):
            plain.append((int(top), float(b.baseline_tok_per_s)))  # type: ignore[attr-defined]
        option = next((o for o in getattr(b, "options", []) if o.label == label and o.tok_per_s > 0), None)
        if option is not None:
            spec.append((int(top), float(option.tok_per_s)))
    if not spec or not plain:
        return None
    return Curve(tuple(spec)), Curve(tuple(plain))


class OverflowPolicy:
    """Two deployments on separate GPUs when the schedule has no curves to compare: the speculative side up to
    ``limit``, the plain side beyond it."""

    placement = "deployments"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def choose(self, speculative: int, plain: int) -> str:
        return SPECULATIVE if speculative < self.limit else PLAIN


def ingress_share(limit: int, routers: int) -> int:
    """The speculative requests one of ``routers`` ingress replicas may run: ``limit // routers``, so that all of
    them together never pass the safe range; refused (naming the fix) where that leaves a router none."""
    if routers < 1:
        raise ValueError(f"routers must be at least 1, got {routers}")
    share = limit // routers
    if share < 1:
        raise ValueError(f"{routers} routing ingress replicas cannot share a speculative range of {limit} "
                         f"request(s): each needs at least one; set serve.num_replicas <= {limit}, or raise "
                         f"serve.route.speculative_replicas (the range is per speculative replica)")
    return share
