"""Configuration: pydantic models for every stage, loaded from one YAML file.

One file may hold every section (``configs/demo.yaml``). Unknown keys and invalid values fail with a
``ConfigError`` that names the file, the dotted key and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


def default_cache_dir() -> Path:
    """Where eaglenest caches what it builds (the tiny target, the CPU kernel): ``$EAGLENEST_CACHE`` or
    ``~/.cache/eaglenest``."""
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest"))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the key and the fix."""


# ---------------------------------------------------------------------------------------------------------- target
class TinyTargetSpec(Section):
    """Shape of the embedded tiny target (a Llama built from a seed; see eaglenest.engines.tiny)."""

    num_layers: int = Field(8, ge=8, description="decoder layers; >= 8 so low/mid/high taps are distinct")
    hidden_size: int = Field(128, ge=16)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(352, ge=16)
    vocab_size: int = Field(1024, ge=300, description="BPE vocab trained on the shipped corpus")
    max_position_embeddings: int = Field(2048, ge=64)
    seed: int = 0
    train_steps: int = Field(200, ge=0, description="deterministic CPU pre-training steps on the shipped corpus")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyTargetSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        return self


class SGLangEngineConfig(Section):
    """Arguments for ``sglang.Engine`` (GPU backend); defaults work on the lent H200 with the bundle."""

    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.7, gt=0, le=0.95)
    attention_backend: str = "triton"
    sampling_backend: str = "pytorch"
    grammar_backend: str = "none"
    max_running_requests: int | None = Field(None, ge=1)
    context_length: int | None = Field(None, ge=1)
    disable_cuda_graph: bool = False
    extra_args: dict[str, Any] = Field(default_factory=dict, description="passed to sglang.Engine as is")
    capture_mem_fraction_static: float = Field(
        0.5, gt=0, le=0.95, description="capture runner's share of the GPU memory free when it starts")
    capture_max_tokens: int = Field(16384, ge=16, description="tokens per prefill-only capture batch")
    capture: Literal["prefill", "generation"] = Field(
        "prefill", description="how regen's engines get hidden states: 'prefill': a teacher-forced prefill after "
        "generation (a second model copy in the actor, CUDA graphs on for generation); 'generation': recorded "
        "inside SGLang's scheduler while it generates (forward hooks; that engine runs with CUDA graphs and the "
        "radix cache off, no second prefill). Other engines (bench, serve) are never affected")
    capture_dir: str | None = Field(
        None, description="where generation capture passes states from SGLang's scheduler to the actor (default: "
        "/dev/shm when it has 8 GiB free, else the system temp folder)")
    capture_host_gib: float = Field(
        32, gt=0, description="capture: generation: host memory per engine actor for the states of its batches in "
        "flight, placed as they are recorded and touched while the engine starts (a batch beyond it is placed after "
        "its generation, more slowly)")
    capture_writers: int = Field(
        1, ge=1, le=8, description="capture: generation: threads in SGLang's scheduler passing recorded states to the "
        "actor (with the ring one starts DMA copies and writes a small file per forward; each shares the scheduler's "
        "GIL and host; without the ring, writing whole chunk files, one fell behind a prompt burst's prefill)")
    capture_ring_gib: float = Field(
        4, ge=0, description="capture: generation: shared memory between SGLang's scheduler and the actor that "
        "recorded states reach by DMA (pinned in the scheduler; states of the forwards in flight to the reader: 4 GiB "
        "holds ~38 decode forwards of 3,200 requests at H 4096); 0: "
        "each forward's states go through a chunk file instead")
    concurrent_generate: bool = Field(
        True, description="regen: the batches an engine actor has in flight (regen.batches_in_flight) go to SGLang "
        "together through its asyncio loop, so their requests decode in one running batch; false: one synchronous "
        "Engine.generate at a time")


