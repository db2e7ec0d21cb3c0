"""One tune from prompts to the schedule's files, on the serving engine: what ``eaglenest tune`` runs, and what the
flywheel runs for a drafter it promotes (a schedule is bound to its drafter's weights, so a new drafter needs its own).

``tune_to_folder`` writes ``measurements.jsonl`` (resumable), ``schedule.json``, ``schedule.md``, ``schedule.png`` and,
with ``verify``, ``verify/bench-sweep.*``. ``settings_of`` reads back the settings a schedule was measured with, so a
re-tune measures a new drafter the way the live one was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig, TargetConfig
from eaglenest.speculative.schedule import Schedule
from eaglenest.speculative.tune import TuneSettings


@dataclass
class TuneOutcome:
    """What one tune wrote."""

    schedule: Schedule
    path: Path
    verify_reports: list[dict[str, Any]] | None = None


def engine_options(engine: str) -> dict[str, Any]:
    """Engine settings every measurement assumes (recorded in the schedule): SGLang skips the zero-step draft
    extend, which serve's launches set too."""
    return {"skip_zero_step_draft_extend": True} if engine == "sglang" else {}


def settings_of(schedule: Schedule) -> TuneSettings:
    """The settings ``schedule`` was measured with (``dataclasses.replace`` its ``prompts`` where that file is not
    on this machine). Raises ``ValueError`` naming the fix when the schedule does not record them."""
    recorded = schedule.settings or {}
    names = [f.name for f in fields(TuneSettings)]
    missing = [n for n in names if n not in recorded and n not in ("prompts", "engine_options")]
    if missing:
        raise ValueError(f"the schedule does not record how it was tuned (no {', '.join(missing)}): tune the live "
                         "drafter again with `eaglenest tune` so a new drafter can be measured the same way")
    return TuneSettings(**{n: recorded[n] for n in names if n in recorded})


def tune_to_folder(cfg: EaglenestConfig, tc: TargetConfig, settings: TuneSettings, drafter: str | Path, out: Path,
                   *, verify: bool = False, progress: bool = True) -> TuneOutcome:
    """Measure ``settings`` for ``drafter`` on ``tc``'s engine and write the schedule into ``out``.

    Raises ``PromptFileError`` (the prompt file) and ``TuneError`` (measurements of another tune in ``out``)."""
    from eaglenest.speculative.evaluate import load_prompts, prompt_ids
    from eaglenest.speculative.identity import serving_identity
    from eaglenest.speculative.schedule_plot import plot_schedule, schedule_markdown
    from eaglenest.speculative.tune import MEASUREMENTS, Measurements, run_tune, schedule_from, verify_schedule

    drafter = str(drafter)
    records = load_prompts(settings.prompts, None)
    identity = serving_identity(tc, drafter)
    log = Measurements(out / MEASUREMENTS, identity, settings)
    factory = target = None
    if tc.engine == "hf":
        import torch

        from eaglenest.engines.hf import HFEngine

        torch.set_num_threads(tc.cpu_threads or 1)  # as serve runs it (the schedule records the thread count)
        target = HFEngine.from_config(tc)
        prompts = [prompt_ids(target.tokenizer, r) for r in records]
        run_tune("hf", target, drafter, prompts, settings, log, progress=progress)
    else:
        from eaglenest.engines.sglang.engine import SGLangEngine
        from eaglenest.speculative.sglang_variants import sglang_factory

        probe = SGLangEngine(tc)  # tokenizer only; the engine starts lazily
        prompts = [prompt_ids(probe.tokenizer, r) for r in records]
        factory = sglang_factory(tc, (1, max(settings.batch_sizes)), cfg.serve)
        run_tune("sglang", None, drafter, prompts, settings, log, sglang_factory=factory, progress=progress,
                 drift_check=not verify)  # with verify the baseline's second run comes after the schedule's
    schedule = schedule_from(log, identity, settings)
    reports = None
    if verify:
        from eaglenest.speculative.bench_report import write_sweep

        reports = verify_schedule(tc.engine, target, drafter, prompts, settings, log, schedule,
                                  sglang_factory=factory, progress=progress)
        write_sweep(reports, out / "verify")
        schedule = schedule_from(log, identity, settings)  # the same choices, now with the drift check's result
    path = schedule.save(out / "schedule.json")
    (out / "schedule.md").write_text(schedule_markdown(schedule))
    plot_schedule(schedule, out / "schedule.png")
    return TuneOutcome(schedule, Path(path), reports)


__all__ = ["TuneOutcome", "engine_options", "settings_of", "tune_to_folder"]
