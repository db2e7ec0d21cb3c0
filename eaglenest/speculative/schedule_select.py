"""How a tuned schedule picks a configuration for a batch bucket from measurements: the one rule, in one place.

Per bucket (one measured batch size), every option (speculation off, or a draft shape ``steps-topk-tokens``) has,
at every measured temperature, its tok/s over the repeats and the baseline's (the plain engine, no drafter):

- **noise** of the bucket: the baseline's own spread over the repeats, ``(max - min) / median`` (at least
  ``noise_floor``): a difference smaller than what the same baseline shows between two repeats is not measured.
- an option's **median ratio**: its median tok/s over the baseline's median, the lowest over the temperatures (a
  shape that wins greedy but loses sampled is judged by its loss); its **worst ratio**: its slowest repeat over the
  baseline's median, again the lowest over the temperatures.
- an option **qualifies** when its worst ratio is at least ``1 - noise``: even its slowest repeat is not slower than
  the baseline beyond noise. A speculative option must also have a median ratio above 1 (else it buys nothing).
- the **choice** is the qualifying speculative option with the highest median ratio; none: speculation off. When
  even "off" does not qualify (a speculative engine whose off mode still costs, as SGLang's steps-0 can), the bucket
  is marked unsafe and "off" is still its choice (the cheapest thing a speculative engine can do there).

SGLang's adaptive mode takes only chains (topk 1): :func:`chain_candidates` applies the same rule to chains and
"off" and returns the steps within noise of the best chain (SGLang's EMA of the accept length may move between
them; all are measured safe in this bucket).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

OFF = "off"


@dataclass(frozen=True)
class Option:
    """One measured option of a bucket."""

    label: str
    """``off`` or ``steps-topk-tokens``"""
    num_steps: int
    topk: int
    num_draft_tokens: int
    median_ratio: float
    worst_ratio: float
    tok_per_s: float
    """median tok/s at the first measured temperature (greedy by default)"""
    accept_length: float | None = None

    @property
    def off(self) -> bool:
        return self.num_steps == 0

    @property
    def chain(self) -> bool:
        return self.topk == 1

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "num_steps": self.num_steps, "topk": self.topk,
                "num_draft_tokens": self.num_draft_tokens, "median_ratio": round(self.median_ratio, 4),
                "worst_ratio": round(self.worst_ratio, 4), "tok_per_s": round(self.tok_per_s, 3),
                "accept_length": None if self.accept_length is None else round(self.accept_length, 3)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Option:
        return cls(d["label"], int(d["num_steps"]), int(d["topk"]), int(d["num_draft_tokens"]),
                   float(d["median_ratio"]), float(d["worst_ratio"]), float(d["tok_per_s"]), d.get("accept_length"))


def parse_label(label: str) -> tuple[int, int, int]:
    """``off`` -> (0, 1, 1); ``3-1-4`` -> (3, 1, 4)."""
    if label == OFF:
        return 0, 1, 1
    s, k, n = (int(x) for x in label.split("-"))
    return s, k, n


def noise_of(reports: Sequence[dict[str, Any]], floor: float) -> float:
    """The bucket's noise: the largest relative spread of the baseline over its repeats (see the module docstring)."""
    spreads = [floor]
    for r in reports:
        rounds = [x for x in r["baseline"]["tok_per_s_rounds"] if x > 0]
        if len(rounds) >= 2:
            spreads.append((max(rounds) - min(rounds)) / statistics.median(rounds))
    return max(spreads)


def options_of(reports: Sequence[dict[str, Any]]) -> list[Option]:
    """The options measured in every one of ``reports`` (one bench report per temperature, same batch size)."""
    if not reports:
        return []
    names = [set(c["config"] for c in r["configs"]) for r in reports]
    common = [c["config"] for c in reports[0]["configs"] if all(c["config"] in n for n in names)]
    out = []
    for name in common:
        medians, worsts = [], []
        for r in reports:
            base = r["baseline"]["tok_per_s"]
            row = next(c for c in r["configs"] if c["config"] == name)
            rounds = row.get("tok_per_s_rounds") or [row["tok_per_s"]]
            medians.append(row["tok_per_s"] / base if base > 0 else 0.0)
            worsts.append(min(rounds) / base if base > 0 else 0.0)
        first = next(c for c in reports[0]["configs"] if c["config"] == name)
        s, k, n = parse_label(name)
        acc = first.get("accept_length") if s > 0 else None
        out.append(Option(name, s, k, n, min(medians), min(worsts), float(first["tok_per_s"]), acc))
    return out


def qualifies(o: Option, noise: float) -> bool:
    return o.worst_ratio >= 1.0 - noise and (o.off or o.median_ratio > 1.0)


def choose(options: Sequence[Option], noise: float,
           allow: Callable[[Option], bool] = lambda o: True) -> tuple[Option, bool]:
    """(choice, safe) under the module's rule, among the options ``allow`` keeps ("off" is always considered)."""
    off = next((o for o in options if o.off), None)
    if off is None:
        off = Option(OFF, 0, 1, 1, 1.0, 1.0, 0.0)  # not measured: a plain engine (SGLang without a drafter)
    spec = [o for o in options if not o.off and allow(o) and qualifies(o, noise)]
    if spec:
        return max(spec, key=lambda o: o.median_ratio), True
    return off, qualifies(off, noise)


def chain_candidates(options: Sequence[Option], noise: float) -> tuple[Option, list[int]]:
    """The chain-only choice and SGLang's ``candidate_steps`` for the bucket (best first, then ascending)."""
    best, _ = choose(options, noise, allow=lambda o: o.chain)
    near = [o for o in options if (o.chain or o.off) and qualifies(o, noise)
            and o.median_ratio >= best.median_ratio - noise]
    steps = sorted({o.num_steps for o in near} - {best.num_steps})
    return best, [best.num_steps, *steps]


def single_choice(buckets: Sequence[tuple[list[Option], float]],
                  allow: Callable[[Option], bool] = lambda o: True) -> Option | None:
    """One option for every bucket of an expected load (``(options, noise)`` per bucket): the speculative option
    that qualifies in *every* bucket and has the best mean median ratio; None (speculation off) when none does."""
    if not buckets:
        return None
    labels = None
    for options, _ in buckets:
        names = {o.label for o in options if not o.off and allow(o)}
        labels = names if labels is None else labels & names
    best, best_score = None, 1.0
    for label in sorted(labels or ()):
        picked = [next(o for o in opts if o.label == label) for opts, _ in buckets]
        if not all(qualifies(o, noise) for o, (_, noise) in zip(picked, buckets, strict=True)):
            continue
        score = statistics.mean(o.median_ratio for o in picked)
        if score > best_score:
            best, best_score = picked[0], score
    return best
