"""The ``flywheel:`` section of an eaglenest config: one turn's data, the gate's thresholds, the post-swap watch.

It sits in the serving config (the turn needs its ``target``, ``serve`` and ``train`` sections too) and is checked
here, by the commands that use it (``eaglenest flywheel``, ``eaglenest promote``): unknown keys and invalid values
are refused with the dotted key and what is allowed, as ``load_config`` does for the other sections.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eaglenest.config import ConfigError, EaglenestConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WatchSettings(_Section):
    """After a swap: the new drafter's live accept length against the previous drafter's recent level."""

    requests: int = Field(64, ge=1, description="new-drafter requests that drafted before the verdict")
    timeout_s: float = Field(900, gt=0, description="at most this long; fewer requests by then: verdict on those")
    min_requests: int = Field(8, ge=1, description="fewer than this at the timeout: inconclusive, the swap stays")
    tolerance: float = Field(0.05, ge=0, lt=1, description="live may fall this much (relative) below the previous "
                             "drafter's recent level, or the gate's prediction without one, before a rollback")
    poll_s: float = Field(2.0, gt=0)


class FlywheelConfig(_Section):
    """``flywheel:``: where a turn's files go, the mix, the gate and the watch."""

    workdir: str = Field("out/flywheel", description="turns, staged drafters, state.json, audit.jsonl")
    app: str = Field("eaglenest", description="the Ray Serve application whose drafter is swapped")
    route_prefix: str = Field("/", description="its route prefix")
    url: str | None = Field(None, description="its base URL (default http://serve.host:serve.port + route_prefix)")
    traffic: str | None = Field(None, description="traffic log folder (default serve.traffic_log.path)")
    original_data: str | None = Field(None, description="regen folder of the live drafter's training data, mixed in "
                                      "(unset: traffic only)")
    traffic_share: float = Field(0.5, gt=0, le=1, description="share of the training rows that are traffic")
    min_traffic_samples: int = Field(64, ge=2, description="new traffic records a turn needs (fewer: it waits)")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="the newest share of a turn's traffic, kept for "
                                    "the gate and never trained on")
    max_heldout: int = Field(64, ge=1, description="held-out traffic prompts the gate decodes")
    regression_prompts: str | None = Field(None, description="fixed prompts the candidate must not lose on "
                                           "(default bench.prompts: the original held-out prompts)")
    max_regression: int = Field(64, ge=1)
    max_new_tokens: int = Field(64, ge=1, description="tokens per prompt when the gate measures accept length")
    margin: float = Field(0.03, ge=0, description="the candidate must beat the live drafter on held-out traffic by "
                          "this much (relative)")
    tolerance: float = Field(0.02, ge=0, lt=1, description="and lose by no more than this (relative) on any prompt "
                             "set or domain")
    select_checkpoints: bool = Field(True, description="choose the checkpoint by held-out accept length measured "
                                     "with the target (not by loss), among those that keep the regression set")
    select_max_prompts: int = Field(32, ge=1, description="prompts of the training run's held-out split decoded per "
                                    "checkpoint")
    retune: bool = Field(True, description="where the application serves serve.schedule: tune each promoted "
                         "drafter as the live schedule was tuned and swap drafter and schedule together (refused "
                         "when its schedule gains less than the live one anywhere); false: refuse to swap")
    retune_prompts: str | None = Field(None, description="prompts the re-tune decodes (default: the live "
                                       "schedule's own, else tune.prompts, else bench.prompts)")
    surge_percent: int = Field(100, ge=1, le=100, description="Ray Serve's max_surge_percent during a swap")
    watch: WatchSettings = Field(default_factory=WatchSettings)
    alert_webhook: str | None = Field(None, description="URL a rollback is POSTed to (JSON), e.g. an Alertmanager "
                                      "or chat webhook; the rollback counter alerts through Prometheus as well")
    every_s: float | None = Field(None, gt=0, description="eaglenest flywheel without --once: seconds between turns")


def flywheel_settings(cfg: EaglenestConfig, source: str = "the config") -> FlywheelConfig:
    """The validated ``flywheel:`` section of ``cfg`` (defaults for what it leaves out)."""
    try:
        return FlywheelConfig.model_validate(cfg.flywheel)
    except ValidationError as e:
        lines = [f"invalid config {source}:"]
        for err in e.errors():
            key = ".".join(["flywheel", *(str(x) for x in err["loc"])])
            if err["type"] == "extra_forbidden":
                lines.append(f"  {key}: unknown key; allowed here: {', '.join(_allowed(err['loc'][:-1]))}")
            else:
                lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None


def _allowed(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = FlywheelConfig
    for part in loc:
        ann = model.model_fields[str(part)].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
    return sorted(model.model_fields)


__all__ = ["FlywheelConfig", "WatchSettings", "flywheel_settings"]
