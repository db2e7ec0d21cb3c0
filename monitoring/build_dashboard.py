"""Build monitoring/grafana-dashboard.json, the eaglenest Grafana dashboard, from one readable list of panels.

The JSON is committed (import it in Grafana: Dashboards -> New -> Import, pick the Prometheus data source); this
script is its source. Edit the panels here and run ``python monitoring/build_dashboard.py``; the test suite fails
when the committed JSON and this script disagree, and checks every query with promtool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("grafana-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


@dataclass
class Q:
    """One PromQL query and its legend."""

    expr: str
    legend: str = ""


@dataclass
class P:
    """One panel: a time series by default, a stat panel with ``kind="stat"``."""

    title: str
    description: str
    queries: list[Q]
    unit: str = "short"
    width: int = 8
    kind: str = "timeseries"
    thresholds: list[tuple[str, float | None]] = field(default_factory=list)
    min: float | None = None
    max: float | None = None


@dataclass
class Row:
    title: str
    panels: list[P]


def _hist_q(metric: str, by: str, quantiles: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Q]:
    label = f"{{{{{by}}}}} " if by else ""
    group = f"le, {by}" if by else "le"
    return [
        Q(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))", f"{label}p{int(q * 100)}")
        for q in quantiles
    ]


ROWS: list[Row] = [
    Row(
        "Speculative decoding (serve)",
        [
            P(
                "Accept length",
                "Tokens produced per verify step, bonus token included: 1.0 means no draft token is accepted (the "
                "drafter is bypassed: check --speculative-algorithm EAGLE3 and run `eaglenest preflight`). Kimi-K2.5 "
                "drafters at 3/1/4 reach 2.4-3.3 in published runs.",
                [
                    Q(
                        f"sum by (model) (rate(ray_eaglenest_serve_accept_length_sum[{RATE}])) / "
                        f"sum by (model) (rate(ray_eaglenest_serve_accept_length_count[{RATE}]))",
                        "{{model}} mean",
                    ),
                    Q("max by (model) (ray_eaglenest_serve_accept_length_current)", "{{model}} current"),
                ],
                thresholds=[("red", None), ("orange", 1.05), ("green", 2.0)],
                min=1,
            ),
            P(
                "Speedup vs baseline",
                "Measured speculative tokens/s divided by the last benchmarked baseline tokens/s "
                "(serve.baseline_tokens_per_s, from `eaglenest bench`). Below 1, speculation costs more than it saves.",
                [Q("avg by (model) (ray_eaglenest_serve_speedup_vs_baseline)", "{{model}}")],
                unit="suffix:x",
                thresholds=[("red", None), ("green", 1.0)],
                min=0,
            ),
            P(
                "Tuned vs live (serve.schedule)",
                "A replica serving a tuned schedule: output tok/s now, against what `eaglenest tune` measured at the "
                "top of the live batch bucket for the baseline (no drafter) and for the bucket's configuration. Live "
                "below the tuned baseline for long means the schedule's measurement no longer holds: re-run tune.",
                [
                    Q(f"sum by (model) (rate(ray_eaglenest_serve_generated_tokens_total[{RATE}]))", "live tok/s"),
                    Q("max by (model, variant) (max by (model, bucket, variant) "
                      "(ray_eaglenest_serve_schedule_tuned_tokens_per_second) * on (model, bucket) group_left () "
                      "max by (model, bucket) (ray_eaglenest_serve_bucket_active))", "{{model}} tuned {{variant}}"),
                    Q("avg by (model, bucket) (ray_eaglenest_serve_bucket_speedup_vs_tuned_baseline)",
                      "{{model}} batch {{bucket}}: x tuned baseline"),
                ],
                unit="short",
                min=0,
            ),
            P(
                "Live speculation mode (serve.schedule)",
                "The live batch size and the num_steps its bucket runs (0 = speculation off), next to what the "
                "schedule says for every bucket; with serve.route, the requests/s each engine takes.",
                [
                    Q("max by (model) (ray_eaglenest_serve_live_batch_size)", "{{model}} live batch size"),
                    Q("max by (model) (ray_eaglenest_serve_live_num_steps)", "{{model}} live num_steps"),
                    Q("max by (model, bucket) (ray_eaglenest_serve_schedule_num_steps)",
                      "{{model}} batch {{bucket}}: scheduled num_steps"),
                    Q(f"sum by (model, engine) (rate(ray_eaglenest_serve_routed_requests_total[{RATE}]))",
                      "{{model}} routed to the {{engine}} engine (req/s)"),
                ],
                unit="short",
                min=0,
            ),
            P(
                "Draft acceptance rate",
                "Accepted / proposed draft tokens. 0 with traffic is the bypassed-drafter failure.",
                [
                    Q(
                        f"sum(rate(ray_eaglenest_serve_draft_tokens_accepted_total[{RATE}])) / "
                        f"sum(rate(ray_eaglenest_serve_draft_tokens_proposed_total[{RATE}]))",
                        "accepted / proposed",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            P(
                "Generated tokens/s",
                "Output tokens per second over all replicas: from the token counter, and as reported by the replicas.",
                [
                    Q(f"sum(rate(ray_eaglenest_serve_generated_tokens_total[{RATE}]))", "counter rate"),
                    Q("sum(ray_eaglenest_serve_tokens_per_second)", "replicas' gauge"),
                ],
                unit="suffix:tok/s",
                min=0,
            ),
            P(
                "Accept length distribution",
                "Per-request accept length quantiles (histogram).",
                _hist_q("ray_eaglenest_serve_accept_length", "", (0.1, 0.5, 0.9)),
                min=1,
            ),
            P(
                "Firing alerts",
                "Alerts from monitoring/alerts.yml that are firing now, by name and severity.",
                [Q('count by (alertname, severity) (ALERTS{alertstate="firing"})', "{{alertname}} ({{severity}})")],
                min=0,
            ),
        ],
    ),
    Row(
        "Latency and errors (serve)",
        [
            P(
                "Time to first token",
                "From the request's arrival at Ray Serve's HTTP proxy to its first token (leaving the replica, for a "
                "stream): Serve's queueing, the decoder's queue and prefill, per model. Alert: p95 > 2 s for 5 "
                "minutes.",
                _hist_q("ray_eaglenest_serve_ttft_seconds", "model"),
                unit="s",
                min=0,
            ),
            P(
                "Queue before the replica",
                "From the request's arrival at Ray Serve's HTTP proxy until its replica's handler starts: Serve's "
                "routing, and the wait while every replica is at max_ongoing_requests. The rest of TTFT is the "
                "decoder's queue and prefill. Empty when the proxies do not stamp arrivals (docs/OPERATIONS.md).",
                _hist_q("ray_eaglenest_serve_queue_seconds", "model"),
                unit="s",
                min=0,
            ),
            P(
                "Inter-token latency",
                "Time between streamed tokens; speculation lowers it when drafts are accepted.",
                _hist_q("ray_eaglenest_serve_inter_token_latency_seconds", ""),
                unit="s",
                min=0,
            ),
            P(
                "Requests by route and status",
                "eaglenest's ingress, by route and HTTP status.",
                [
                    Q(
                        f"sum by (route, status) (rate(ray_eaglenest_serve_requests_total[{RATE}]))",
                        "{{route}} {{status}}",
                    )
                ],
                unit="reqps",
                min=0,
            ),
            P(
                "Error ratio",
                "5xx share of requests, from eaglenest's ingress and from Ray Serve's HTTP proxy (which also sees "
                "requests that never reached eaglenest). Alert: > 5% for 5 minutes.",
                [
                    Q(
                        f'sum(rate(ray_eaglenest_serve_requests_total{{status=~"5.."}}[{RATE}])) / '
                        f"sum(rate(ray_eaglenest_serve_requests_total[{RATE}]))",
                        "eaglenest 5xx",
                    ),
                    Q(
                        f'sum by (application) (rate(ray_serve_num_http_error_requests_total{{error_code=~"5.."}}'
                        f"[{RATE}])) / sum by (application) (rate(ray_serve_num_http_requests_total[{RATE}]))",
                        "Ray proxy 5xx {{application}}",
                    ),
                ],
                unit="percentunit",
                thresholds=[("green", None), ("red", 0.05)],
                min=0,
            ),
            P(
                "Replica health",
                "1 = healthy. eaglenest's gauge covers the start-up self-test and the engine; Ray's covers its "
                "health checks.",
                [
                    Q("ray_eaglenest_serve_replica_healthy", "eaglenest {{NodeAddress}} {{WorkerId}}"),
                    Q(
                        "min by (application, deployment) (ray_serve_deployment_replica_healthy)",
                        "Ray {{application}}/{{deployment}}",
                    ),
                ],
                min=0,
                max=1,
            ),
        ],
    ),
    Row(
        "Regeneration",
        [
            P(
                "Samples written per minute",
                "Regenerated + captured samples written to shards, by source.",
                [
                    Q(
                        f"sum by (source) (rate(ray_eaglenest_regen_samples_done_total[{RATE}])) * 60",
                        "{{source}}",
                    )
                ],
                unit="suffix:/min",
                min=0,
            ),
            P(
                "Samples written",
                "Total samples in the shards of the running job.",
                [Q("sum(ray_eaglenest_regen_samples_done_total)", "samples")],
                kind="stat",
                width=4,
            ),
            P(
                "ETA",
                "Remaining samples / current rate. Alert (info) above 72 h.",
                [Q("max(ray_eaglenest_regen_eta_seconds)", "ETA")],
                unit="s",
                kind="stat",
                width=4,
            ),
            P(
                "Regen tokens/s",
                "Tokens generated by the target engines per second (sizing: docs/OPERATIONS.md).",
                [
                    Q("sum(ray_eaglenest_regen_tokens_per_second)", "reported"),
                    Q(f"sum(rate(ray_eaglenest_regen_generated_tokens_total[{RATE}]))", "counter rate"),
                ],
                unit="suffix:tok/s",
                min=0,
            ),
            P(
                "Quarantined by reason",
                "Rejected samples per minute by source and reason; each is kept with its reason in the quarantine "
                "files of the output directory.",
                [
                    Q(
                        f"sum by (source, reason) (rate(ray_eaglenest_regen_samples_quarantined_total[{RATE}])) * 60",
                        "{{source}}: {{reason}}",
                    )
                ],
                unit="suffix:/min",
                min=0,
            ),
            P(
                "Quarantine ratio",
                "Quarantined / (written + quarantined), by source. Alert: > 20% for 15 minutes.",
                [
                    Q(
                        f"sum by (source) (rate(ray_eaglenest_regen_samples_quarantined_total[{RATE}])) / "
                        f"((sum by (source) (rate(ray_eaglenest_regen_samples_done_total[{RATE}])) or "
                        f"sum by (source) (rate(ray_eaglenest_regen_samples_quarantined_total[{RATE}])) * 0) + "
                        f"sum by (source) (rate(ray_eaglenest_regen_samples_quarantined_total[{RATE}])))",
                        "{{source}}",
                    )
                ],
                unit="percentunit",
                thresholds=[("green", None), ("red", 0.2)],
                min=0,
                max=1,
            ),
        ],
    ),
    Row(
        "Drafter training",
        [
            P(
                "Loss",
                "Weighted TTT loss (sum over steps k of 0.8^k * loss_k).",
                [Q("ray_eaglenest_train_loss", "loss")],
            ),
            P(
                "Step-0 accuracy",
                "Top-1 agreement of the drafter's first step with the target (acc_0).",
                [Q("ray_eaglenest_train_acc0", "acc_0")],
                unit="percentunit",
                min=0,
                max=1,
            ),
            P(
                "Simulated accept length",
                "1 + sum_k prod_{j<=k} acc_j: the accept length a chain of the trained steps would reach.",
                [Q("ray_eaglenest_train_sim_accept_length", "simulated")],
                min=1,
            ),
            P(
                "Non-finite losses",
                "Steps whose loss was NaN/Inf (skipped). Any increase fires EaglenestTrainLossNotFinite.",
                [Q("sum(ray_eaglenest_train_loss_nonfinite_total)", "non-finite")],
                kind="stat",
                width=4,
                thresholds=[("green", None), ("red", 1)],
            ),
        ],
    ),
    Row(
        "Flywheel (traffic -> retrain -> gate -> swap -> watch)",
        [
            P(
                "Traffic logged / dropped",
                "Sampled requests the traffic log wrote, and those it dropped instead of delaying a request (by "
                "reason). Alert: drops over 1% for 15 minutes.",
                [
                    Q(f"sum by (model) (rate(ray_eaglenest_serve_traffic_logged_total[{RATE}])) * 60",
                      "{{model}} logged"),
                    Q(f"sum by (model, reason) (rate(ray_eaglenest_serve_traffic_dropped_total[{RATE}])) * 60",
                      "{{model}} dropped: {{reason}}"),
                ],
                unit="suffix:/min",
                min=0,
            ),
            P(
                "Gate: candidate vs live accept length",
                "What the last promotion gate measured, per prompt set (heldout: recent traffic neither drafter "
                "trained on; regression: the original held-out prompts).",
                [Q("max by (app, role, set) (ray_eaglenest_flywheel_accept_length)", "{{app}} {{role}} {{set}}")],
                min=1,
            ),
            P(
                "Live accept length around the last swap",
                "The watch: the previous drafter's recent level (before) and the new drafter's first requests "
                "(after). After below before by more than flywheel.watch.tolerance rolls the swap back.",
                [Q("max by (app, phase) (ray_eaglenest_flywheel_live_accept_length)", "{{app}} {{phase}}")],
                min=1,
            ),
            P(
                "Promotions, refusals, rollbacks",
                "Drafters swapped in, candidates the gate refused, swaps rolled back (each rollback alerts: "
                "EaglenestDrafterRolledBack).",
                [
                    Q("sum by (app) (ray_eaglenest_flywheel_promotions_total)", "{{app}} promoted"),
                    Q("sum by (app) (ray_eaglenest_flywheel_refusals_total)", "{{app}} refused"),
                    Q("sum by (app) (ray_eaglenest_flywheel_rollbacks_total)", "{{app}} rolled back"),
                ],
                kind="stat",
                width=24,
                thresholds=[("green", None)],
            ),
        ],
    ),
    Row(
        "Metrics pipeline",
        [
            P(
                "Ray metrics targets",
                "1 = Prometheus scrapes the node's metrics agent (port 8080) or the autoscaler/dashboard endpoint.",
                [Q('up{job="ray"}', "{{instance}}")],
                min=0,
                max=1,
                width=24,
            ),
        ],
    ),
]


def _panel(p: P, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    steps = [{"color": c, "value": v} for c, v in (p.thresholds or [("green", None)])]
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "thresholdsStyle": {"mode": "line" if p.thresholds else "off"},
        }
        options: dict[str, Any] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": q.expr, "legendFormat": q.legend or "__auto"}
            for i, q in enumerate(p.queries)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard as a Grafana JSON model (rows laid out on the 24-column grid)."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    return {
        "title": "eaglenest",
        "uid": "eaglenest",
        "description": "EAGLE-3 speculative decoding on Ray: acceptance, speedup, latency, regeneration, training.",
        "tags": ["eaglenest", "ray", "speculative-decoding"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }
            ]
        },
        "panels": panels,
    }


def render() -> str:
    """The JSON text exactly as committed."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
