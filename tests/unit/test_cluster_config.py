"""cluster.yaml and configs/serve-deploy.yaml, validated offline against Ray's own schemas, plus the operational
invariants they must keep (CPU-only head, 8-GPU workers, fixed metrics port, loopback dashboard, gpu extra)."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from eaglenest.ray_private import PROXY_CALLBACK_ENV
from eaglenest.serve.arrival import PROXY_CALLBACK

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster.yaml"
SERVE_DEPLOY = REPO / "configs" / "serve-deploy.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


@pytest.fixture(scope="module")
def prepared(raw) -> dict:
    """The config as `ray up` sees it: provider defaults merged, setup commands merged per node kind."""
    from eaglenest.ray_private import autoscaler_config_tools

    prepare_config, validate_config = autoscaler_config_tools()

    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)  # raises on any schema violation
    return cfg


def _head(cfg: dict) -> dict:
    return cfg["available_node_types"][cfg["head_node_type"]]


def _gpu_types(cfg: dict) -> dict[str, dict]:
    return {k: v for k, v in cfg["available_node_types"].items() if v["resources"].get("GPU", 0) > 0}


def _start_flags(commands: list[str]) -> list[str]:
    return [tok for c in commands for tok in shlex.split(c.replace(";", " ; "))]


def test_cluster_yaml_passes_rays_schema(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["cluster_synced_files"] == []  # filled by prepare_config: the config was really prepared


def test_schema_validation_is_real(raw):
    """The same validator rejects a malformed resource count, so the check above can fail."""
    from eaglenest.ray_private import autoscaler_config_tools

    prepare_config, validate_config = autoscaler_config_tools()

    bad = copy.deepcopy(raw)
    next(iter(_gpu_types(bad).values()))["resources"]["GPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


def test_head_runs_no_gpu_work(prepared):
    head = _head(prepared)
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"].get("CPU") == 0, "head must advertise CPU 0 so no task or actor is scheduled on it"
    assert head["max_workers"] == 0
    assert not re.match(r"^(p|g)\d", head["node_config"]["InstanceType"]), "head must be a CPU instance"


def test_worker_type_has_8_gpus_for_tp8(prepared):
    gpu = _gpu_types(prepared)
    assert len(gpu) == 1, gpu.keys()
    ((_name, node),) = gpu.items()
    assert node["resources"]["GPU"] == 8
    assert node["node_config"]["InstanceType"] == "p5en.48xlarge"  # 8 x H200
    assert node["max_workers"] >= 1 and prepared["max_workers"] >= node["max_workers"]


def test_metrics_port_fixed_and_dashboard_on_loopback(prepared):
    head = _start_flags(prepared["head_start_ray_commands"])
    worker = _start_flags(prepared["worker_start_ray_commands"])
    assert "--metrics-export-port=8080" in head and "--metrics-export-port=8080" in worker
    assert "--dashboard-host=127.0.0.1" in head
    for cmds in (prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]):
        assert any("RAY_AUTH_MODE=token" in c for c in cmds), "token auth on every node"
        assert any(f"{PROXY_CALLBACK_ENV}={PROXY_CALLBACK}" in c for c in cmds), "proxies stamp arrivals (TTFT)"
    assert prepared["file_mounts"].get("/home/ray/.ray/auth_token") == "~/.ray/auth_token"


@pytest.mark.parametrize("doc", ["README.md", "docs/OPERATIONS.md"])
def test_every_documented_ray_start_sets_the_proxy_callback(doc):
    """A Ray started as the docs say stamps arrivals at Serve's proxies, as cluster.yaml's does: without the
    callback a served model's TTFT starts at the handler and the queue histogram stays empty."""
    starts = [line for block in re.findall(r"```[a-z]*\n(.*?)```", (REPO / doc).read_text(), re.S)
              for line in block.replace("\\\n", " ").splitlines()
              if re.search(r"(^|\s)ray start\b", line.split("#")[0])]
    assert starts, f"{doc} shows no ray start"
    for line in starts:
        assert f"{PROXY_CALLBACK_ENV}={PROXY_CALLBACK}" in line, line


def _scalars(node) -> list[str]:
    """Every key and value of a parsed YAML document, as text (commands included, comments not)."""
    if isinstance(node, dict):
        return [str(k) for k in node] + [s for v in node.values() for s in _scalars(v)]
    if isinstance(node, list):
        return [s for v in node for s in _scalars(v)]
    return [str(node)]


def test_no_value_binds_all_interfaces(raw):
    values = _scalars(raw)
    assert any("--dashboard-host" in v for v in values), "the walk reaches the head's start command"
    assert not [v for v in values if "0.0.0.0" in v]


def test_every_node_installs_eaglenest_with_gpu_extra(prepared):
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" in extras and any(d.startswith("sglang") for d in extras["gpu"])
    mount = next(remote for remote, local in prepared["file_mounts"].items() if local == ".")
    for kind in ("head_setup_commands", "worker_setup_commands"):
        installs = [c for c in prepared[kind] if "pip install" in c and f"{mount}[gpu]" in c]
        assert installs, f"{kind} must pip install {mount}[gpu]"


def test_prometheus_on_head_uses_repo_monitoring_config(prepared):
    start = " ".join(prepared["head_start_ray_commands"])
    m = re.search(r"--config\.file=(\S+)", start)
    assert m and m.group(1) == "/home/ray/eaglenest/monitoring/prometheus.yml"
    assert (REPO / "monitoring" / "prometheus.yml").is_file()
    assert "--web.listen-address=127.0.0.1:9090" in start


# ---------------------------------------------------------------------------------------- serve deploy config
@pytest.fixture(scope="module")
def serve_deploy() -> dict:
    return yaml.safe_load(SERVE_DEPLOY.read_text())


def test_serve_deploy_config_passes_rays_schema(serve_deploy):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_deploy)
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000
    (app,) = schema.applications
    assert app.import_path == "eaglenest.serve.app:build_app"
    assert app.args == {"config": "configs/demo.yaml"}
    assert (REPO / app.args["config"]).is_file()
    assert not app.runtime_env  # no local working_dir: Serve configs reject it


def test_serve_deploy_schema_rejects_local_working_dir(serve_deploy):
    """Why the file ships no working_dir (reference ray.md §1.9): the schema refuses a local folder."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    bad = copy.deepcopy(serve_deploy)
    bad["applications"][0]["runtime_env"] = {"working_dir": "."}
    with pytest.raises(ValidationError, match="remote URIs"):
        ServeDeploySchema.model_validate(bad)
