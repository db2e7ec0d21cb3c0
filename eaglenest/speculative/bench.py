"""Speculative vs baseline throughput on the same engine and prompts, with a sweep over the draft shape.

``run_bench`` decodes every prompt with the plain baseline and with each ``(num_steps, topk, num_draft_tokens)``
config, at a fixed batch size, for ``repeats`` rounds. With the transformers engine all variants live in one process
and are interleaved prompt by prompt (the variant order rotates every prompt), so machine noise hits them alike;
tok/s per variant is the median over rounds of (completion tokens / decode seconds). Speedup = median spec tok/s /
median baseline tok/s. Greedy outputs of every config are checked against the baseline's, token for token.

The SGLang engine (``engine="sglang"``) starts one ``sglang.Engine`` per variant (a GPU rarely holds several), runs
them one after another and runs the baseline again at the end to show drift; accept length comes from SGLang's own
per-request ``spec_verify_ct``. It needs a GPU and ``pip install eaglenest[gpu]``. A variant whose engine fails to
start or run is reported under ``failed`` with its error; the others are still measured. That includes a failure
inside SGLang's scheduler process while the engine starts (a kernel that rejects the drafter's shapes during CUDA-graph
capture), on which SGLang's own SIGQUIT handler would end this whole process: the bench's engines start with a
reporting handler instead (``eaglenest.engines.sglang.launch_failure``; not yet exercised on a GPU).

Several drafters (e.g. the Llama-shaped and the MLA draft shape of one target) can be benchmarked in one run against
one baseline: pass ``drafter`` as a ``{label: drafter}`` mapping; each config is then named ``label:steps-topk-tokens``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.config import SpecConfig
from eaglenest.contracts.metrics import accept_length
from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.bench_report import build_report, plot_bench, report_markdown, verdict

BASELINE = "baseline"
__all__ = ["BASELINE", "VariantStats", "plot_bench", "report_markdown", "run_bench", "run_bench_batches",
           "spec_label", "verdict"]


def spec_label(spec: SpecConfig) -> str:
    """``steps-topk-draft_tokens`` as SGLang's docs write it (e.g. 3-1-4)."""
    return f"{spec.num_steps}-{spec.topk}-{spec.num_draft_tokens}"


@dataclass
class _Run:
    tokens: list[list[int]]
    seconds: float
    completion_tokens: int
    verify_steps: int
    accepted: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    per_prompt: list[tuple[int, int]] = field(default_factory=list)
    """(verify steps, accepted tokens) of each prompt, in prompt order: where an accept length comes from"""


CEILING_ENV = "SGLANG_SIMULATE_ACC_LEN"
"""SGLang's own knob (read by its scheduler at start) that makes every verify accept the configured number of
tokens after the real draft and verify forwards ran: the cost of a cycle with a perfect drafter of this shape."""


@dataclass
class VariantStats:
    """Measurements of one variant (the baseline, one spec config, or a spec config's ceiling) over all rounds."""

    name: str
    spec: SpecConfig | None
    rounds: list[_Run] = field(default_factory=list)
    ceiling: bool = False
    """every draft token accepted (SGLang only): its speed is the bound for this shape, its text is meaningless"""
    drafter: str | None = None
    """the drafter's label (None: the baseline, or the only drafter of a one-drafter bench)"""
    error: str | None = None
    """why this variant has no measurement (its engine failed to start or to run)"""
    plan: Any = None
    """a step plan instead of one shape (a tuned schedule, or speculation off on a speculative engine): an object
    with ``policy()`` and ``largest_spec()`` (the reference decoder) and ``sglang_plan(...)`` (SGLang)"""

    @property
    def is_baseline(self) -> bool:
        return self.spec is None and self.plan is None

    def tok_per_s(self) -> list[float]:
        return [r.completion_tokens / r.seconds if r.seconds > 0 else 0.0 for r in self.rounds]

    def median_tok_per_s(self) -> float:
        return statistics.median(self.tok_per_s())

    def accept_length(self) -> float:
        steps = sum(r.verify_steps for r in self.rounds)
        acc = sum(r.accepted for r in self.rounds)
        return accept_length(steps, acc)

    def accept_length_per_prompt(self) -> list[float]:
        """Each prompt's accept length over all rounds (prompts in the order given): the spread behind the mean."""
        if not self.rounds or not self.rounds[0].per_prompt:
            return []
        out = []
        for k in range(len(self.rounds[0].per_prompt)):
            steps = sum(r.per_prompt[k][0] for r in self.rounds if k < len(r.per_prompt))
            acc = sum(r.per_prompt[k][1] for r in self.rounds if k < len(r.per_prompt))
            out.append(round(accept_length(steps, acc), 3))
        return out


