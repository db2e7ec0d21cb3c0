"""Prefill-only hidden-state capture through SGLang's own model code, in this process (reference/sglang.md §B.4).

A ``ModelRunner`` is built here the way sglang's own offline driver (``sglang.bench_one_batch``) builds one, with
radix cache, chunked prefill and CUDA graphs off. The target is told which layers to capture through
``set_eagle3_layers_to_capture`` (the same call SGLang makes when it serves EAGLE-3, so the capture uses the serving
path's numbering), and a thin wrapper around the model's ``logits_processor`` keeps the two tensors it is handed:
the aux states (residual stream entering each captured layer) and the final normed state. Nothing goes through JSON.

Every sglang name used here is listed in ``eaglenest.engines.sglang.engine.SGLANG_INTERNALS`` and fetched through
``sglang_symbol``; this module is imported only when capture is first asked for.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from eaglenest.contracts.layers import engine_layer_ids
from eaglenest.engines.base import Capture
from eaglenest.engines.sglang.args import plan_capture_batches, reorder_aux
from eaglenest.engines.sglang.symbols import sglang_symbol


class _NoPrefixCache(SimpleNamespace):
    """The tree-cache stand-in sglang's offline driver uses: allocation only, never a prefix hit."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def evict(self, params: Any) -> None:
        return None


