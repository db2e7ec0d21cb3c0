"""Shared fixtures: the tiny target (built once, cached), its engine, and one Ray session for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eaglenest.serve.cli import RAY_ENV_DEFAULTS  # light: Ray is imported later, after the environment is set

for _k, _v in RAY_ENV_DEFAULTS.items():  # loopback Ray, no auth or usage stats, Serve's throughput settings
    os.environ.setdefault(_k, _v)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_target_path() -> Path:
    from eaglenest.engines.tiny import ensure_tiny_target

    return ensure_tiny_target()


@pytest.fixture(scope="session")
def tiny_engine(tiny_target_path):
    from eaglenest.config import TargetConfig
    from eaglenest.engines.hf import HFEngine

    return HFEngine.from_config(TargetConfig(model=str(tiny_target_path), device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test that needs it (starting Ray costs ~10 s on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
