"""Configuration: pydantic models for every stage, loaded from one YAML file.

One file may hold every section (``configs/demo.yaml``). Unknown keys and invalid values fail with a
``ConfigError`` that names the file, the dotted key and what is allowed. ``stages`` holds the target's and the
offline stages' sections, ``serving`` what runs the drafter (bench, tune, serve), ``root`` the whole file and its
loading.
"""

from eaglenest.config.base import ConfigError, Section, default_cache_dir
from eaglenest.config.root import EaglenestConfig, load_config
from eaglenest.config.serving import BenchConfig, RouteConfig, ServeConfig, SpecConfig, TrafficLogConfig, TuneConfig
from eaglenest.config.stages import (
    DrafterConfig,
    MixData,
    PlanConfig,
    RegenConfig,
    SamplingConfig,
    SGLangEngineConfig,
    SourceConfig,
    TargetConfig,
    TinyTargetSpec,
    TrainConfig,
)

__all__ = [
    "BenchConfig", "ConfigError", "DrafterConfig", "EaglenestConfig", "MixData", "PlanConfig", "RegenConfig",
    "SamplingConfig", "SGLangEngineConfig", "Section", "ServeConfig", "SourceConfig", "SpecConfig", "TargetConfig",
    "RouteConfig", "TinyTargetSpec", "TrafficLogConfig", "TrainConfig", "TuneConfig", "default_cache_dir",
    "load_config",
]
