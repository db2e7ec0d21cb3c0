"""The Kimi-shaped stand-in target: a small DeepseekV3 (MLA + MoE) pre-trained here, grown to Kimi-K2.5's widths.

The Llama stand-in's recipe (``engines.standin``: the same dump reader, tokenizer, pre-training loop and prompt
files) with a DeepseekV3ForCausalLM: MLA attention with q/kv LoRA ranks, a dense first layer, then MoE layers with
a shared expert and sigmoid, bias-corrected top-k routing. The small model (default hidden 1792, 12 layers, 8 heads
of Kimi's head dims, q/kv ranks 384/128, 8 routed experts of 512 chosen 8 at a time + 1 shared) is pre-trained,
then grown by ``engines.widen_deepseek`` to hidden 7168, 61 layers, 64 heads, ranks 1536/512, experts of 2048,
dense intermediate 18432 and a 163,840-id vocabulary, with ``n_routed_experts`` routed experts (``--routed-experts``;
those past the small model's are never routed). Every width grows 4x, so every rescale is a power of two.

Unused vocabulary ids: the tokenizer has 32,000 ids, the wide model 163,840; the extra ``lm_head`` rows are zero,
so their logits are exactly 0, and a zero logit could beat every real one. So the small model is pre-trained *as*
the padded model (``padded_vocab_loss``: the cross entropy over its real logits and the pad ids' zero logits): it
learns to keep its real logits well above 0, since the pad ids are never the answer. ``standin.json`` reports the
probability the wide model gives the pad ids on held-out chats (``pad_mass_max``) and whether any is ever the argmax.

The wide model is written layer by layer into safetensors shards (``shard_bytes`` each) and never sits in memory
whole; each group of tensors is also run, as written, through transformers' own DeepseekV3 modules on a few
held-out chats before it is dropped, so the preservation check sees exactly the weights on disk.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eaglenest.engines.base import render_chat_ids
from eaglenest.engines.standin import StandinSpec, prepare_corpus, pretrain, write_generation_config, write_prompt_files
from eaglenest.engines.widen_deepseek import (
    DeepseekWideShape,
    deepseek_parameters,
    widen_deepseek_config,
    widen_deepseek_layers,
)


@dataclass(frozen=True)
class DeepseekStandinSpec(StandinSpec):
    """The small DeepseekV3's shape and pre-training (fields shared with the Llama stand-in keep their meaning)."""

    hidden_size: int = 1792
    num_layers: int = 12
    num_heads: int = 8
    intermediate_size: int = 4608
    q_lora_rank: int = 384
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    moe_intermediate_size: int = 512
    n_routed_experts: int = 8
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.827
    rope_theta: float = 50000.0
    shard_bytes: int = 4 * 2**30
    """the wide model's safetensors shards are cut at about this size (host memory holds one shard at a time)"""
    check_chats: int = 8
    wide: DeepseekWideShape = field(default_factory=DeepseekWideShape)


TINY_DEEPSEEK = DeepseekStandinSpec(
    vocab_size=400, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
    num_experts_per_tok=2, max_position_embeddings=256, seq_len=32, batch_size=4, train_steps=20, warmup_steps=2,
    tokenizer_chats=100, heldout_records=30, shard_bytes=2**20, check_chats=2,
    wide=DeepseekWideShape(hidden_size=128, num_layers=5, num_heads=4, q_lora_rank=64, kv_lora_rank=32,
                           qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32, intermediate_size=128,
                           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, vocab_size=1024))
"""A CPU-sized preset (``--preset tiny``): every mechanism of the default build at test sizes."""

SMALL_DEEPSEEK = DeepseekStandinSpec(
    hidden_size=1024, intermediate_size=2816,
    wide=DeepseekWideShape(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11264))
"""A smaller GPU preset (``--preset small``) for device sessions too short for Kimi's widths: the same mechanisms and
Kimi's MLA head dims, ranks (1536/512), experts of 2048 and padded 163,840-id vocabulary, at hidden 4096, 32 heads
and 32 layers (default taps [2, 16, 29], as the Llama stand-in's); a 1024-wide small model of 12 layers, so every
width still grows 4x. With ``--routed-experts 4 --experts-per-token 4``: 6.6B parameters, 13.3 GB."""

DEEPSEEK_PRESETS = {"default": DeepseekStandinSpec(), "small": SMALL_DEEPSEEK, "tiny": TINY_DEEPSEEK}
"""``standin-target --arch deepseek_v3 --preset NAME``: default = Kimi-K2.5's widths"""


def small_config(spec: DeepseekStandinSpec, tokenizer: Any) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads, q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok, n_shared_experts=spec.n_shared_experts,
        first_k_dense_replace=spec.first_k_dense_replace, routed_scaling_factor=spec.routed_scaling_factor,
        n_group=1, topk_group=1, norm_topk_prob=True, max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, rms_norm_eps=1e-6,
        num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def padded_vocab_loss(pad_ids: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """Next-token cross entropy of the model with ``pad_ids`` more vocabulary ids whose logits are fixed at 0."""
    log_pad = math.log(pad_ids) if pad_ids else -math.inf

    def loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch).logits[:, :-1].float()
        lse = torch.logaddexp(torch.logsumexp(logits, -1), torch.tensor(log_pad, device=logits.device))
        return (lse - logits.gather(-1, batch[:, 1:, None]).squeeze(-1)).mean()

    return loss