class TargetConfig(Section):
    """The target LLM and the engine that runs it."""

    model: str = Field("tiny", description="'tiny' (embedded), a local HF folder, or a hub id")
    engine: Literal["hf", "sglang"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    aux_layer_ids: list[int] | None = Field(
        None, description="physical ids (hidden_states index); default [2, N//2, N-3]"
    )
    trust_remote_code: bool = False
    cpu_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (None: torch's default)")
    cpu_kernels: Literal["auto", "off"] = Field(
        "auto", description="'auto': fp32 linears on CPU run eaglenest's packed small-batch kernel (a verify step "
        "over several draft tokens then costs about one decode step; needs a C compiler and AVX2+FMA, else torch's "
        "linear is kept); 'off': always torch's linear"
    )
    tiny: TinyTargetSpec = Field(default_factory=TinyTargetSpec)
    cache_dir: str | None = Field(None, description="where the tiny target is cached (default ~/.cache/eaglenest)")
    sglang: SGLangEngineConfig = Field(default_factory=SGLangEngineConfig)


# ----------------------------------------------------------------------------------------------------------- regen
class SamplingConfig(Section):
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)
    seed: int | None = 0


AdapterName = Literal["sharegpt", "openai", "alpaca", "problem_solution", "tool_use", "native"]


class SourceConfig(Section):
    """One dataset source: where it is read from, how it is parsed, how much of it is used."""

    name: str
    domain: Literal["chat", "reasoning", "math", "coding", "agentic_coding", "tool_use"]
    adapter: AdapterName
    path: str | None = Field(None, description="local .jsonl/.json/.parquet file (relative to the config file)")
    hub_id: str | None = Field(None, description="Hugging Face dataset id, for real runs")
    split: str = "train"
    max_samples: int | None = Field(None, ge=1, description="sample cap")
    sampling: SamplingConfig | None = Field(None, description="per-source override of regen.sampling")

    @model_validator(mode="after")
    def _one_location(self) -> SourceConfig:
        if (self.path is None) == (self.hub_id is None):
            raise ValueError(f"source {self.name!r}: give exactly one of 'path' or 'hub_id'")
        return self


class RegenConfig(Section):
    """Regeneration + capture job (Ray Data)."""

    sources: list[SourceConfig] = Field(default_factory=list)
    sources_file: str | None = Field(None, description="YAML file with a top-level 'sources' list")
    output: str = "out/regen"
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batch_size: int = Field(8, ge=1, description="conversations per engine call")
    num_actors: int = Field(1, ge=1, description="engines in the actor pool (data parallel)")
    batches_in_flight: int = Field(
        1, ge=1, le=32, description="batches one engine actor works on at once. SGLang: their requests share the "
        "engine's running batch (no tail and cold start between batches), and a finished batch is handed on while "
        "the others generate; keep batch_size x batches_in_flight above what the engine runs at once. hf: the engine "
        "still runs one batch at a time")
    num_cpus_per_actor: float = Field(0.5, ge=0)
    num_gpus_per_actor: float = Field(0, ge=0)
    max_engine_restarts: int = Field(
        3, ge=-1, description="times Ray restarts an engine actor whose process died (and retries its batches) before "
        "the job fails; -1: without limit. A killed actor comes back and the job carries on, but an engine that dies "
        "on every batch (a kernel crash) fails the job with its cause instead of restarting forever; rerun to resume")
    min_tokens: int = Field(4, ge=1, description="length filter: shorter samples are quarantined")
    max_tokens: int = Field(2048, ge=16, description="length filter: longer samples are quarantined")
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16", description="hidden-state storage: bfloat16 = 8*H bytes/token; float8_e4m3fn = 4*H + 4 (a "
                                "power-of-two scale per token and state; dequantised to bf16 on the "
                                "training device)")
    rows_per_shard: int = Field(64, ge=1)


# ----------------------------------------------------------------------------------------------------------- train
class DrafterConfig(Section):
    """EAGLE-3 drafter shape; None means 'copy from the target'."""

    draft_vocab_size: int = Field(32000, ge=16)
    intermediate_size: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1, description="default: the target's head_dim, else hidden/num_heads")
    max_position_embeddings: int | None = Field(None, ge=1, description="default: the target's context length")
    draft_shape: Literal["llama", "mla"] = Field("llama", description="the decoder layer's attention: llama (q/k/v "
                                                 "heads, SGLang LlamaForCausalLMEagle3) or mla (DeepSeek latent "
                                                 "attention, SGLang Eagle3DeepseekV2ForCausalLM; MLA targets only)")
    q_lora_rank: int | None = Field(None, ge=1, description="mla only; default: the target's")
    kv_lora_rank: int | None = Field(None, ge=1, description="mla only; default: the target's")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="mla only; default: the target's")
    qk_rope_head_dim: int | None = Field(None, ge=2, description="mla only; default: the target's")
    v_head_dim: int | None = Field(None, ge=1, description="mla only; default: the target's")
    fc_norm: bool = Field(False, description="EAGLE-3.1: an RMSNorm per aux layer before fc")
    norm_output: bool = Field(False, description="EAGLE-3.1: the next draft step reads the post-norm hidden state")

    def shape_kwargs(self) -> dict[str, Any]:
        """The draft-shape arguments of ``eaglenest.drafter.shape.drafter_model_config``."""
        mla = {k: getattr(self, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim")}
        if self.draft_shape != "mla" and any(v is not None for v in mla.values()):
            raise ValueError(f"train.drafter sets MLA widths {sorted(k for k, v in mla.items() if v is not None)} "
                             f"but draft_shape is {self.draft_shape!r}; set draft_shape: mla or drop them")
        return {"draft_shape": self.draft_shape, "mla": mla if self.draft_shape == "mla" else None,
                "fc_norm": self.fc_norm, "norm_output": self.norm_output}


class MixData(Section):
    """A regen folder mixed into the training rows (e.g. the original data beside recent traffic)."""

    data: str = Field(description="regen output folder (relative to the config file)")
    share: float = Field(gt=0, lt=1, description="its share of the training rows: subsampled by a hash of the sample "
                         "id to share / (1 - all shares) x the --data folder's rows (all of it when it has fewer)")


class TrainConfig(Section):
    """TTT training on Ray Train."""

    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    ttt_steps: int = Field(7, ge=1, description="K unrolled training-time-test steps")
    step_weight_decay: float = Field(0.8, gt=0, le=1, description="loss weight of step k is decay**k")
    learning_rate: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    max_grad_norm: float = Field(0.5, gt=0)
    batch_size: int = Field(4, ge=1, description="sequences per worker step")
    max_seq_len: int = Field(2048, ge=8)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(
        1.0, gt=0, le=1, description="with use_gpu: the share of one GPU a worker reserves in Ray (e.g. 0.5 to train "
        "two drafters, say both draft shapes of one target, side by side on one GPU; each still uses one device)")
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    eval_every: int = Field(50, ge=1)
    eval_max_samples: int | None = Field(256, ge=1, description="held-out samples per evaluation (None = all)")
    log_every: int = Field(10, ge=1, description="steps between progress lines / metrics.jsonl records")
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    run_name: str = "eaglenest-drafter"
    init_from: str | None = Field(None, description="drafter export folder a fresh run starts from (its weights, "
                                  "shape and draft vocab), e.g. the live drafter; relative to the config file")
    mix: list[MixData] = Field(default_factory=list, description="more regen folders mixed into --data's rows")
    data: Literal["shards", "online"] = Field(
        "shards", description="shards: read a regen folder (--data); online: regenerate and capture while training, "
        "streaming hidden states from the engines to the workers (nothing written; `eaglenest train --online`)")
    online_vocab_samples: int = Field(
        1024, ge=1, description="online: training samples regenerated once up front to count the draft vocabulary "
        "(their hidden states are dropped; the vocab must exist before the drafter)")
    online_buffer_mb: int = Field(
        256, ge=1, description="online: object-store bytes the regen stream may hold ahead of the trainer; engines "
        "stall (back-pressure) rather than fill memory when the trainer is slower")


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
    health_details_public: bool = Field(
        False, description="with api_key set, /health shows callers without the key its whole body (model, target, "
                           "drafter folder, self-test) instead of only its status"
    )
    docs_public: bool = Field(
        False, description="with api_key set, /docs and /openapi.json answer callers without the key (off: 401)"
    )


# ------------------------------------------------------------------------------------------------------------ plan
class PlanConfig(Section):
    """Inputs of ``eaglenest plan`` that the rest of the config does not hold (measured figures; flags override)."""

    hidden_size: int | None = Field(None, ge=1, description="the target's hidden size when its config.json is not "
                                                             "local (a hub id)")
    prompt_tokens: float | None = Field(None, gt=0, description="average prompt tokens per sample")
    answer_tokens: float | None = Field(None, gt=0, description="average generated tokens per sample")
    engine_tokens_per_s: float | None = Field(None, gt=0, description="generated tok/s of one regen engine")
    train_tokens_per_s: float | None = Field(None, gt=0, description="training tok/s of one worker")
    capture_share: float | None = Field(None, gt=0, le=1, description="capture / (generate + capture) seconds of a "
                                        "regen pass (manifest last_run.engine_seconds): a later online epoch's cost")


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
