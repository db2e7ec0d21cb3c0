"""A tuned schedule: batch-size bucket -> speculative configuration (or off), with the measurements behind it.

``eaglenest tune`` writes ``schedule.json``; serve reads it (``serve.schedule``) and ``eaglenest bench --schedule``
measures it. Buckets come from the measured batch sizes ``b1 < b2 < ... < bk``: bucket ``i`` holds the live batch
sizes ``b(i-1)+1 .. bi`` and applies what was chosen *at bi*, the bucket's largest (speculation's cost grows with
the batch, so a choice measured at the top of its bucket is the cautious one); above ``bk`` nothing was measured and
speculation is off. The choice per bucket follows :mod:`eaglenest.speculative.schedule_select`.

The file records the identity it was measured on (:mod:`eaglenest.speculative.identity`); :meth:`Schedule.check`
refuses a schedule whose target, drafter or engine differ from serve's, naming the fix (re-run tune).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eaglenest.config import SpecConfig
from eaglenest.engines.sglang.adaptive import AdaptiveSpec, adaptive_refusal
from eaglenest.speculative.identity import identity_differences
from eaglenest.speculative.schedule_select import OFF, Option, chain_candidates, choose, single_choice

FORMAT = "eaglenest-schedule/1"


class ScheduleError(ValueError):
    """A schedule file that cannot be used (unreadable, another format, or tuned on something else)."""


@dataclass(frozen=True)
class SGLangPlan:
    """What runs on SGLang for a schedule: its adaptive mode, one static shape, the plain engine (no drafter), or
    ("routed", ``serve.route``) a static shape on a speculative engine for loads up to ``route_limit`` beside a plain
    engine for the rest."""

    mode: Literal["adaptive", "static", "plain", "routed"]
    spec: SpecConfig | None = None
    adaptive: AdaptiveSpec | None = None
    notes: tuple[str, ...] = ()
    """what an operator should know (logged at start, shown by /health)"""
    route_limit: int | None = None
    """routed: the most requests the speculative engine runs (more go to the plain engine)"""


class OffPlan:
    """A speculative engine that never drafts: what "off" costs on it (tune measures it against the plain engine).
    On the reference decoder every step skips the drafter; on SGLang an adaptive engine pinned to steps 0."""

    label = "off"

    def policy(self) -> Callable[[int], SpecConfig | None]:
        return lambda n: None

    def largest_spec(self) -> SpecConfig:
        return SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)

    def sglang_plan(self, engine_kwargs: Mapping[str, Any] | None = None, **_: Any) -> SGLangPlan:
        """An adaptive engine pinned to steps 0; where SGLang refuses adaptive mode, "off" is the plain engine."""
        why = adaptive_refusal(engine_kwargs or {})
        if why is not None:
            return SGLangPlan("plain", notes=(f"speculation off is the plain engine here ({why})",))
        return SGLangPlan("adaptive", adaptive=AdaptiveSpec(((1, (0,)),), provenance="tune: speculation off"))


@dataclass
class Bucket:
    """Live batch sizes ``min_batch .. max_batch`` (None: no upper bound) and what runs there."""

    min_batch: int
    max_batch: int | None
    choice: Option
    safe: bool = True
    """False: not even "off" stayed within noise of the baseline in this bucket (see schedule_select)"""
    noise: float = 0.0
    baseline_tok_per_s: float | None = None
    """the plain engine's median tok/s at ``max_batch`` (the first measured temperature)"""
    options: list[Option] = field(default_factory=list)
    chain_choice: Option | None = None
    chain_steps: list[int] = field(default_factory=list)
    """SGLang adaptive mode's candidate steps here (chains and 0 = off), best first"""

    @property
    def label(self) -> str:
        if self.max_batch is None:
            return f"{self.min_batch}+"
        return str(self.max_batch) if self.min_batch == self.max_batch else f"{self.min_batch}-{self.max_batch}"

    @property
    def measured(self) -> bool:
        return self.max_batch is not None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "min_batch": self.min_batch, "max_batch": self.max_batch,
                "choice": self.choice.to_dict(), "safe": self.safe, "noise": round(self.noise, 4),
                "baseline_tok_per_s": self.baseline_tok_per_s, "options": [o.to_dict() for o in self.options],
                "chain_choice": self.chain_choice.to_dict() if self.chain_choice else None,
                "chain_steps": self.chain_steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Bucket:
        chain = d.get("chain_choice")
        return cls(int(d["min_batch"]), d["max_batch"], Option.from_dict(d["choice"]), bool(d.get("safe", True)),
                   float(d.get("noise", 0.0)), d.get("baseline_tok_per_s"),
                   [Option.from_dict(o) for o in d.get("options", [])],
                   Option.from_dict(chain) if chain else None, [int(s) for s in d.get("chain_steps", [])])


