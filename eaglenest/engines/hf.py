"""The transformers backend of TargetEngine: any device, any dtype, the CPU default and the reference for SGLang."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eaglenest.config import TargetConfig
from eaglenest.contracts.layers import default_aux_layer_ids, validate_aux_layer_ids
from eaglenest.contracts.target import TargetSpec
from eaglenest.engines.base import Capture, CaptureHint, Generation, SamplingParams, TargetEngine, TargetInfo
from eaglenest.engines.hf_compat import cache_kwargs, new_dynamic_cache, output_cache
from eaglenest.engines.location import resolve_target_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is refused with the fix."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("target.device is 'cuda' but no CUDA device is visible; set target.device: cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_hf_model(path: str, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """Load tokenizer + causal LM the same way for the tiny target and for real targets (safetensors only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
    )
    model.to(device).eval()
    return tokenizer, model


class HFEngine(TargetEngine):
    """Target engine on ``transformers``: batched left-padded decoding with a KV cache and teacher-forced capture."""

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str, aux_layer_ids: Sequence[int] | None = None):
        import transformers

        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        eos = set()
        for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if src is None:
                continue
            eos.update([src] if isinstance(src, int) else list(src))
        # the loaded model's config is the target's config.json (for a folder target, TargetSpec.read reads the same)
        spec = TargetSpec.from_config(model.config.to_dict(), path=model_name, architecture=type(model).__name__)
        self.info = TargetInfo.from_spec(spec, dtype=str(self.dtype).removeprefix("torch."), engine="hf",
                                         engine_version=f"transformers-{transformers.__version__}", eos_token_ids=eos)
        self.aux_layer_ids = validate_aux_layer_ids(
            aux_layer_ids or default_aux_layer_ids(self.info.num_layers), self.info.num_layers
        )

    @classmethod
    def from_config(cls, cfg: TargetConfig) -> HFEngine:
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        path = resolve_target_path(cfg)
        tokenizer, model = load_hf_model(path, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
        if cfg.cpu_kernels == "auto":
            from eaglenest.kernels import pack_linears

            pack_linears(model)  # a no-op off CPU / fp32 or where the kernel cannot be built
        return cls(model, tokenizer, model_name=path, aux_layer_ids=cfg.aux_layer_ids)

    # ------------------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((b, longest), pad, dtype=torch.long)
        mask = torch.zeros((b, longest), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token sits in the last column
            ids[i, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, longest - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        gens = [_row_generator(sampling.seed, i, self.device) for i in range(b)]
        cache = new_dynamic_cache(self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out_tokens: list[list[int]] = [[] for _ in range(b)]
        finish: list[str | None] = [None] * b
        eos = set(self.info.eos_token_ids)
        step_ids, step_pos = ids, positions
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                             **cache_kwargs(self.model, cache))
            cache = output_cache(out)
            logits = out.logits[:, -1, :].float()
            nxt = [sample_token(logits[i], sampling, gens[i]) for i in range(b)]
            for i, tok in enumerate(nxt):
                if finish[i] is not None:
                    continue
                out_tokens[i].append(tok)
                at_eos = tok in eos and not sampling.ignore_eos
                if at_eos or sampling.stop and self._hits_stop(out_tokens[i], sampling.stop):
                    finish[i] = "stop"
            if all(f is not None for f in finish):
                break
            step_ids = torch.tensor(nxt, dtype=torch.long, device=self.device).unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
        return [self._finish(p, toks, f or "length", sampling) for p, toks, f in zip(prompts, out_tokens, finish,
                                                                                      strict=True)]

    def _hits_stop(self, tokens: list[int], stops: Sequence[str]) -> bool:
        tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _finish(self, prompt: Sequence[int], tokens: list[int], reason: str, sampling: SamplingParams) -> Generation:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in sampling.stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        return Generation(token_ids=tokens, text=text, finish_reason=reason, prompt_tokens=len(prompt))  # type: ignore[arg-type]

    # --------------------------------------------------------------------------------------------------- capture
    @torch.no_grad()
    def capture(self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None, *,
                hints: Sequence[CaptureHint | None] | None = None) -> list[Capture]:
        ids_list = validate_aux_layer_ids(layer_ids if layer_ids is not None else self.aux_layer_ids,
                                          self.info.num_layers)
        if not sequences:
            return []
        if any(len(s) == 0 for s in sequences):
            raise ValueError("empty sequence: capture needs at least one token per sequence")
        b, longest = len(sequences), max(len(s) for s in sequences)
        ids = torch.full((b, longest), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, longest), dtype=torch.long)
        for i, s in enumerate(sequences):  # right padding: real tokens keep positions 0..T-1, causality hides pads
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            mask[i, : len(s)] = 1
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        out = base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), output_hidden_states=True,
                   use_cache=False)
        hs = out.hidden_states
        aux = torch.cat([hs[i] for i in ids_list], dim=-1)
        last = out.last_hidden_state
        return [Capture(aux_hidden_states=aux[i, : len(s)].cpu(), last_hidden_state=last[i, : len(s)].cpu())
                for i, s in enumerate(sequences)]

    def lm_head_weight(self) -> torch.Tensor:
        """The target's output projection (soft labels are recomputed from the stored final normed state)."""
        return self.model.get_output_embeddings().weight

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight


def _row_generator(seed: int | None, row: int, device: torch.device) -> torch.Generator | None:
    """A per-request RNG so a sampled answer does not depend on the other requests in the batch."""
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) * 1_000_003 + row)
    return g


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else temperature + nucleus sampling on the CPU RNG."""
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    probs = top_p_filter(probs, sampling.top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches ``top_p``; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)