# ------------------------------------------------------------------------------------------------------- runners
Runner = Callable[[Sequence[Sequence[int]], SamplingParams], _Run]


def hf_runner(decoder: Any, batch_size: int) -> Runner:
    """A variant on the reference decoders (``SpecDecoder`` / ``BaselineDecoder``)."""

    def run(prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> _Run:
        toks, steps, acc, secs, ds, vs = [], 0, 0, 0.0, 0.0, 0.0
        per: list[tuple[int, int]] = []
        for i in range(0, len(prompts), batch_size):
            t0 = decoder.clock()
            res = decoder.generate(prompts[i:i + batch_size], sampling)
            secs += decoder.clock() - t0
            for r in res:
                toks.append(r.token_ids)
                steps += r.draft_steps
                acc += sum(r.accepted_per_step)
                ds += r.draft_time_s
                vs += r.verify_time_s
                per.append((r.draft_steps, sum(r.accepted_per_step)))
        return _Run(toks, secs, sum(len(t) for t in toks), steps, acc, ds, vs, per)

    return run


def sglang_runner(engine: Any, batch_size: int) -> Runner:
    """A variant on an ``SGLangEngine`` (integration point of the GPU engine; see the module docstring). An engine
    with ``ready_for`` (a routing plan's :class:`~eaglenest.speculative.routed_engine.RoutedEngine`) gets ready for
    ``batch_size`` here, outside the timed rounds."""
    ready_for = getattr(engine, "ready_for", None)
    if ready_for is not None:
        ready_for(batch_size)

    def run(prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> _Run:
        toks, steps, acc, secs = [], 0, 0, 0.0
        per: list[tuple[int, int]] = []
        for i in range(0, len(prompts), batch_size):
            t0 = time.perf_counter()
            gens = engine.generate_ids(prompts[i:i + batch_size], sampling)
            secs += time.perf_counter() - t0
            for g in gens:
                toks.append(g.token_ids)
                verify = int(g.meta.get("spec_verify_ct") or 0)
                got = max(0, int(g.meta.get("completion_tokens", len(g.token_ids))) - verify) if verify else 0
                steps += verify
                acc += got
                per.append((verify, got))
        return _Run(toks, secs, sum(len(t) for t in toks), steps, acc, per_prompt=per)

    return run


# ---------------------------------------------------------------------------------------------------------- bench
def run_bench(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    sweep: Sequence[SpecConfig],
    *,
    max_new_tokens: int = 64,
    repeats: int = 3,
    batch_size: int = 1,
    temperature: float = 0.0,
    engine: str = "hf",
    warmup: int = 1,
    progress: bool = True,
    sglang_factory: Callable[[SpecConfig | None, Any], Any] | None = None,
) -> dict[str, Any]:
    """Baseline vs every spec config on the same prompts; returns the report dict (see :func:`report_markdown`).

    ``target``: an ``HFEngine`` (engine "hf"). ``drafter``: an ``Eagle3Drafter``, a ``DraftModel`` or an export
    folder, or a ``{label: drafter}`` mapping to compare several. For engine "sglang", ``sglang_factory(spec,
    drafter)`` returns an ``SGLangEngine`` (``spec`` None = baseline; ``drafter`` one of the given drafters).
    """
    return run_bench_batches(target, drafter, prompts, sweep, batch_sizes=[batch_size],
                             max_new_tokens=max_new_tokens, repeats=repeats, temperature=temperature, engine=engine,
                             warmup=warmup, progress=progress, sglang_factory=sglang_factory)[0]


def run_bench_batches(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    sweep: Sequence[SpecConfig],
    *,
    batch_sizes: Sequence[int],
    max_new_tokens: int = 64,
    repeats: int = 3,
    temperature: float = 0.0,
    engine: str = "hf",
    warmup: int = 1,
    progress: bool = True,
    sglang_factory: Callable[..., Any] | None = None,
    ceiling: bool = False,
    drift_check: bool = True,
    plans: Mapping[str, Any] | None = None,
    done: Mapping[str, Mapping[int, list[dict[str, Any]]]] | None = None,
    on_variant: Callable[[str, dict[int, list[dict[str, Any]]]], None] | None = None,
    prompts_for: Callable[[int], Sequence[Sequence[int]]] | None = None,
) -> list[dict[str, Any]]:
    """:func:`run_bench` at several batch sizes, one report each (in ``batch_sizes`` order).

    With SGLang every variant's engine is started once and measured at every batch size (an engine start costs
    more than the measurement on a large target); with the transformers engine each batch size is its own bench.
    ``ceiling`` (SGLang): also run each spec config with every draft token accepted (:data:`CEILING_ENV`), the
    speedup a perfect drafter of this shape would give. ``drift_check`` (SGLang): run the baseline again at the end.
    ``plans``: more variants, ``{label: plan}`` (a tuned schedule, speculation off; :class:`VariantStats`), measured
    on the (one) drafter. SGLang only: ``on_variant(name, rounds per batch size)`` after each variant's engine ran,
    and ``done`` (the same records) skips variants measured before (a resumed run). ``prompts_for(batch size)``:
    the prompts measured at that batch size (default: ``prompts`` at every size).
    """
    if not prompts:
        raise ValueError("no prompts to benchmark")
    plans = dict(plans or {})
    if not sweep and not plans:
        raise ValueError("the sweep is empty: give at least one (num_steps, topk, num_draft_tokens) config")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=0)
    prompts = [list(p) for p in prompts]
    at = {bs: [list(p) for p in prompts_for(bs)] if prompts_for else prompts for bs in batch_sizes}
    if ceiling and engine != "sglang":
        raise ValueError("the ceiling run needs the sglang engine (it uses SGLang's own acceptance simulation)")
    drafters = dict(drafter) if isinstance(drafter, Mapping) else {None: drafter}
    if not drafters:
        raise ValueError("no drafter to benchmark")
    if plans and len(drafters) != 1:
        raise ValueError("a schedule (or 'off') is measured on one drafter; give one --drafter")
    per_bs = {bs: _variants(sweep, list(drafters), ceiling, plans) for bs in batch_sizes}
    if engine == "hf":
        for bs in batch_sizes:
            _bench_hf(target, drafters, at[bs], per_bs[bs], sampling, repeats, bs, warmup, progress)
    elif engine == "sglang":
        if sglang_factory is None:
            raise ValueError("engine 'sglang' needs sglang_factory (see eaglenest.bench_cli for the launcher)")
        _bench_sglang(sglang_factory, drafters, at, per_bs, sampling, repeats, warmup, progress, drift_check,
                      done or {}, on_variant)
    else:
        raise ValueError(f"unknown engine {engine!r}; allowed: hf, sglang")
    kernel = None
    if engine == "hf":  # a CPU speedup depends on it (BENCHMARKS.md): say which one ran
        from eaglenest.kernels import uses_packed_linears

        kernel = "packed" if uses_packed_linears(target.model) else "torch"
    return [build_report(per_bs[bs], engine=engine, sampling=sampling, repeats=repeats, batch_size=bs,
                    num_prompts=len(at[bs]), linear_kernel=kernel) for bs in batch_sizes]


def _variants(sweep: Sequence[SpecConfig], labels: list[str | None], ceiling: bool,
              plans: Mapping[str, Any] | None = None) -> list[VariantStats]:
    """The baseline, then every (drafter, config), then the ceilings: one :class:`VariantStats` each. With one
    unnamed drafter a config is named ``steps-topk-tokens``; with several, ``label:steps-topk-tokens``."""
    def name(label: str | None, s: SpecConfig) -> str:
        return spec_label(s) if label is None else f"{label}:{spec_label(s)}"

    out = [VariantStats(BASELINE, None)]
    out += [VariantStats(name(d, s), s, drafter=d) for d in labels for s in sweep]
    if ceiling:
        out += [VariantStats(name(d, s) + " ceiling", s, ceiling=True, drafter=d) for d in labels for s in sweep]
    out += [VariantStats(label, None, drafter=labels[0], plan=p) for label, p in (plans or {}).items()]
    return out


def _bench_hf(target, drafters, prompts, variants, sampling, repeats, batch_size, warmup, progress) -> None:
    from eaglenest.speculative import BaselineDecoder, SpecDecoder

    loaded = {}
    for label, d in drafters.items():
        if isinstance(d, (str, Path)):
            from eaglenest.drafters.eagle3.model import load_drafter

            d = load_drafter(d, device=target.device, dtype=target.dtype)
        loaded[label] = d
    runners: dict[str, Runner] = {}
    for v in variants:
        if v.plan is not None:
            dec = SpecDecoder.from_engine(target, loaded[v.drafter], v.plan.largest_spec(), policy=v.plan.policy())
        elif v.spec is None:
            dec = BaselineDecoder.from_engine(target)
        else:
            dec = SpecDecoder.from_engine(target, loaded[v.drafter], v.spec)
        runners[v.name] = hf_runner(dec, batch_size)
    groups = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for v in variants:  # warm-up: allocator, kernels, caches
        for g in groups[:warmup]:
            runners[v.name](g, sampling)
    total = repeats * len(groups) * len(variants)
    bar = _bar(total, progress, "bench hf")
    for _ in range(repeats):
        per = {v.name: _Run([], 0.0, 0, 0, 0) for v in variants}
        for gi, group in enumerate(groups):
            order = variants[gi % len(variants):] + variants[: gi % len(variants)]
            for v in order:
                r = runners[v.name](group, sampling)
                acc = per[v.name]
                acc.tokens += r.tokens
                acc.seconds += r.seconds
                acc.completion_tokens += r.completion_tokens
                acc.verify_steps += r.verify_steps
                acc.accepted += r.accepted
                acc.draft_s += r.draft_s
                acc.verify_s += r.verify_s
                acc.per_prompt += r.per_prompt
                bar.update(1)
        for v in variants:
            v.rounds.append(per[v.name])
    bar.close()


def _bench_sglang(factory, drafters, at: dict[int, list[list[int]]], per_bs: dict[int, list[VariantStats]], sampling,
                  repeats, warmup, progress, drift_check: bool = True,
                  done: Mapping[str, Mapping[int, list[dict]]] | None = None,
                  on_variant: Callable[[str, dict[int, list[dict]]], None] | None = None) -> None:
    """One engine per variant, measured at every batch size; the baseline may run again at the end (drift). A
    variant whose engine fails is recorded with its error (at every batch size) and the next one runs: one drafter
    that SGLang cannot load must not cost the measurements of the others. A failing baseline still raises.
    A variant in ``done`` is not run again: its recorded rounds are used (``on_variant`` records them)."""
    sizes = list(per_bs)
    first = per_bs[sizes[0]]
    names = [(v.name, v.spec, v.ceiling, v.drafter, v.plan) for v in first]
    names += [(BASELINE + "_end", None, False, None, None)] if drift_check else []
    ends = {bs: VariantStats(BASELINE + "_end", None) for bs in sizes}
    bar = _bar(len(names) * repeats * len(sizes), progress, "bench sglang")
    for i, (vname, spec, ceiling, label, plan) in enumerate(names):
        recorded = (done or {}).get(vname)
        if recorded is not None and all(bs in recorded for bs in sizes):
            for bs in sizes:
                v = ends[bs] if i >= len(per_bs[bs]) else per_bs[bs][i]
                v.rounds = [run_from_record(r) for r in recorded[bs]]
            bar.update(repeats * len(sizes))
            continue
        eng = None
        try:
            if plan is not None:
                eng = factory(None, drafters[label], plan=plan)
            else:
                eng = factory(spec, None if spec is None else drafters[label])
            # the engine starts lazily: start it now, inside the environment its scheduler process must inherit
            with _environment(CEILING_ENV, str(spec.num_draft_tokens) if ceiling else None):
                eng.generate_ids(at[sizes[0]][:1], SamplingParams(max_new_tokens=1))
            for bs in sizes:
                v = ends[bs] if i >= len(per_bs[bs]) else per_bs[bs][i]
                run = sglang_runner(eng, bs)
                for _ in range(warmup):
                    run(at[bs][:bs], sampling)
                for _ in range(repeats):
                    v.rounds.append(run(at[bs], sampling))
                    bar.update(1)
            if on_variant is not None:
                on_variant(vname, {bs: [run_record(r) for r in (ends[bs] if i >= len(per_bs[bs])
                                                                else per_bs[bs][i]).rounds] for bs in sizes})
        except Exception as e:  # noqa: BLE001 - recorded in the report; the baseline's failure is raised below
            if i == 0:
                raise
            for bs in sizes:
                v = ends[bs] if i >= len(per_bs[bs]) else per_bs[bs][i]
                v.rounds.clear()
                v.error = f"{type(e).__name__}: {e}"[:2000]
            bar.update(repeats * len(sizes))
        finally:
            if eng is not None:
                eng.close()
    bar.close()
    for bs in sizes:
        if ends[bs].rounds:
            per_bs[bs][0].rounds_end = ends[bs].rounds  # type: ignore[attr-defined]


def run_record(r: _Run) -> dict[str, Any]:
    """What a resumed run needs of a round (its tokens are not kept: a resumed variant has no greedy-match check)."""
    return {"seconds": r.seconds, "completion_tokens": r.completion_tokens, "verify_steps": r.verify_steps,
            "accepted": r.accepted, "per_prompt": [list(x) for x in r.per_prompt]}


def run_from_record(d: Mapping[str, Any]) -> _Run:
    return _Run([], float(d["seconds"]), int(d["completion_tokens"]), int(d["verify_steps"]), int(d["accepted"]),
                per_prompt=[(int(a), int(b)) for a, b in d.get("per_prompt", [])])


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in os.environ for the block (nothing when value is None), restored afterwards."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # minimal GPU images: no progress bar, same results
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled)
