#!/usr/bin/env bash
# Validate the monitoring files with Prometheus' own tool:
#   promtool check rules monitoring/alerts.yml        (syntax, PromQL, templates)
#   promtool check config monitoring/prometheus.yml   (scrape config + the rule files it loads)
#   promtool test rules monitoring/alerts_test.yml    (every alert fires on broken series, stays silent on healthy)
# Installs Debian's `prometheus` package (which ships promtool) when promtool is missing. Run from anywhere.
# `bash .ci/promtool.sh install-only` only makes sure promtool is installed (tests/e2e/test_monitoring.py runs the checks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not found: installing Debian's prometheus package"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "need root or sudo to apt-get install prometheus" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  # The package's post-install tries to start a service; in containers without an init system that is skipped.
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool --version 2>&1 | head -n 1
if [ "${1:-}" = "install-only" ]; then
  exit 0
fi

promtool check rules monitoring/alerts.yml

# check config also reads every file_sd file that exists, and warns about missing ones. Ray's service-discovery
# file exists only where a Ray head runs, and its content changes with the cluster, so: (1) check the real file's
# syntax alone, then (2) check the full config (rule files included) against a service-discovery file in Ray's
# format (ray/_private/metrics_agent.py: [{"labels": {"job": "ray"}, "targets": ["ip:port", ...]}]).
promtool check config --syntax-only monitoring/prometheus.yml
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp monitoring/alerts.yml "$tmp/"
printf '%s\n' '[{"labels": {"job": "ray"}, "targets": ["10.0.0.5:8080", "10.0.0.6:8080", "10.0.0.5:44217"]}]' \
  > "$tmp/prom_metrics_service_discovery.json"
sd_path="/tmp/ray/prom_metrics_service_discovery.json"
grep -q "$sd_path" monitoring/prometheus.yml || { echo "monitoring/prometheus.yml no longer scrapes $sd_path" >&2; exit 1; }
sed "s#$sd_path#$tmp/prom_metrics_service_discovery.json#" monitoring/prometheus.yml > "$tmp/prometheus.yml"
promtool check config "$tmp/prometheus.yml"

promtool test rules monitoring/alerts_test.yml
echo "promtool: monitoring checks passed"
