"""``eaglenest tune``: measure every candidate against the baseline at each batch size, then build a schedule.

The measuring is the bench's (:func:`eaglenest.speculative.bench.run_bench_batches`, the same engines, runners and
interleaving as ``eaglenest bench``); this module decides what to measure, keeps every result in a measurements
file as it arrives, and turns the file into a schedule (:func:`eaglenest.speculative.schedule.build_schedule`).

What is measured, per temperature and batch size ``b``: the plain engine (the baseline), "off" (the speculative
engine not drafting: on the reference decoder its steps skip the drafter, on SGLang an adaptive engine pinned to
steps 0), every chain ``s-1-(s+1)`` and every tree. ``b`` concurrent requests run at a time, over
``b * ceil(num_prompts / b)`` prompts (whole batches; the prompt file is cycled when shorter).

**Resumable.** ``measurements.jsonl`` starts with a header (identity and settings); every finished unit is appended
at once: on the reference decoder a (temperature, batch size), on SGLang a variant's engine run over all batch sizes
(an engine start costs minutes on a large target). A killed tune re-run with the same output continues where it
stopped; a header that does not match (another drafter, target, engine or settings) is refused, naming the fix.
Adding batch sizes or temperatures to a finished run measures only what is new.

**Drift.** The baseline is measured again at the end (reference decoder: at the first batch size, after everything;
SGLang: every batch size, after every variant). A change beyond the bucket's noise is reported with the schedule.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.config import SpecConfig
from eaglenest.speculative.bench import run_bench_batches, spec_label
from eaglenest.speculative.schedule import OffPlan, Schedule, build_schedule
from eaglenest.speculative.schedule_select import noise_of

MEASUREMENTS = "measurements.jsonl"


class TuneError(ValueError):
    """Measurements that cannot be continued or used (with the fix in the message)."""


@dataclass
class TuneSettings:
    """What one tune measures (recorded in the measurements header and the schedule)."""

    batch_sizes: list[int]
    candidates: list[str]
    """``steps-topk-tokens`` shapes (chains and trees); "off" and the baseline are always measured"""
    temperatures: list[float]
    repeats: int
    max_new_tokens: int
    num_prompts: int
    noise_floor: float
    prompts: str = ""
    engine_options: dict[str, Any] = field(default_factory=dict)

    def specs(self) -> list[SpecConfig]:
        out = []
        for c in self.candidates:
            s, k, n = (int(x) for x in c.split("-"))
            out.append(SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))
        return out

    def comparable(self) -> dict[str, Any]:
        """What must match for measurements to be continued (batch sizes and temperatures may grow)."""
        d = asdict(self)
        d.pop("batch_sizes")
        d.pop("temperatures")
        return d


def candidate_labels(steps: Sequence[int], trees: Sequence[SpecConfig]) -> list[str]:
    """Chains ``s-1-(s+1)`` for every step count, then the trees."""
    return [f"{s}-1-{s + 1}" for s in steps] + [spec_label(t) for t in trees]


def prompts_for(prompts: Sequence[Sequence[int]], batch_size: int, num_prompts: int) -> list[list[int]]:
    """Whole batches of ``batch_size`` covering at least ``num_prompts`` prompts (the list cycled)."""
    if not prompts:
        raise TuneError("no prompts to tune with; give --prompts (held-out prompts, JSONL)")
    n = batch_size * math.ceil(max(num_prompts, 1) / batch_size)
    return [list(prompts[i % len(prompts)]) for i in range(n)]


class Measurements:
    """The append-only measurements file of one tune."""

    def __init__(self, path: Path, identity: dict[str, Any], settings: TuneSettings) -> None:
        self.path = path
        self.reports: dict[tuple[float, int], dict[str, Any]] = {}
        self.variants: dict[float, dict[str, dict[int, list[dict[str, Any]]]]] = {}
        self.drift: dict[float, dict[int, dict[str, Any]]] = {}
        if path.is_file():
            self._read(identity, settings)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"kind": "header", "identity": identity, "settings": asdict(settings)})

    def _read(self, identity: dict[str, Any], settings: TuneSettings) -> None:
        lines = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
        if not lines or lines[0].get("kind") != "header":
            raise TuneError(f"{self.path} is not a tune measurements file; choose another --output")
        head = lines[0]
        from eaglenest.speculative.identity import identity_differences

        diffs = identity_differences(head["identity"], identity)
        old = TuneSettings(**head["settings"]).comparable()
        diffs += [f"{k}: measured with {old[k]!r}, now {v!r}" for k, v in settings.comparable().items()
                  if old.get(k) != v]
        if diffs:
            raise TuneError(f"{self.path} holds measurements of another tune:\n  - " + "\n  - ".join(diffs)
                            + f"\nuse another --output, or delete {self.path} to start over")
        for rec in lines[1:]:
            t = float(rec.get("temperature", 0.0))
            if rec["kind"] == "report":
                self.reports[(t, int(rec["batch_size"]))] = rec["report"]
            elif rec["kind"] == "variant":
                self.variants.setdefault(t, {}).setdefault(rec["name"], {}).update(
                    {int(k): v for k, v in rec["rounds"].items()})
            elif rec["kind"] == "drift":
                self.drift.setdefault(t, {})[int(rec["batch_size"])] = rec

    def _append(self, rec: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()

    def add_report(self, temperature: float, batch_size: int, report: dict[str, Any]) -> None:
        self.reports[(temperature, batch_size)] = report
        self._append({"kind": "report", "temperature": temperature, "batch_size": batch_size, "report": report})

    def add_variant(self, temperature: float, name: str, rounds: dict[int, list[dict[str, Any]]]) -> None:
        """A variant's rounds per batch size, merged with its earlier ones (a tune grown by batch sizes measures only
        the new ones; a later verify then finds the variant measured at every size and does not start it again)."""
        self.variants.setdefault(temperature, {}).setdefault(name, {}).update(rounds)
        self._append({"kind": "variant", "temperature": temperature, "name": name,
                      "rounds": {str(k): v for k, v in rounds.items()}})

    def add_drift(self, temperature: float, batch_size: int, first: float, end: float, noise: float) -> None:
        rel = (end - first) / first if first > 0 else 0.0
        rec = {"kind": "drift", "temperature": temperature, "batch_size": batch_size, "baseline_first": first,
               "baseline_end": end, "relative": rel, "noise": noise, "within_noise": abs(rel) <= noise}
        self.drift.setdefault(temperature, {})[batch_size] = rec
        self._append(rec)

    def done(self, temperature: float, batch_size: int) -> bool:
        return (temperature, batch_size) in self.reports


def run_tune(engine: str, target: Any, drafter: Any, prompts: Sequence[Sequence[int]], settings: TuneSettings,
             log: Measurements, *, sglang_factory: Callable[..., Any] | None = None, progress: bool = True,
             drift_check: bool = True) -> None:
    """Measure what ``log`` does not hold yet (see the module docstring). ``drift_check=False`` (SGLang) leaves the
    baseline's second run to :func:`verify_schedule`, which measures it after the schedule."""
    specs = settings.specs()
    plans = {"off": OffPlan()}
    common = {"repeats": settings.repeats, "max_new_tokens": settings.max_new_tokens, "plans": plans}
    todo = [(t, bs) for t in settings.temperatures for bs in settings.batch_sizes if not log.done(t, bs)]
    bar = _bar(len(todo), progress and engine == "hf")
    for t in settings.temperatures:
        pending = [bs for bs in settings.batch_sizes if not log.done(t, bs)]
        if not pending:
            continue
        if engine == "hf":
            for bs in pending:
                bar.set_description(f"tune T={t:g} batch {bs}")
                log.add_report(t, bs, _measure_hf(target, drafter, prompts, specs, settings, t, bs, common))
                bar.update(1)
        else:
            reps = _measure_sglang(drafter, prompts, specs, settings, log, t, pending, common,
                                   sglang_factory=sglang_factory, progress=progress, drift_check=drift_check)
            for bs, rep in zip(pending, reps, strict=True):
                log.add_report(t, bs, rep)
                _record_drift(log, t, bs, rep, settings.noise_floor)
    bar.close()
    first_t, first_bs = settings.temperatures[0], settings.batch_sizes[0]
    if engine == "hf" and first_bs not in log.drift.get(first_t, {}):
        again = run_bench_batches(target, drafter, prompts_for(prompts, first_bs, settings.num_prompts), [],
                                  batch_sizes=[first_bs], temperature=first_t, engine="hf", progress=False,
                                  **common)[0]
        first = log.reports[(first_t, first_bs)]
        log.add_drift(first_t, first_bs, first["baseline"]["tok_per_s"], again["baseline"]["tok_per_s"],
                      noise_of([first], settings.noise_floor))


