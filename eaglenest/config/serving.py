"""The sections of what runs the drafter: speculative shape, bench, tune, serve and its traffic log."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from eaglenest.config.base import Section


# ------------------------------------------------------------------------------------------------------ spec / eval
class SpecConfig(Section):
    """Speculative decoding shape; SGLang needs all three set."""

    algorithm: str | None = Field(None, description="the engine's speculative algorithm; default: derived from the "
                                  "drafter (eaglenest.drafters.registry), which preflight checks it against")
    num_steps: int = Field(3, ge=1)
    topk: int = Field(1, ge=1)
    num_draft_tokens: int = Field(4, ge=2)

    @model_validator(mode="after")
    def _budget(self) -> SpecConfig:
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"with topk 1 a chain of {self.num_steps} steps verifies exactly num_steps+1 = {self.num_steps + 1} "
                f"tokens; set num_draft_tokens: {self.num_steps + 1}"
            )
        if self.num_draft_tokens > self.topk * self.num_steps + 1:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} exceeds the tree (topk*num_steps+1 = "
                f"{self.topk * self.num_steps + 1})"
            )
        return self


class BenchConfig(Section):
    prompts: str | None = Field(None, description="JSONL of prompts ({'messages': [...], 'domain': ...})")
    drafter: str | None = Field(None, description="drafter export folder (default: serve.drafter)")
    num_prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    repeats: int = Field(3, ge=1, description="interleaved rounds; tok/s is the median over rounds")
    batch_size: int = Field(1, ge=1)
    output: str | None = Field(None, description="folder for bench.json, bench.md and bench.png")
    sweep: list[SpecConfig] = Field(default_factory=lambda: [SpecConfig()])


class TuneConfig(Section):
    """``eaglenest tune``: what is measured to build a schedule (batch bucket -> speculative config; flags override)."""

    prompts: str | None = Field(None, description="held-out prompts JSONL (default: bench.prompts)")
    drafter: str | None = Field(None, description="drafter export folder (default: bench.drafter, serve.drafter)")
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256], description="each "
                                   "is a bucket's top (SGLang: keep them CUDA-graph batch sizes, e.g. powers of 2)")
    steps: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7], description="chain candidates (topk 1); "
                             "'off' is always measured")
    trees: list[SpecConfig] = Field(default_factory=list, description="topk > 1 shapes to measure too")
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 0.7], description="a choice must hold at each")
    repeats: int = Field(3, ge=2, description="rounds per measurement; their spread is the noise")
    max_new_tokens: int = Field(64, ge=4)
    num_prompts: int = Field(16, ge=1, description="prompts per measurement at least (whole batches; file cycled)")
    noise_floor: float = Field(0.01, ge=0, lt=0.5, description="smallest relative difference treated as real")
    output: str | None = Field(None, description="folder for measurements.jsonl, schedule.json, schedule.png")
    verify: bool = Field(False, description="measure the schedule too, beside what chose it, in the same run "
                         "(output/verify: what `eaglenest bench --schedule` reports, one engine start more "
                         "instead of a second bench's baseline and static configs)")

    @field_validator("batch_sizes", "steps")
    @classmethod
    def _distinct_positive(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1 or len(set(v)) != len(v):
            raise ValueError(f"must list distinct positive integers, got {v}")
        return sorted(v)


# ----------------------------------------------------------------------------------------------------------- serve
class TrafficLogConfig(Section):
    """Sampled requests and answers written as a native regen source (off until ``path`` is set; docs/OPERATIONS.md,
    "The flywheel", says what it stores and the privacy trade-off)."""

    path: str | None = Field(None, description="folder of traffic-*.jsonl files (shared storage on a cluster)")
    sample_rate: float = Field(0.1, ge=0, le=1, description="share of successful requests written")
    max_bytes: int = Field(10 << 30, ge=4096, description="disk budget of the folder; the oldest files go first")
    retention_days: float = Field(30, gt=0, description="files older than this are deleted")
    redact: bool = Field(True, description="emails, phone and card numbers, IP addresses and secret-like strings "
                         "become [redacted] (such a record is re-tokenized; others keep the served ids)")
    queue_size: int = Field(1024, ge=1, description="records waiting for the writer; more are dropped and counted")


class RouteConfig(Section):
    """``serve.route``: a speculative and a plain engine, picked per request by live load.

    For a schedule that speculates at low load only, where the engine cannot switch per batch (SGLang without
    adaptive mode, or adaptive mode measured slower than the baseline at high load). On one replica
    (``placement: replica``) requests go to the speculative engine while fewer than ``limit`` run and the plain engine
    is idle, else to the plain engine; across two deployments (``placement: deployments``) each request goes where the
    schedule's measured curves gain more (eaglenest.serve.route_policy). Costs GPU memory for two copies of the
    target; off by default (docs/OPERATIONS.md)."""

    by_load: bool = Field(False, description="two engines, routed by live load (needs serve.schedule and a drafter)")
    limit: int | None = Field(None, ge=1, description="most requests the speculative engine runs; default and upper "
                              "bound: the widest load the schedule measured a drafter safe over")
    speculative_mem_fraction_static: float = Field(
        0.9, gt=0, le=0.95, description="SGLang: the speculative engine starts second, sizing its share from the "
        "memory the plain engine left (its KV pool is capped by speculative_max_total_tokens instead)")
    speculative_max_total_tokens: int | None = Field(
        None, ge=256, description="SGLang: the speculative engine's KV pool; default limit x (max_prompt_tokens + "
        "max_tokens_limit), at least 8,192")
    placement: Literal["replica", "deployments"] = Field(
        "replica", description="replica: both engines on each replica's GPUs (the target must fit twice); "
        "deployments: a speculative and a plain deployment, each on GPUs of its own, behind the CPU-only routing "
        "ingress (serve.num_replicas of it, each routing its share; a target that fills its tensor-parallel group)")
    speculative_replicas: int = Field(1, ge=1, description="deployments: replicas of the speculative engine")
    plain_replicas: int = Field(1, ge=1, description="deployments: replicas of the plain engine")


class ServeConfig(Section):
    host: str = Field("127.0.0.1", description="bind address; loopback unless you mean it")
    port: int = Field(8000, ge=1, le=65535)
    model_name: str = "eaglenest"
    drafter: str | None = Field(None, description="exported drafter folder")
    api_key: str | None = Field(None, description="Bearer token; env EAGLENEST_API_KEY also works")
    spec: SpecConfig = Field(default_factory=SpecConfig)
    schedule: str | None = Field(None, description="eaglenest tune's schedule.json: the live batch size picks the "
                                 "bucket's config (off included), replacing serve.spec; refused if tuned elsewhere")
    expected_batch_size: list[int] | None = Field(None, min_length=2, max_length=2, description="[lo, hi] requests "
                                                  "expected; SGLang without adaptive mode serves one config safe "
                                                  "over it (default [1, max_concurrent_requests])")
    max_concurrent_requests: int = Field(64, ge=1)
    max_prompt_tokens: int = Field(1536, ge=1)
    max_tokens_limit: int = Field(512, ge=1)
    max_batch_size: int = Field(16, ge=1, description="concurrent requests the hf backend decodes as one batch")
    decoder_process: bool = Field(
        True, description="hf backend: decode in a child process of the replica, so that HTTP and streaming work do "
                          "not share one interpreter lock with decoding (SGLang runs its own scheduler processes)"
    )
    stream_interval_s: float = Field(
        0.02, ge=0, description="a stream sends what is ready at most this often (first token at once); 0 = per step"
    )
    num_replicas: int = Field(1, ge=1)
    autoscaling: dict[str, Any] | None = None
    num_cpus_per_replica: float = Field(0.5, ge=0)
    num_gpus_per_replica: float = Field(0, ge=0)
    self_test_min_accept_length: float = Field(1.0, ge=1.0)
    baseline_tokens_per_s: float | None = Field(
        None, gt=0, description="last benchmarked baseline, for the speedup metric"
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM / stop_serve: running requests get this long to finish, then they are "
                                "cancelled with a final error event (new requests get 503 at once)"
    )
    tool_call_markers: list[str] | None = Field(
        None, description="[start, end] around a JSON tool call in the target's output, parsed into tool_calls; "
                          "None: detected from the chat template (e.g. <tool_call> </tool_call>); []: off"
    )
    reasoning_markers: list[str] | None = Field(
        None, description="[start, end] around the target's reasoning, used when reasoning is parsed "
                          "(serve.reasoning_parser or a request's separate_reasoning); None: detected from the chat "
                          "template (e.g. <think> </think>); []: never parsed"
    )
    reasoning_parser: bool = Field(
        False, description="return the target's reasoning as reasoning_content (off: content holds the whole text, "
                           "as vLLM and SGLang do without --reasoning-parser); a request's separate_reasoning "
                           "overrides it"
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="larger request bodies are refused with 413 request_too_large before "
                                              "they are parsed"
    )
    traffic_log: TrafficLogConfig = Field(default_factory=TrafficLogConfig)
    route: RouteConfig = Field(default_factory=RouteConfig)
    health_details_public: bool = Field(
        False, description="with api_key set, /health shows callers without the key its whole body (model, target, "
                           "drafter folder, self-test) instead of only its status"
    )
    docs_public: bool = Field(
        False, description="with api_key set, /docs and /openapi.json answer callers without the key (off: 401)"
    )