def size_report(spec: DeepseekStandinSpec, vocab: int = 32000) -> dict[str, Any]:
    """Parameters and bytes of the wide model (``vocab``: the small model's) before anything is built."""
    small = small_config(spec, _Vocab(vocab)).to_dict()
    counts = deepseek_parameters(widen_deepseek_config(small, spec.wide))
    return {**counts, "gb": round(counts["bytes"] / 1e9, 1)}


@dataclass
class _Vocab:
    n: int
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __len__(self) -> int:
        return self.n


def build_deepseek_standin(dump: str | Path, out_dir: str | Path, spec: DeepseekStandinSpec | None = None, *,
                           device: str = "cuda", num_train_prompts: int = 2048, num_heldout_prompts: int = 128,
                           max_prompt_tokens: int = 192, train_after_cut: int = 0,
                           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the Kimi-shaped stand-in into ``out_dir`` (``model/``, ``base/``, ``prompts/``, ``standin.json``)."""
    from transformers import DeepseekV3ForCausalLM

    spec = spec or DeepseekStandinSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = size_report(spec, spec.vocab_size)
    log(f"standin (deepseek_v3): wide model {size['total'] / 1e9:.2f}B parameters, {size['gb']} GB "
        f"({spec.wide.n_routed_experts} routed experts: {size['routed'] / 1e9:.2f}B), "
        f"{size['active_per_token'] / 1e9:.2f}B active per token")
    free = shutil.disk_usage(out).free
    if size["bytes"] > free:
        raise ValueError(f"{out}: {free / 1e9:.1f} GB free on disk, the wide model needs {size['gb']} GB "
                         "(fewer --routed-experts)")
    report: dict[str, Any] = {"arch": "deepseek_v3", "spec": asdict(spec), "dump": str(dump), "size": size}
    t0 = time.perf_counter()
    corpus = prepare_corpus(dump, vocab_size=spec.vocab_size, tokenizer_chats=spec.tokenizer_chats,
                            heldout_records=spec.heldout_records, report=report, log=log)
    tokenizer = corpus.tokenizer
    cfg = small_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = DeepseekV3ForCausalLM(cfg).float().to(device)
    pad = spec.wide.vocab_size - len(tokenizer)
    report["pretrain"] = pretrain(model, corpus.stream, spec, device, log, loss_fn=padded_vocab_loss(pad))
    model.eval()
    model.save_pretrained(out / "base", safe_serialization=True)
    tokenizer.save_pretrained(out / "base")

    t = time.perf_counter()
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32  # fp32 on CPU: exact check
    wide_dir = out / "model"
    checks = [render_chat_ids(tokenizer, c, add_generation_prompt=False)[:256]
              for c in corpus.heldout_chats(spec.check_chats)] or [[tokenizer.bos_token_id]]
    report["preservation"], written = write_wide(model, spec.wide, wide_dir, dtype=dtype, device=device,
                                                 shard_bytes=spec.shard_bytes, check_ids=checks)
    tokenizer.save_pretrained(wide_dir)
    write_generation_config(wide_dir, tokenizer)
    report["wide"] = {"parameters": size["total"], "active_per_token": size["active_per_token"],
                      "bytes_written": written, "base_parameters": sum(p.numel() for p in model.parameters()),
                      "seconds": round(time.perf_counter() - t, 1), "path": str(wide_dir)}
    pres = report["preservation"]
    log(f"standin: widened to {size['total'] / 1e9:.2f}B parameters, {written / 1e9:.1f} GB written (max logit "
        f"difference {pres['max_abs_logit_diff']:.3g}, top-1 agreement {pres['top1_agreement']:.4f}, pad-id "
        f"probability at most {pres['pad_mass_max']:.3g})")
    report["prompts"] = write_prompt_files(corpus.read.records, corpus.split, tokenizer, out / "prompts",
                                           num_train_prompts, num_heldout_prompts, max_prompt_tokens,
                                           train_after_cut=train_after_cut)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "standin.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


@torch.no_grad()
def write_wide(small: Any, wide: DeepseekWideShape, folder: Path, *, dtype: torch.dtype, device: str,
               shard_bytes: int, check_ids: list[list[int]]) -> tuple[dict[str, Any], int]:
    """Grow ``small`` into ``folder`` shard by shard, running each layer as written on ``check_ids``.

    Returns the preservation report (the wide logits vs the small model's) and the bytes written.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    small_cfg = small.config.to_dict()
    wcfg = widen_deepseek_config(small_cfg, wide)
    wcfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    runner = _LayerRunner(wcfg, check_ids, dtype, device)
    shard: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []
    size, written = 0, 0

    def flush() -> None:
        nonlocal shard, size, written
        if shard:
            save_file(shard, str(folder / f"part-{len(names):05d}.safetensors"), metadata={"format": "pt"})
            names.append(list(shard))
            written += size
            shard, size = {}, 0

    state = {k: v.detach() for k, v in small.state_dict().items()}
    for key, group in widen_deepseek_layers(state, small_cfg, wide, dtype=dtype, device=device):
        runner.apply(key, group)
        for name, tensor in group.items():
            shard[name] = tensor.contiguous().cpu()
            size += tensor.numel() * tensor.element_size()
        del group
        if size >= shard_bytes:
            flush()
    flush()
    weight_map = {}
    for k, keys in enumerate(names):
        final = f"model-{k + 1:05d}-of-{len(names):05d}.safetensors"
        (folder / f"part-{k:05d}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(wcfg, indent=2, sort_keys=True) + "\n")
    return runner.compare(small, state["lm_head.weight"].shape[0]), written


class _LayerRunner:
    """transformers' DeepseekV3 modules, one wide layer at a time, over a few token sequences (batch 1 each)."""

    def __init__(self, wcfg: dict, check_ids: list[list[int]], dtype: torch.dtype, device: str) -> None:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        self.cfg = DeepseekV3Config(**{k: v for k, v in wcfg.items() if k not in ("torch_dtype", "rope_scaling",
                                                                                  "rope_theta")})
        self.cfg._attn_implementation = "eager"
        self.cfg._experts_implementation = "eager"
        self.dtype, self.device = dtype, device
        self.ids = [torch.tensor([x], device=device) for x in check_ids]
        rope = DeepseekV3RotaryEmbedding(self.cfg).to(device)
        self.pos = []
        self.masks = []
        for x in self.ids:
            t = x.shape[1]
            pos = torch.arange(t, device=device)[None]
            cos, sin = rope(torch.zeros(1, dtype=dtype, device=device), pos)
            self.pos.append((cos, sin))
            mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
            self.masks.append(mask[None, None])
        self.hidden: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def apply(self, key: str | int, group: dict[str, torch.Tensor]) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        if key == "embed":
            emb = group["model.embed_tokens.weight"]
            self.hidden = [emb[x] for x in self.ids]
            return
        if key == "head":
            norm = DeepseekV3RMSNorm(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps).to(self.device, self.dtype)
            norm.weight.copy_(group["model.norm.weight"])
            self.logits = [(norm(h) @ group["lm_head.weight"].T).float()[0] for h in self.hidden]
            return
        p = f"model.layers.{key}."
        sd = {k[len(p):]: v for k, v in group.items()}
        experts = sorted({int(k.split(".")[2]) for k in sd if k.startswith("mlp.experts.")})
        if experts:  # transformers keeps routed experts fused: (E, 2I, H) gate|up and (E, H, I) down
            sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                     sd.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                          for e in experts])
            sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
        with torch.device("meta"):
            layer = DeepseekV3DecoderLayer(self.cfg, key)
        layer.load_state_dict(sd, assign=True, strict=True)
        layer.eval()
        self.hidden = [layer(h, attention_mask=m, position_embeddings=pe, position_ids=None)
                       for h, m, pe in zip(self.hidden, self.masks, self.pos, strict=True)]
        del layer, sd

    def compare(self, small: Any, vocab: int) -> dict[str, Any]:
        """Max |logit difference| over the small vocabulary, top-1 agreement, and the wide model's pad ids."""
        diffs, agree, total, pad_mass, pad_top = [], 0, 0, 0.0, 0
        for x, wide in zip(self.ids, self.logits, strict=True):
            a = small(input_ids=x).logits.float()[0]
            diffs.append(float((a - wide[:, :vocab]).abs().max()))
            agree += int((a.argmax(-1) == wide.argmax(-1)).sum())
            total += a.shape[0]
            probs = wide.softmax(-1)
            pad_mass = max(pad_mass, float(probs[:, vocab:].sum(-1).max())) if wide.shape[1] > vocab else pad_mass
            pad_top += int((wide.argmax(-1) >= vocab).sum())
        return {"max_abs_logit_diff": max(diffs), "top1_agreement": agree / max(total, 1), "tokens": total,
                "pad_mass_max": pad_mass, "pad_argmax_tokens": pad_top,
                "pad_logits_all_zero": all(bool((w[:, vocab:] == 0).all()) for w in self.logits)}


def with_experts(spec: DeepseekStandinSpec, routed: int | None = None, per_token: int | None = None
                 ) -> DeepseekStandinSpec:
    """The spec with ``routed`` routed experts in the wide model and ``per_token`` chosen per token (in both models:
    the count must not change); the small model keeps at most ``routed`` experts. None keeps a value."""
    wide = spec.wide
    wide = replace(wide, n_routed_experts=routed or wide.n_routed_experts,
                   num_experts_per_tok=per_token or wide.num_experts_per_tok)
    k = wide.num_experts_per_tok
    small_e = min(max(spec.n_routed_experts, k), wide.n_routed_experts)
    if k > wide.n_routed_experts:
        raise ValueError(f"{k} experts per token need at least {k} routed experts (got {wide.n_routed_experts})")
    return replace(spec, wide=wide, num_experts_per_tok=k, n_routed_experts=small_e)