class SGLangCaptureRunner:
    """One in-process ModelRunner (tp 1) that turns token-id sequences into aux + final normed hidden states."""

    def __init__(self, server_kwargs: dict[str, Any], *, architecture: str, num_layers: int, max_tokens: int):
        self.num_layers = num_layers
        self.architecture = architecture
        self.max_tokens = max_tokens
        ServerArgs = sglang_symbol("sglang.srt.server_args:ServerArgs")
        PortArgs = sglang_symbol("sglang.srt.server_args:PortArgs")
        ModelConfig = sglang_symbol("sglang.srt.configs.model_config:ModelConfig")
        ModelRunner = sglang_symbol("sglang.srt.model_executor.model_runner:ModelRunner")
        self.server_args = ServerArgs(**server_kwargs)
        if self.server_args.enable_dp_attention:
            raise ValueError("in-process capture does not support dp attention; drop enable_dp_attention for capture")
        for name in ("sglang.srt.layers.moe:initialize_moe_config",
                     "sglang.srt.layers.quantization.fp8_utils:initialize_fp8_gemm_config",
                     "sglang.srt.layers.quantization.fp4_utils:initialize_fp4_gemm_config"):
            sglang_symbol(name)(self.server_args)
        port_args = PortArgs.init_new(self.server_args)
        model_config = ModelConfig.from_server_args(self.server_args)
        gpu_id = torch.cuda.current_device() if torch.cuda.is_available() else 0
        runner = ModelRunner(
            model_config=model_config, mem_fraction_static=self.server_args.mem_fraction_static, gpu_id=gpu_id,
            tp_rank=0, tp_size=1, moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1,
            nccl_port=port_args.nccl_port, server_args=self.server_args,
        )
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()  # a no-op with disable_cuda_graph, kept so the runner is fully initialised
        self.runner = runner
        self.model = runner.model
        if not hasattr(self.model, "set_eagle3_layers_to_capture"):
            raise ValueError(f"sglang {architecture} has no EAGLE-3 capture hook (set_eagle3_layers_to_capture); "
                             f"capture this target with the hf engine")
        self._stash: dict[str, Any] = {}
        self._wrap_logits_processor()
        self._current_layers: list[int] | None = None

    # ------------------------------------------------------------------------------------------------- internals
    def _wrap_logits_processor(self) -> None:
        """Keep the tensors the model hands its logits processor; the logits themselves are still computed."""
        owner = getattr(self.model, "language_model", None) or self.model
        lp = owner.logits_processor
        original = lp.forward
        stash = self._stash

        def forward(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
            stash["last"] = hidden_states
            stash["aux"] = aux_hidden_states
            return original(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)

        lp.forward = forward

    def _captured_now(self) -> list[int]:
        owner = getattr(self.model, "language_model", None) or self.model
        return [int(i) for i in owner.model.layers_to_capture]

    def set_layers(self, physical_ids: Sequence[int]) -> list[int]:
        """Ask SGLang to capture ``physical_ids`` via its own hook and check what it really set."""
        wanted = sorted(int(i) for i in physical_ids)
        if self._current_layers == wanted:
            return wanted
        config_ids = engine_layer_ids(wanted, engine="sglang", architecture=self.architecture,
                                      num_layers=self.num_layers)
        self.model.set_eagle3_layers_to_capture(config_ids)
        got = sorted(self._captured_now())
        if got != wanted:
            raise RuntimeError(
                f"sglang set layers_to_capture={got} for eagle ids {config_ids}, expected physical {wanted}: the "
                f"installed sglang's layer numbering differs from 0.5.14's "
                f"(see eaglenest.targets, the architecture's sglang_rule)"
            )
        self._current_layers = wanted
        return wanted

    @torch.inference_mode()
    def _forward(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        Req = sglang_symbol("sglang.srt.managers.schedule_batch:Req")
        ScheduleBatch = sglang_symbol("sglang.srt.managers.schedule_batch:ScheduleBatch")
        ForwardBatch = sglang_symbol("sglang.srt.model_executor.forward_batch_info:ForwardBatch")
        SpeculativeAlgorithm = sglang_symbol("sglang.srt.speculative.spec_info:SpeculativeAlgorithm")
        SglSampling = sglang_symbol("sglang.srt.sampling.sampling_params:SamplingParams")
        r = self.runner
        reqs = []
        for i, seq in enumerate(sequences):
            req = Req(rid=f"eaglenest-capture-{i}", origin_input_text="", origin_input_ids=array("q", list(seq)),
                      sampling_params=SglSampling(temperature=0, max_new_tokens=1))
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.fill_len = len(req.full_untruncated_fill_ids)
            req.logprob_start_len = -1
            req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
            reqs.append(req)
        tree = _NoPrefixCache(page_size=r.server_args.page_size, device=r.device,
                              token_to_kv_pool_allocator=r.token_to_kv_pool_allocator)
        try:
            batch = ScheduleBatch.init_new(
                reqs=reqs, req_to_token_pool=r.req_to_token_pool,
                token_to_kv_pool_allocator=r.token_to_kv_pool_allocator, tree_cache=tree,
                model_config=r.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            forward_batch = ForwardBatch.init_new(batch, r)
            self._stash.clear()
            r.forward(forward_batch)
            aux_list, last = self._stash.get("aux"), self._stash.get("last")
            if not aux_list or last is None:
                raise RuntimeError("the sglang model did not hand aux hidden states to its logits processor; "
                                   "is capture_aux_hidden_states set (set_eagle3_layers_to_capture)?")
            total = sum(len(s) for s in sequences)
            if last.shape[0] != total or any(a.shape[0] != total for a in aux_list):
                raise RuntimeError(f"captured {last.shape[0]} rows for {total} tokens: a prefix hit or chunked "
                                   f"prefill slipped in; capture needs both off")
            aux = torch.stack(aux_list, dim=0)  # [3, T, H], SGLang's capture order (ascending layer index)
            return aux, last
        finally:
            self._stash.clear()
            r.req_to_token_pool.clear()
            r.token_to_kv_pool_allocator.clear()

    # ------------------------------------------------------------------------------------------------------ api
    def capture(self, sequences: Sequence[Sequence[int]], physical_ids: Sequence[int]) -> list[Capture]:
        """Teacher-forced prefill; aux columns in the caller's ``physical_ids`` order, then the final normed state."""
        captured_order = self.set_layers(physical_ids)
        perm = reorder_aux(captured_order, [int(i) for i in physical_ids])
        out: list[Capture | None] = [None] * len(sequences)
        for idx in plan_capture_batches([len(s) for s in sequences], self.max_tokens):
            aux, last = self._forward([sequences[i] for i in idx])
            aux = torch.cat([aux[k] for k in perm], dim=-1).cpu()
            last = last.cpu()
            start = 0
            for i in idx:
                n = len(sequences[i])
                out[i] = Capture(aux_hidden_states=aux[start:start + n].clone(),
                                 last_hidden_state=last[start:start + n].clone())
                start += n
        return [c for c in out if c is not None]

    def close(self) -> None:
        self._stash.clear()
        self.runner = None  # type: ignore[assignment]
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
