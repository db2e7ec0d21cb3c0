"""The SGLang backend of TargetEngine: generation, prefill-only capture and EAGLE-3 serving on ``sglang.Engine``.

Run it inside a Ray actor with ``num_gpus = target.sglang.tp_size`` (tensor parallel inside the actor; data parallel
= more actors). sglang is imported only inside this module's functions, never at import time, so nothing else in
eaglenest pulls it in.

Pinned to sglang 0.5.14 (``SGLANG_VERSION``). Every sglang name this backend touches is listed in
``SGLANG_INTERNALS`` (``eaglenest.engines.sglang.symbols``) and fetched through ``sglang_symbol``, which refuses
anything unlisted; upgrading sglang means re-reading exactly these:

- ``sglang:Engine`` / ``sglang:__version__`` (public): generation and speculative serving, offline, batched.
- ``sglang.srt.server_args:ServerArgs``, ``PortArgs``: capture runner arguments and its ports.
- ``sglang.srt.configs.model_config:ModelConfig``: the capture runner's model config.
- ``sglang.srt.model_executor.model_runner:ModelRunner``: constructor (``model_config, mem_fraction_static, gpu_id,
  tp_rank, tp_size, moe_ep_rank, moe_ep_size, pp_rank, pp_size, nccl_port, server_args``), ``alloc_memory_pool``,
  ``init_attention_backends``, ``init_cuda_graphs``, ``forward``, ``model``, ``req_to_token_pool``,
  ``token_to_kv_pool_allocator`` (``.clear()``), ``model_config``, ``device``.
- ``sglang.srt.managers.schedule_batch:Req`` (``origin_input_ids``, ``full_untruncated_fill_ids``, ``fill_len``,
  ``logprob_start_len``, ``prefix_indices``, ``set_extend_input_len``) and ``ScheduleBatch`` (``init_new``,
  ``prepare_for_extend``, ``input_ids``, ``prefill_input_ids_cpu``), with a tree-cache stand-in exposing
  ``supports_swa/supports_mamba/is_chunk_cache/is_tree_cache/evict``.
- ``sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new``.
- ``sglang.srt.speculative.spec_info:SpeculativeAlgorithm.NONE``.
- ``sglang.srt.sampling.sampling_params:SamplingParams``.
- ``sglang.srt.layers.moe:initialize_moe_config``, ``...quantization.fp8_utils:initialize_fp8_gemm_config``,
  ``...quantization.fp4_utils:initialize_fp4_gemm_config``: globals the model layers read.
- On the model: ``set_eagle3_layers_to_capture(ids)`` (llama.py adds 1; DeepSeek/Kimi add 1 only when ids[0] == 1),
  ``[language_model.]model.layers_to_capture``, ``[language_model.]logits_processor.forward(input_ids,
  hidden_states, lm_head, logits_metadata, aux_hidden_states, ...)`` (hidden_states = final normed state, aux = list
  of residual streams entering the captured layers, in ascending layer order).
- ``Engine.generate(input_ids=[...], sampling_params=[...])``, ``Engine.flush_cache()``, ``Engine.shutdown()``.
- Streaming (``eaglenest.engines.sglang.stream``): ``Engine.loop``, ``Engine.async_generate(input_ids=,
  sampling_params=, stream=True, rid=)`` (cumulative chunks: ``incremental_streaming_output`` stays off),
  ``Engine.tokenizer_manager.abort_request(rid)``.
- Capture during generation (``target.sglang.capture: generation``; ``sglang_hooks`` / ``sglang_recorded``): the
  ``forward_hooks`` server argument (resolved and attached by ``model_executor/hook_manager.py`` after graph capture),
  ``disable_cuda_graph`` / ``disable_radix_cache``, ``Engine.generate(rid=[...])``, the Llama decoder layer's call
  ``layer(positions, hidden_states, forward_batch, residual) -> (hidden, residual)``, ``model.norm(hidden, residual)
  -> (normed, residual)``, and ``ForwardBatch.rids / forward_mode / extend_seq_lens_cpu / input_ids / positions``.
- Regen (``EngineLoopDriver``): ``Engine.loop`` run forever on a thread, ``Engine.async_generate(input_ids=,
  sampling_params=, rid=)`` for a whole batch (several threads' batches in the scheduler at once).
- Output dict of ``Engine.generate``: ``output_ids``, ``meta_info.finish_reason.type/matched``, ``prompt_tokens``,
  ``completion_tokens``, ``spec_verify_ct``, ``spec_accept_length``, ``spec_num_correct_drafts``,
  ``spec_num_proposed_drafts``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.config import SGLangEngineConfig, SpecConfig, TargetConfig
from eaglenest.contracts.layers import default_aux_layer_ids, validate_aux_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.engines.base import (
    Capture,
    CaptureHint,
    Generation,
    SamplingParams,
    TargetEngine,
    TargetInfo,
    decode_texts,
)
from eaglenest.engines.location import resolve_target_path
from eaglenest.engines.sglang.adaptive import AdaptiveSpec, adaptive_kwargs, environment
from eaglenest.engines.sglang.args import (
    SGLANG_VERSION,
    capture_server_kwargs,
    check_generation_capture,
    check_prompts,
    engine_kwargs,
    generation_capture_kwargs,
    run_generate,
)
from eaglenest.engines.sglang.driver import EngineLoopDriver
from eaglenest.engines.sglang.launch_failure import start_raising_on_failure
from eaglenest.engines.sglang.limits import check_server_args, speculative_running_requests
from eaglenest.engines.sglang.recorded import GenerationRecorder
from eaglenest.engines.sglang.spec import SpeculativeLaunch, speculative_engine_kwargs
from eaglenest.engines.sglang.symbols import (
    SGLANG_INTERNALS,
    installed_sglang_version,
    require_sglang,
    server_arg_fields,
    sglang_symbol,
)
from eaglenest.engines.sglang.warmup import warmup_requests

if TYPE_CHECKING:
    from eaglenest.engines.sglang.stream import SGLangStreams

__all__ = ["SGLANG_INTERNALS", "SGLANG_VERSION", "SGLangEngine", "installed_sglang_version", "require_sglang",
           "sglang_symbol"]


class SGLangEngine(TargetEngine):
    """TargetEngine on sglang: the whole batch goes to ``Engine.generate`` at once (continuous batching).

    The generation engine (radix cache on) and the capture runner (radix cache and chunked prefill off) are separate
    and both start lazily, on first use; ``speculative`` launches the engine with an EAGLE-3 drafter instead.
    """

    thread_safe = True  # regen: batches of several threads generate together (EngineLoopDriver); else serialised

    def __init__(self, cfg: TargetConfig, *, model_path: str | None = None, drafter: str | None = None,
                 spec: SpecConfig | None = None, regen: bool = False, adaptive: AdaptiveSpec | None = None,
                 start_failure_raises: bool = False, concurrency: int | None = None):
        require_sglang()
        if cfg.device == "cpu":
            raise ValueError("target.engine sglang runs on GPUs; use target.engine: hf for target.device: cpu")
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.engine_cfg: SGLangEngineConfig = cfg.sglang
        self.model_path = model_path or resolve_target_path(cfg)
        self.dtype = "auto" if cfg.dtype == "auto" else cfg.dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=cfg.trust_remote_code)
        self.spec = TargetSpec.read(self.model_path, context_length=self.engine_cfg.context_length)
        self.info = target_info(self.spec, self.tokenizer, self.dtype)
        self.aux_layer_ids = validate_aux_layer_ids(cfg.aux_layer_ids or default_aux_layer_ids(self.info.num_layers),
                                                    self.info.num_layers)
        self.launch: SpeculativeLaunch | None = None
        self.adaptive = adaptive
        self.engine_env: dict[str, str] = {}
        """environment the engine starts in (its scheduler processes read SGLang's knobs from it)"""
        if drafter is not None:
            if adaptive is not None:  # preflight with a chain of the largest candidate; the launch is adaptive
                top = max(1, max(adaptive.all_steps))
                spec = SpecConfig(algorithm=(spec.algorithm if spec else None), num_steps=top, topk=1,
                                  num_draft_tokens=top + 1)
            kwargs, self.launch = speculative_engine_kwargs(
                self.model_path, self.engine_cfg, drafter, spec or SpecConfig(), target=self.spec,
                expected_physical_ids=cfg.aux_layer_ids, dtype=self.dtype, trust_remote_code=cfg.trust_remote_code)
            if adaptive is not None:
                kwargs.update(adaptive_kwargs(adaptive, adaptive.write()))
                self.engine_env = adaptive.env
            kwargs.update(speculative_running_requests(kwargs, concurrency))
        else:
            kwargs = engine_kwargs(self.model_path, self.engine_cfg, dtype=self.dtype,
                                   trust_remote_code=cfg.trust_remote_code, target=self.spec)
        self.recorder: GenerationRecorder | None = None
        self.regen = regen and drafter is None
        """regen's engine (it records, if ``capture: generation``, and runs threads' batches together)"""
        # only regen's engines record: a bench baseline or a serving engine keeps CUDA graphs and the radix cache
        if self.regen and self.engine_cfg.capture == "generation":
            check_generation_capture(self.spec.architecture, self.engine_cfg.tp_size)
            self.recorder = GenerationRecorder(self.engine_cfg.capture_dir, self.aux_layer_ids,
                                               hidden_size=self.info.hidden_size,
                                               dtype="bfloat16" if self.dtype == "auto" else self.dtype,
                                               reserve_max_bytes=int(self.engine_cfg.capture_host_gib * 2**30),
                                               writers=self.engine_cfg.capture_writers,
                                               ring_bytes=int(self.engine_cfg.capture_ring_gib * 2**30),
                                               architecture=self.spec.architecture)
            kwargs = generation_capture_kwargs(kwargs, self.recorder.hooks)
        self.engine_kwargs = kwargs
        self._engine: Any = None
        self._capture: Any = None
        self._calls = threading.Lock()  # Engine.generate drives the engine's event loop: one call at a time
        self._driver: EngineLoopDriver | None = None
        self._starting = threading.Lock()
        self.start_failure_raises = start_failure_raises
        """a scheduler failing while the engine starts makes the start raise instead of ending this process (a bench
        of several engines; eaglenest.engines.sglang.launch_failure)"""
        self.warmup_seconds: float | None = None
        """seconds of regen's warm-up generation, once it ran"""

    @property
    def device(self) -> torch.device:
        """Where captured tensors can be moved for training (the engine's GPU; captures come back on the CPU)."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @classmethod
    def from_config(cls, cfg: TargetConfig, *, regen: bool = False) -> SGLangEngine:
        """``regen``: the engine regenerates data (``target.sglang.capture: generation`` then records while it
        generates); every other use gets a plain engine."""
        return cls(cfg, regen=regen)

    @classmethod
    def speculative(cls, cfg: TargetConfig, drafter: str, spec: SpecConfig | None = None, *,
                    adaptive: AdaptiveSpec | None = None, start_failure_raises: bool = False,
                    concurrency: int | None = None) -> SGLangEngine:
        """An engine that generates with an EAGLE-3 drafter; the launch is checked before anything starts.
        ``adaptive``: SGLang's adaptive speculation with per-bucket candidate steps (eaglenest.engines.sglang.adaptive)
        instead of one static shape. ``concurrency``: the most requests the caller runs at once (serve's
        ``max_concurrent_requests``, a bench's largest batch): the engine's running-request slots where
        ``target.sglang.max_running_requests`` is unset (:func:`speculative_running_requests`)."""
        return cls(cfg, drafter=drafter, spec=spec, adaptive=adaptive, start_failure_raises=start_failure_raises,
                   concurrency=concurrency)

    # ------------------------------------------------------------------------------------------------ generation
    @property
    def engine(self) -> Any:
        if self._engine is not None:
            return self._engine
        with self._starting:  # two threads' first calls must not start two engines
            if self._engine is not None:
                return self._engine
            Engine = sglang_symbol("sglang:Engine")
            check_server_args(self.engine_kwargs, server_arg_fields(), installed_sglang_version() or "?")
            with environment(self.engine_env):
                engine = (start_raising_on_failure(Engine, self.engine_kwargs) if self.start_failure_raises
                          else Engine(**self.engine_kwargs))
            if self.recorder is not None:
                self.recorder.sink.start()
            if self.regen and self.engine_cfg.concurrent_generate:
                self._driver = EngineLoopDriver(engine)
            self._engine = engine  # last: a thread that sees the engine sees its driver too
        return self._engine

    def start(self) -> None:
        """Start the engine now rather than inside the first request (so a batch's timing is the batch's alone);
        regen's engine then warms up (:meth:`warm_up`)."""
        _ = self.engine
        if self.regen and self.engine_cfg.warmup_prompts > 0 and self.warmup_seconds is None:
            self.warm_up()

    def warm_up(self) -> float:
        """Generate ``target.sglang.warmup_prompts`` short prompts and throw them away (their recorded rows are dropped
        as they arrive): the first forwards' kernel compiles, pool growth and recorder start happen here, not in the
        first batch (eaglenest.engines.sglang.warmup). Returns its seconds."""
        n, new = self.engine_cfg.warmup_prompts, self.engine_cfg.warmup_new_tokens
        prompts, sampling = warmup_requests(self.tokenizer, n, new)
        rid = {"rid": self.recorder.throwaway_rids(n)} if self.recorder is not None else {}
        t0 = time.perf_counter()
        with self._one_call():
            self._generate_call()(input_ids=prompts, sampling_params=sampling, **rid)
        self.warmup_seconds = time.perf_counter() - t0
        print(f"[eaglenest engine] warm-up: {n} prompts x {new} new tokens in {self.warmup_seconds:.1f} s, before "
              "the first batch", flush=True)
        return self.warmup_seconds

    def prewarm_capture(self, rows_per_batch: int, batches: int) -> int:
        """Capture during generation: make the host memory of ``batches`` batches of ``rows_per_batch`` recorded rows
        ready before the first batch (bytes made ready; 0 when this engine does not record)."""
        return self.recorder.sink.prewarm(rows_per_batch, batches) if self.recorder is not None else 0

    def capture_placement(self) -> dict[str, int]:
        """Capture during generation: sequences assembled so far from rows placed as they arrived ("on_arrival") or
        after their batch ("at_capture", the slower path); empty when this engine does not record."""
        return dict(self.recorder.sink.served) if self.recorder is not None else {}

    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """All prompts in one ``Engine.generate`` call (sglang batches them continuously); exact output ids."""
        if not prompts:
            return []
        rids = self.recorder.new_rids(len(prompts)) if self.recorder is not None else None
        if rids is not None:
            self.recorder.reserve(rids, prompts, sampling.max_new_tokens)
        with self._one_call():
            gens = run_generate(self._generate_call(), prompts, sampling, decode=self._decode,
                                decode_many=self._decode_many,
                                vocab_size=self.info.vocab_size, eos_token_ids=self.info.eos_token_ids, rids=rids)
        if self.recorder is not None:
            self.recorder.expect(rids, prompts, gens)
        if self.launch is not None:
            for g in gens:
                g.meta.setdefault("algorithm", self.launch.algorithm)
        return gens

    def streams(self) -> SGLangStreams:
        """A multiplexer of streamed requests on this engine (serving: tokens as they are decoded)."""
        from eaglenest.engines.sglang.stream import SGLangStreams

        return SGLangStreams(self.engine, vocab_size=self.info.vocab_size, eos_token_ids=self.info.eos_token_ids,
                             decode=self._decode)

    def _decode(self, ids: list[int]) -> str:
        """Answer text from ids, the same way for streamed and whole generations."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_many(self, seqs: list[list[int]]) -> list[str]:
        """:meth:`_decode` of each sequence, in one call."""
        return decode_texts(self.tokenizer, seqs, skip_special_tokens=True)

    # --------------------------------------------------------------------------------------------------- capture
    @property
    def capture_runner(self) -> Any:
        if self._capture is None:
            from eaglenest.engines.sglang.capture import SGLangCaptureRunner

            kw = capture_server_kwargs(self.model_path, self.engine_cfg, dtype=self.dtype,
                                       trust_remote_code=self.cfg.trust_remote_code,
                                       max_total_tokens=max(self.engine_cfg.capture_max_tokens * 2, 4096))
            self._capture = SGLangCaptureRunner(kw, architecture=self.spec.architecture,
                                                num_layers=self.info.num_layers,
                                                max_tokens=self.engine_cfg.capture_max_tokens)
        return self._capture

    def capture(self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None, *,
                hints: Sequence[CaptureHint | None] | None = None) -> list[Capture]:
        """Hidden states of each sequence; tensors in the model dtype, on the CPU.

        With ``target.sglang.capture: generation`` the states recorded while generating are reused (``hints``), and
        sequences without usable recordings are captured by a one-token generation over them (its prefill records
        every position); otherwise a prefill-only capture through SGLang's model code in this process.
        """
        ids = validate_aux_layer_ids(layer_ids if layer_ids is not None else self.aux_layer_ids, self.info.num_layers)
        if not sequences:
            return []
        seqs = check_prompts(sequences, vocab_size=self.info.vocab_size)
        if self.recorder is not None and list(ids) == list(self.aux_layer_ids):
            return self.recorder.capture(seqs, hints, prefill=self._prefill_recorded)
        with self._calls:
            return self.capture_runner.capture(seqs, ids)

    def _prefill_recorded(self, seqs: list[list[int]], rids: list[str]) -> None:
        """One-token generations over ``seqs``: their prefill runs every position through the recording hooks."""
        params = [{"max_new_tokens": 1, "temperature": 0.0} for _ in seqs]
        with self._one_call():
            self._generate_call()(input_ids=seqs, sampling_params=params, rid=rids)

    def _generate_call(self) -> Any:
        """Regen: ``async_generate`` on the driven loop (threads' batches generate together); else the engine's
        synchronous ``generate``."""
        engine = self.engine
        return self._driver.generate if self._driver is not None else engine.generate

    def _one_call(self) -> Any:
        """The lock that serialises synchronous engine calls; nothing to hold when the loop driver runs."""
        _ = self.engine  # started (and its driver with it) before deciding
        return contextlib.nullcontext() if self._driver is not None else self._calls

    # ------------------------------------------------------------------------------------------------ weights
    def lm_head_weight(self) -> torch.Tensor:
        """The target's output projection, read from its safetensors (tied embeddings resolved)."""
        return self.spec.load_tensor(self.spec.lm_head_name())

    def embed_weight(self) -> torch.Tensor:
        return self.spec.load_tensor(self.spec.embed_name())

    def close(self) -> None:
        if self._capture is not None:
            self._capture.close()
            self._capture = None
        if self._driver is not None:
            self._driver.close()
            self._driver = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self.recorder is not None:
            self.recorder.close()


def target_info(spec: TargetSpec, tokenizer: Any, dtype: str) -> TargetInfo:
    """The engine protocol's view of a target served by sglang (eos ids: the config's and the tokenizer's)."""
    eos = set(spec.eos_token_ids())
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return TargetInfo.from_spec(spec, dtype=spec.dtype if dtype == "auto" else dtype, engine="sglang",
                                engine_version=f"sglang-{installed_sglang_version()}", eos_token_ids=eos)