def verify_schedule(engine: str, target: Any, drafter: Any, prompts: Sequence[Sequence[int]],
                    settings: TuneSettings, log: Measurements, schedule: Schedule, *,
                    sglang_factory: Callable[..., Any] | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """The schedule measured beside what chose it, in the same run, at the first temperature: the bench's reports
    (baseline, every candidate, "off" and the schedule as serve launches it) per batch size, which
    ``eaglenest bench --schedule`` would give from a second run of every engine.

    On SGLang the variants ``log`` holds are not started again: one engine more (the schedule), then the baseline's
    drift run, so the baseline is measured before and after everything the comparison uses. The schedule's run is
    recorded in ``log`` like any variant (a killed verify continues). The reference decoder measures each batch size
    afresh (a CPU's engine start is cheap)."""
    t = settings.temperatures[0]
    common = {"repeats": settings.repeats, "max_new_tokens": settings.max_new_tokens,
              "plans": {"off": OffPlan(), "schedule": schedule}}
    specs = settings.specs()
    if engine == "hf":
        return [_measure_hf(target, drafter, prompts, specs, settings, t, bs, common) for bs in settings.batch_sizes]
    reps = _measure_sglang(drafter, prompts, specs, settings, log, t, settings.batch_sizes, common,
                           sglang_factory=sglang_factory, progress=progress, drift_check=True)
    for bs, rep in zip(settings.batch_sizes, reps, strict=True):
        _record_drift(log, t, bs, rep, settings.noise_floor)
    return reps


def _measure_hf(target: Any, drafter: Any, prompts: Sequence[Sequence[int]], specs: list[SpecConfig],
                settings: TuneSettings, t: float, bs: int, common: dict[str, Any]) -> dict[str, Any]:
    """One batch size on the reference decoder: every variant, whole batches of ``bs``."""
    return run_bench_batches(target, drafter, prompts_for(prompts, bs, settings.num_prompts), specs,
                             batch_sizes=[bs], temperature=t, engine="hf", progress=False, **common)[0]


def _measure_sglang(drafter: Any, prompts: Sequence[Sequence[int]], specs: list[SpecConfig], settings: TuneSettings,
                    log: Measurements, t: float, sizes: list[int], common: dict[str, Any], *,
                    sglang_factory: Callable[..., Any] | None, progress: bool,
                    drift_check: bool) -> list[dict[str, Any]]:
    """One engine per variant ``log`` does not hold at every one of ``sizes``, each recorded there as it ends."""
    return run_bench_batches(
        None, drafter, prompts_for(prompts, 1, 1), specs, batch_sizes=sizes, temperature=t, engine="sglang",
        sglang_factory=sglang_factory, progress=progress, drift_check=drift_check, done=log.variants.get(t, {}),
        on_variant=lambda name, rounds: log.add_variant(t, name, rounds),
        prompts_for=lambda bs: prompts_for(prompts, bs, settings.num_prompts), **common)


def _record_drift(log: Measurements, t: float, bs: int, rep: dict[str, Any], noise_floor: float) -> None:
    """The baseline's second run of ``rep`` against its first, once per batch size (a resumed verify's drift run
    comes back from the file, already recorded)."""
    end = rep["baseline"].get("tok_per_s_end")
    if end and bs not in log.drift.get(t, {}):
        log.add_drift(t, bs, rep["baseline"]["tok_per_s"], end, noise_of([rep], noise_floor))


def schedule_from(log: Measurements, identity: dict[str, Any], settings: TuneSettings) -> Schedule:
    """The schedule of the measurements in ``log`` for ``settings``' batch sizes and temperatures."""
    per_batch = {bs: [log.reports[(t, bs)] for t in settings.temperatures] for bs in settings.batch_sizes}
    drift = [d for per in log.drift.values() for d in per.values()]
    worst = max(drift, key=lambda d: abs(d["relative"])) if drift else None
    summary = None
    if worst is not None:
        summary = {"worst": worst, "all_within_noise": all(d["within_noise"] for d in drift),
                   "median_relative": statistics.median(d["relative"] for d in drift)}
    return build_schedule(per_batch, identity, noise_floor=settings.noise_floor, settings=asdict(settings),
                          drift=summary, engine_options=settings.engine_options)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="measurement", disable=not enabled)
