"""Every private Ray API eaglenest uses is listed in eaglenest/ray_private.py and still exists in the installed Ray.

A Ray upgrade that renames or removes one fails here, naming it, instead of deep inside a regen, train or serve run.
No Ray instance is started: only modules are imported and signatures read.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from eaglenest import ray_private

ROOT = Path(__file__).resolve().parents[2]


def test_each_private_api_is_there() -> None:
    import ray

    assert "addr" in inspect.signature(
        __import__("ray._private.services", fromlist=["x"]).canonicalize_bootstrap_address).parameters
    assert "http_options" in inspect.signature(
        __import__("ray.serve._private.api", fromlist=["x"]).serve_start).parameters
    get, put, delete, keys = ray_private.internal_kv()
    for fn, arg in ((get, "namespace"), (put, "namespace"), (delete, "namespace"), (keys, "namespace")):
        assert arg in inspect.signature(fn).parameters, fn
    assert ray._config.metrics_report_interval_ms() > 0
    from ray._private import state

    for fn in (state.jobs, state.actors):
        assert callable(fn), fn
    prepare, validate = ray_private.autoscaler_config_tools()
    assert callable(prepare) and callable(validate)
    from ray.data import DataContext

    for name in ray_private.DATA_CONTEXT_INTERNAL_FIELDS:
        assert hasattr(DataContext.get_current(), name), name


def test_serve_reads_the_proxy_callback_we_set() -> None:
    """Every Serve proxy imports ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` at start and wraps its app in what the
    callback returns (serve.arrival); Ray's own loader and validator accept ours."""
    from ray.serve._private import constants, http_util
    from ray.serve._private.utils import call_function_from_import_path

    from eaglenest.serve.arrival import PROXY_CALLBACK, StampArrival

    assert f'"{ray_private.PROXY_CALLBACK_ENV}"' in inspect.getsource(constants)
    assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" in inspect.getsource(http_util.configure_http_middlewares)
    middlewares = http_util.validate_http_proxy_callback_return(call_function_from_import_path(PROXY_CALLBACK))
    assert [m.cls for m in middlewares] == [StampArrival]


def test_job_stop_grace_is_read_where_we_expect() -> None:
    """`ray job stop`: the supervisor SIGKILLs the entrypoint RAY_JOB_STOP_WAIT_TIME_S (from the job's runtime env,
    an integer, 3 by default) after the stop signal; the entrypoint's environment carries RAY_JOB_CONFIG_JSON_ENV_VAR
    (serve.supervise.job_stop_warning reads both)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.dashboard.modules.job import job_supervisor

    source = inspect.getsource(job_supervisor)
    assert f'"{ray_private.JOB_STOP_WAIT_ENV}"' in source
    assert job_supervisor.JobSupervisor.DEFAULT_RAY_JOB_STOP_WAIT_TIME_S == ray_private.JOB_STOP_WAIT_DEFAULT_S
    assert RAY_JOB_CONFIG_JSON_ENV_VAR == ray_private.JOB_DRIVER_ENV
    assert "RAY_JOB_CONFIG_JSON_ENV_VAR" in inspect.getsource(job_supervisor.JobSupervisor._get_driver_env_vars)


def test_trainer_class_drops_the_placement_group_cleaner() -> None:
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.data_parallel_trainer import PlacementGroupCleanerCallback  # noqa: F401 - must exist

    assert hasattr(TorchTrainer, "_create_default_callbacks")
    assert issubclass(ray_private.trainer_class(), TorchTrainer)


def test_worker_niceness_is_a_system_config_option() -> None:
    """Ray checks ``_system_config`` keys when it starts (an unknown key raises): `eaglenest serve` tests start it."""
    assert ray_private.worker_niceness_option(0) == {"_system_config": {"worker_niceness": 0}}


def _private_ray_uses(path: Path) -> list[str]:
    """``ray._x`` / ``ray.<pkg>._x`` imports and attribute chains in one file."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            if any(p.startswith("_") for p in node.module.split(".")) or node.module.startswith("ray.experimental"):
                found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, n = [node.attr], node.value
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id == "ray":
                found.append(".".join(["ray", *reversed(chain)]))
    return found


@pytest.mark.parametrize("folder", ["eaglenest", "benchmarks", "tests", "tools"])
def test_private_ray_apis_are_reached_only_through_ray_private(folder: str) -> None:
    offenders = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.name == "ray_private.py" or "sglang_shims" in path.parts or path.name == Path(__file__).name:
            continue
        uses = _private_ray_uses(path)
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert offenders == {}, f"private Ray APIs used outside eaglenest/ray_private.py: {offenders}"
