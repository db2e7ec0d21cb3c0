"""The target's and the offline stages' sections: target, regen, drafter, train, plan."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from eaglenest.config.base import Section


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
    warmup_prompts: int = Field(
        64, ge=0, description="regen: short prompts an engine generates and throws away once started, before its first "
        "batch: the first forwards compile kernels, grow memory pools and start the recorder (seconds at Kimi's "
        "widths), which would otherwise land in the first batch; 0: no warm-up")
    warmup_new_tokens: int = Field(32, ge=1, description="regen: tokens each warm-up prompt decodes (EOS ignored)")
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
    memory_cache_gib: float | None = Field(
        None, ge=0, description="host memory each training worker may keep one pass of its training rows in (and as "
        "much again for its held-out rows), so later epochs and evaluations replay them instead of restarting the Ray "
        "Data stream (tens of seconds a pass on large shards); null: a quarter of the memory available when the "
        "worker starts; 0: always stream")
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
