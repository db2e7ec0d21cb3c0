"""Monitoring files: Prometheus rules and config (checked and unit-tested by promtool), the metric-name contract
between the alerts/dashboard and the code that emits the metrics, and the Grafana dashboard's structure."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.contracts.metrics import exported_series

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "monitoring"
ALERTS = MON / "alerts.yml"
ALERTS_TEST = MON / "alerts_test.yml"
PROM_CONFIG = MON / "prometheus.yml"
DASHBOARD = MON / "grafana-dashboard.json"
OPERATIONS = REPO / "docs" / "OPERATIONS.md"
SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"

# The metric contract (eaglenest.contracts.metrics): every series Prometheus can scrape from us as Ray exports it
# (`ray_` prefix, `_total` for counters, `_bucket/_sum/_count` for histograms), plus Ray Serve's own series the alerts
# use. tests/unit/test_metrics_contract.py checks that the code creates exactly these metrics.
EXPORTED = exported_series()

REQUIRED_ALERTS = {
    "EaglenestAcceptLengthCollapsed",
    "EaglenestSpeculationSlowerThanBaseline",
    "EaglenestServeErrorRatioHigh",
    "EaglenestTTFTHigh",
    "EaglenestReplicaUnhealthy",
    "EaglenestRegenStalled",
    "EaglenestRegenQuarantineRatioHigh",
    "EaglenestTrainLossNotFinite",
    "RayMetricsTargetDown",
}
# alerts whose tests must also show them silent on healthy/idle series (an explicit `exp_alerts: []`)
MUST_STAY_SILENT = {
    "EaglenestAcceptLengthCollapsed",
    "EaglenestSpeculationSlowerThanBaseline",
    "EaglenestReplicaUnhealthy",
    "EaglenestRegenStalled",
    "EaglenestTrainLossNotFinite",
    "RayMetricsTargetDown",
}


# ------------------------------------------------------------------------------------------------ helpers
def _promtool() -> str:
    """promtool's path; a missing promtool skips locally but fails in CI (CI=true), where .ci/run installs it."""
    path = shutil.which("promtool")
    if path:
        return path
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("promtool is missing in CI: .ci/run must run `bash .ci/promtool.sh install-only` first")
    pytest.skip("promtool not installed (bash .ci/promtool.sh install-only, or apt-get install prometheus)")


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)


def _rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


_PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
_PROMQL_WORDS |= {"offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (strings, label matchers, ranges and grouping lists removed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_.:$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("("):  # a function or an aggregation
            continue
        if m.group(0).lower() in _PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def _dashboard_builder():
    spec = importlib.util.spec_from_file_location("eaglenest_build_dashboard", MON / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


# ------------------------------------------------------------------------------------------------ promtool
def test_promtool_check_rules():
    r = _run(_promtool(), "check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_promtool_check_config_with_ray_service_discovery(tmp_path):
    """The config parses, loads alerts.yml, and reads a service-discovery file in Ray's format.

    Ray's file exists only where a head runs, so the real path is checked for syntax and the full check runs on a
    copy pointed at a file written the way ray/_private/metrics_agent.py writes it.
    """
    promtool = _promtool()
    r = _run(promtool, "check", "config", "--syntax-only", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    text = PROM_CONFIG.read_text()
    assert SD_FILE in text, "prometheus.yml must scrape Ray's service-discovery file"
    sd = tmp_path / "prom_metrics_service_discovery.json"
    sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ["10.0.0.5:8080", "10.0.0.6:8080"]}]))
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(text.replace(SD_FILE, str(sd)))
    r = _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"{len(_rules())} rules found" in r.stdout
    # and a broken service-discovery file is caught (the check is not a no-op)
    sd.write_text("{not json")
    assert _run(promtool, "check", "config", str(tmp_path / "prometheus.yml")).returncode != 0


def test_promtool_unit_tests_pass():
    r = _run(_promtool(), "test", "rules", ALERTS_TEST.name, cwd=MON)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path):
    """Dropping the traffic condition from the collapse alert must make the rule tests fail."""
    promtool = _promtool()
    broken = ALERTS.read_text().replace(
        "            unless on (model) (sum by (model) (rate(ray_eaglenest_serve_accept_length_count[5m])) > 0)\n", ""
    )
    assert broken != ALERTS.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yml")
    r = _run(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert r.returncode != 0 and "EaglenestAcceptLengthCollapsed" in r.stdout + r.stderr, r.stdout + r.stderr


def test_dashboard_queries_are_valid_promql(tmp_path):
    """Every dashboard query parses (fed to promtool as recording rules, Grafana's $__rate_interval as 5m)."""
    promtool = _promtool()
    rules = [
        {"record": f"dashboard:q{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(_dashboard_exprs())
    ]
    f = tmp_path / "dashboard_rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _run(promtool, "check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ rule content
def test_every_alert_is_documented_and_labelled():
    names = [r["alert"] for r in _rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS, f"missing alerts: {sorted(REQUIRED_ALERTS - set(names))}"
    headings = {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", OPERATIONS.read_text(), re.M)}
    for r in _rules():
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["labels"].get("component"), r["alert"]
        ann = r["annotations"]
        assert len(ann.get("summary", "")) > 40, f"{r['alert']}: summary must say what to check"
        assert len(ann.get("description", "")) > 80, f"{r['alert']}: description must say how to confirm and fix"
        doc, _, anchor = ann["runbook"].partition("#")
        assert doc == "docs/OPERATIONS.md" and anchor in headings, f"{r['alert']}: runbook {ann['runbook']} missing"
    collapsed = next(r for r in _rules() if r["alert"] == "EaglenestAcceptLengthCollapsed")
    assert "EAGLE3" in collapsed["annotations"]["summary"]
    assert "eaglenest preflight" in collapsed["annotations"]["summary"]


def test_every_alert_has_a_firing_test_and_key_ones_a_silent_test():
    doc = yaml.safe_load(ALERTS_TEST.read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    fired, silent = set(), set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {r["alert"] for r in _rules()}
    assert fired == names, f"alerts never shown firing: {sorted(names - fired)}"
    assert silent >= MUST_STAY_SILENT, f"no silent-case test for: {sorted(MUST_STAY_SILENT - silent)}"


def test_metric_name_extraction():
    """The extractor used below finds real selectors and ignores functions, labels, keywords and durations."""
    expr = (
        'sum by (model) (rate(ray_eaglenest_serve_accept_length_sum{status=~"5.."}[5m])) / on () '
        "count_over_time(max(up)[30m:1m]) > 1e-9 and abs(ray_x) == Inf unless ray_y offset 5m"
    )
    assert metric_names(expr) == {"ray_eaglenest_serve_accept_length_sum", "up", "ray_x", "ray_y"}


def test_alerts_reference_only_metrics_of_the_contract():
    for r in _rules():
        unknown = metric_names(r["expr"]) - EXPORTED
        assert not unknown, f"{r['alert']} references metrics no component emits: {sorted(unknown)}"
    # a renamed metric is caught
    assert metric_names("rate(ray_eaglenest_serve_acceptance_sum[5m])") - EXPORTED


def test_dashboard_references_only_metrics_of_the_contract():
    for title, expr in _dashboard_exprs():
        unknown = metric_names(expr) - EXPORTED - {"ALERTS"}
        assert not unknown, f"dashboard panel {title!r} references unknown metrics: {sorted(unknown)}"


# ------------------------------------------------------------------------------------------------ dashboard
def test_dashboard_json_is_built_from_its_script():
    assert DASHBOARD.read_text() == _dashboard_builder().render(), "run: python monitoring/build_dashboard.py"


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, key
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    ds_vars = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds_vars and ds_vars[0]["query"] == "prometheus"
    ds_ref = "${" + ds_vars[0]["name"] + "}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat"}, p["type"]
        assert p["datasource"]["uid"] == ds_ref and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
    text = " ".join(e for _, e in _dashboard_exprs())
    for metric in (
        "accept_length",
        "speedup_vs_baseline",
        "serve_tokens_per_second",
        "ttft_seconds_bucket",
        "queue_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "ray_serve_num_http_error_requests_total",
        "regen_samples_done_total",
        "regen_eta_seconds",
        "regen_samples_quarantined_total",
        "train_loss",
        "train_acc0",
    ):
        assert metric in text, f"dashboard has no panel for {metric}"
