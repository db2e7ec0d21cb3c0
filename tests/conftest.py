"""Shared fixtures: the tiny target (built once, cached), its engine, and one Ray session for the whole run.

Tests live in three tiers, one folder each: tests/unit (no Ray, no tiny target, no subprocess, no training; the
inner loop, `make test-unit`), tests/component (the tiny target in-process), tests/e2e (Ray, Ray Serve,
subprocesses, promtool, CLI jobs). Each test gets its tier's marker (`-m unit`, `-m "not e2e"`); `slow` is kept as
the e2e tier's other name. A unit test that asks for a heavy fixture fails at setup, naming the tier to move it to.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eaglenest.serve.cli import RAY_ENV_DEFAULTS  # light: Ray is imported later, after the environment is set

for _k, _v in RAY_ENV_DEFAULTS.items():  # loopback Ray, no auth or usage stats, Serve's throughput settings
    os.environ.setdefault(_k, _v)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TIERS = ("unit", "component", "e2e")
# fixtures a unit test may not use, and the tier that provides what they need
HEAVY_FIXTURES = {"tiny_target_path": "component", "tiny_engine": "component", "ray_session": "e2e"}


def _tier(item: pytest.Item) -> str | None:
    parts = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier:
            item.add_marker(tier)
            if tier == "e2e":
                item.add_marker("slow")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _tier(item) == "unit":
        heavy = sorted(f for f in getattr(item, "fixturenames", ()) if f in HEAVY_FIXTURES)
        if heavy:
            pytest.fail(f"{item.nodeid} uses {', '.join(heavy)}: move it to tests/{HEAVY_FIXTURES[heavy[0]]}/ "
                        "(tests/unit has no tiny target and no Ray)", pytrace=False)


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