@dataclass
class Schedule:
    """Buckets in ascending batch size plus where and how they were measured."""

    buckets: list[Bucket]
    identity: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    """how tune measured: batch sizes, temperatures, repeats, tokens, prompts, noise floor"""
    drift: dict[str, Any] | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    """engine settings the measurements assumed (SGLang: ``skip_zero_step_draft_extend``)"""

    # ---- lookup
    def bucket_for(self, batch_size: int) -> Bucket:
        """The bucket holding ``batch_size`` (sizes below the first bucket fall in it)."""
        for b in self.buckets:
            if b.max_batch is None or batch_size <= b.max_batch:
                return b
        return self.buckets[-1]

    def spec_for(self, batch_size: int) -> SpecConfig | None:
        return to_spec(self.bucket_for(batch_size).choice)

    def policy(self) -> Callable[[int], SpecConfig | None]:
        """For the reference decoder (``SpecDecoder(policy=...)``): the live batch size picks the step's shape."""
        table = [(b.max_batch, to_spec(b.choice)) for b in self.buckets]

        def pick(n: int) -> SpecConfig | None:
            for hi, spec in table:
                if hi is None or n <= hi:
                    return spec
            return table[-1][1]

        return pick

    def largest_spec(self) -> SpecConfig:
        """The biggest draft shape the schedule uses (the decoder's base shape; off everywhere: the smallest)."""
        specs = [s for s in (to_spec(b.choice) for b in self.buckets) if s is not None]
        return max(specs, key=lambda s: (s.num_draft_tokens, s.num_steps)) if specs else SpecConfig(
            num_steps=1, topk=1, num_draft_tokens=2)

    def adaptive_spec(self, *, provenance: str = "") -> AdaptiveSpec:
        """SGLang's adaptive configuration: each bucket's chain candidates (0 = off) at its smallest batch size."""
        buckets = tuple((b.min_batch, tuple(b.chain_steps or [b.chain_choice.num_steps if b.chain_choice else 0]))
                        for b in self.buckets)
        skip = bool(self.engine_options.get("skip_zero_step_draft_extend", True))
        return AdaptiveSpec(buckets, skip_zero_step_draft_extend=skip, provenance=provenance)

    def adaptive_safe(self) -> list[str]:
        """Buckets where the chain-only choice is not within noise of the baseline (adaptive mode cannot keep
        the promise there); empty when it can everywhere."""
        from eaglenest.speculative.schedule_select import qualifies

        return [b.label for b in self.buckets
                if b.measured and b.chain_choice is not None and not qualifies(b.chain_choice, b.noise)]

    def speculates(self) -> bool:
        return any(not b.choice.off for b in self.buckets)

    def sglang_plan(self, engine_kwargs: Mapping[str, Any] | None = None, *, expected: tuple[int, int] = (1, 256),
                    provenance: str = "", route: bool = False, route_limit: int | None = None) -> SGLangPlan:
        """How SGLang applies this schedule: adaptive mode with each bucket's chain candidates; where SGLang refuses
        adaptive mode (``engine_kwargs`` with attention DP and the like) or a bucket has no chain within noise of
        the baseline, the one option that is safe over the ``expected`` live batch sizes (``lo, hi``), else none.
        ``route`` (``serve.route.by_load``): where that one option would be none, a speculative engine for the
        loads a drafter is safe over (:meth:`route_plan`) beside the plain engine."""
        notes = []
        trees = [f"{b.label} ({b.choice.label} {b.choice.median_ratio:.2f}x, best chain "
                 f"{b.chain_choice.label if b.chain_choice else 'off'} "
                 f"{b.chain_choice.median_ratio if b.chain_choice else 1.0:.2f}x)"
                 for b in self.buckets if b.choice.topk > 1]
        refusal = adaptive_refusal(engine_kwargs or {})
        unsafe = self.adaptive_safe()
        if refusal is None and not unsafe:
            if trees:
                notes.append("SGLang's adaptive mode takes chains only (topk 1); these buckets measured best with a "
                             "tree and run their best chain: " + "; ".join(trees))
            spec = self.adaptive_spec(provenance=provenance)
            if spec.all_steps == [0]:
                return SGLangPlan("plain", notes=(*notes, "the schedule never speculates: serving without a "
                                                          "drafter (the plain engine is the baseline itself)"))
            return SGLangPlan("adaptive", adaptive=spec, notes=tuple(notes))
        why = refusal or (f"in bucket(s) {', '.join(unsafe)} even SGLang's cheapest speculative mode (steps 0) was "
                          "slower than the baseline beyond noise")
        lo, hi = expected
        single = self.single_for_load(lo, hi)
        routed = self.route_plan(lo, route_limit) if route and single is None else None
        head = f"SGLang cannot apply the schedule per batch size ({why}); "
        if routed is not None:  # no one configuration is safe over lo-hi, but routing keeps the low-load gain
            notes.append(head + f"no one configuration is safe for the expected load of {lo}-{hi} concurrent "
                         "requests (serve.expected_batch_size), so serve.route.by_load routes by live load")
            return SGLangPlan("routed", spec=routed.spec, route_limit=routed.route_limit,
                              notes=(*notes, *routed.notes))
        shape = single.label if single else "no speculation"
        notes.append(head + f"serving one configuration for the expected load of {lo}-{hi} concurrent requests: "
                     f"{shape} (serve.expected_batch_size)")
        if single is None:
            narrower = self.widest_speculative_load(lo)
            if narrower is not None:
                top, option = narrower
                notes.append(f"a drafter is safe up to {top} concurrent request(s): {option.label} at "
                             f"{option.median_ratio:.2f}x the baseline; to keep that gain, cap this deployment at "
                             f"serve.expected_batch_size: [{lo}, {top}] (and serve.max_concurrent_requests: {top}) "
                             "and send higher load to a deployment without a drafter, or, where two copies of "
                             "the target fit on the replica's GPUs, set serve.route.by_load: true (docs/OPERATIONS.md, "
                             "'Routing by live load')")
            return SGLangPlan("plain", notes=tuple(notes))
        return SGLangPlan("static", spec=to_spec(single), notes=tuple(notes))

    def route_plan(self, lo: int, limit: int | None = None) -> SGLangPlan | None:
        """Routing by live load (``serve.route``): the drafter configuration safe over ``lo .. K`` on a speculative
        engine, with K the widest such load (capped by ``limit``), and a plain engine for more; None when no load
        starting at ``lo`` can speculate safely. Any engine: the reference decoder routes the same way when asked."""
        narrower = self.widest_speculative_load(lo)
        if narrower is None:
            return None
        top, option = narrower
        if limit is not None and limit < top:
            top, option = limit, self.single_for_load(lo, limit)
            if option is None:
                return None
        note = (f"routing by live load: up to {top} concurrent request(s) on a speculative engine ({option.label}, "
                f"{option.median_ratio:.2f}x the baseline there), more on a plain engine; a request joins the "
                "speculative engine only while the plain one is idle")
        return SGLangPlan("routed", spec=to_spec(option), route_limit=top, notes=(note,))

    def widest_speculative_load(self, lo: int) -> tuple[int, Option] | None:
        """The largest measured bucket top ``hi >= lo`` for which one drafter configuration is safe over ``lo .. hi``,
        and that configuration; None when no expected load starting at ``lo`` can speculate safely."""
        best = None
        for b in self.buckets:
            if b.max_batch is None or b.max_batch < lo:
                continue
            option = self.single_for_load(lo, b.max_batch)
            if option is None:
                break
            best = (b.max_batch, option)
        return best

    def single_for_load(self, lo: int, hi: int, *, chains_only: bool = False) -> Option | None:
        """One option for every live batch size in ``lo .. hi`` (schedule_select.single_choice); None = off."""
        inside = [b for b in self.buckets
                  if (b.max_batch is None or b.max_batch >= lo) and b.min_batch <= hi]
        allow = (lambda o: o.chain) if chains_only else (lambda o: True)
        return single_choice([(b.options, b.noise) for b in inside], allow=allow)

    # ---- identity
    def check(self, current: dict[str, Any], *, path: str | Path, fix: str,
              parts: tuple[str, ...] = ("target", "drafter", "engine")) -> None:
        """Refuse a schedule tuned on another target, drafter or engine (``fix``: the tune command to re-run);
        ``parts``: what to compare (a driver without the serving GPU checks the files, the replica everything)."""
        diffs = identity_differences({k: v for k, v in self.identity.items() if k in parts},
                                     {k: v for k, v in current.items() if k in parts})
        if diffs:
            raise ScheduleError(f"schedule {path} is stale: it was tuned on something else:\n  - "
                                + "\n  - ".join(diffs) + f"\nre-run the tune for what you serve: {fix}")

    # ---- files
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "identity": self.identity, "settings": self.settings, "drift": self.drift,
                "engine_options": self.engine_options, "buckets": [b.to_dict() for b in self.buckets]}

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        p = Path(path)
        if not p.is_file():
            raise ScheduleError(f"schedule {p} does not exist; write one with `eaglenest tune --config ... "
                                f"--drafter ... --output {p.parent}`")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule {p} is not valid JSON ({e}); re-run `eaglenest tune`") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ScheduleError(f"{p} is not an eaglenest schedule (format {FORMAT!r}); re-run `eaglenest tune`")
        buckets = [Bucket.from_dict(b) for b in d["buckets"]]
        if not buckets or buckets[-1].max_batch is not None:
            raise ScheduleError(f"schedule {p} has no open last bucket; re-run `eaglenest tune`")
        return cls(buckets, d["identity"], d.get("settings", {}), d.get("drift"), d.get("engine_options", {}))


