"""The whole file: every section under one root, and loading it with errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from eaglenest.config.base import ConfigError, Section
from eaglenest.config.serving import BenchConfig, ServeConfig, TuneConfig
from eaglenest.config.stages import PlanConfig, RegenConfig, TargetConfig, TrainConfig


# ------------------------------------------------------------------------------------------------------------ root
class EaglenestConfig(Section):
    """Every stage's section; each is optional in the file and defaults sensibly."""

    target: TargetConfig = Field(default_factory=TargetConfig)
    regen: RegenConfig = Field(default_factory=RegenConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    flywheel: dict[str, Any] = Field(default_factory=dict, description="eaglenest flywheel / promote (validated "
                                     "there: eaglenest.flywheel.settings)")
    base_dir: str = Field(".", description="set by load_config: relative paths in the file resolve against it")

    @field_validator("base_dir")
    @classmethod
    def _abs(cls, v: str) -> str:
        return str(Path(v).resolve())

    def resolve(self, path: str | None) -> str | None:
        """A path from the config file, resolved against the file's folder."""
        if path is None:
            return None
        p = Path(path).expanduser()
        return str(p if p.is_absolute() else Path(self.base_dir) / p)


def _format_errors(path: str, err: ValidationError) -> str:
    lines = [f"invalid config {path}:"]
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = e["loc"][:-1]
            lines.append(f"  {key}: unknown key; allowed here: {', '.join(_allowed_keys(parent))}")
        else:
            allowed = ""
            ctx = e.get("ctx") or {}
            if "expected" in ctx:
                allowed = f" (allowed: {ctx['expected']})"
            lines.append(f"  {key}: {e['msg']}{allowed} (got {e.get('input')!r})")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = EaglenestConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        inner = _model_in(ann)
        if inner is None:
            return []
        model = inner
    return sorted(k for k in model.model_fields if k != "base_dir")


def _model_in(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for a in getattr(ann, "__args__", ()) or ():
        m = _model_in(a)
        if m is not None:
            return m
    return None


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> EaglenestConfig:
    """Load and validate a config file (None = all defaults); ``sources_file`` is merged into ``regen.sources``."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
        base = p.resolve().parent
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    data["base_dir"] = str(base)
    regen = data.get("regen") or {}
    if isinstance(regen, dict) and regen.get("sources_file"):
        sf = Path(regen["sources_file"])
        sf = sf if sf.is_absolute() else base / sf
        if not sf.is_file():
            raise ConfigError(f"invalid config {path}: regen.sources_file {sf} does not exist")
        extra = yaml.safe_load(sf.read_text()) or {}
        if not isinstance(extra, dict) or not isinstance(extra.get("sources"), list):
            raise ConfigError(f"invalid config {sf}: expected a top-level 'sources' list")
        # sources listed in the sources file resolve their paths against that file's folder
        for s in extra["sources"]:
            if isinstance(s, dict) and s.get("path") and not Path(s["path"]).is_absolute():
                s["path"] = str((sf.parent / s["path"]).resolve())
        regen = dict(regen)
        regen["sources"] = list(regen.get("sources") or []) + extra["sources"]
        data["regen"] = regen
    try:
        return EaglenestConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(str(path), e)) from None