def to_spec(o: Option) -> SpecConfig | None:
    """The decoder's shape for an option (None: off)."""
    if o.off:
        return None
    return SpecConfig(num_steps=o.num_steps, topk=o.topk, num_draft_tokens=o.num_draft_tokens)


def build_schedule(per_batch: dict[int, list[dict[str, Any]]], identity: dict[str, Any], *, noise_floor: float,
                   settings: dict[str, Any] | None = None, drift: dict[str, Any] | None = None,
                   engine_options: dict[str, Any] | None = None) -> Schedule:
    """Buckets from measurements: ``per_batch[bs]`` holds one bench report per temperature at batch size ``bs``."""
    from eaglenest.speculative.schedule_select import noise_of, options_of

    if not per_batch:
        raise ValueError("no measurements to build a schedule from")
    buckets, lo = [], 1
    for bs in sorted(per_batch):
        reports = per_batch[bs]
        noise = noise_of(reports, noise_floor)
        options = options_of(reports)
        choice, safe = choose(options, noise)
        chain, steps = chain_candidates(options, noise)
        buckets.append(Bucket(lo, bs, choice, safe, noise, float(reports[0]["baseline"]["tok_per_s"]), options,
                              chain, steps))
        lo = bs + 1
    off = Option(OFF, 0, 1, 1, 1.0, 1.0, 0.0)
    buckets.append(Bucket(lo, None, off, True, 0.0, None, [], off, [0]))
    return Schedule(buckets, identity, settings or {}, drift, engine_options or {})
