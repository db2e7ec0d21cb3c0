"""Small on-disk targets and EAGLE-3 drafters for the SGLang backend tests (config + tiny safetensors, no training).

The drafter folder has the layout of eaglenest's SGLang export: config.json (LlamaForCausalLMEagle3, one layer,
eagle_config ids = physical - 1), the eaglenest sidecar with the physical ids, and safetensors with the weight names
SGLang's loader maps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglenest.drafters.eagle3.format import SIDECAR


def write_target(folder: Path, *, num_layers: int = 8, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                 vocab: int = 1024, context: int = 2048, architecture: str = "LlamaForCausalLM",
                 model_type: str = "llama") -> Path:
    """A target folder with config.json only (enough for ServerArgs / ModelConfig / our preflight)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": hidden * 2, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": context,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def write_eagle3_drafter(folder: Path, *, physical_ids: Sequence[int], hidden: int = 128, heads: int = 4,
                         kv_heads: int = 2, vocab: int = 1024, draft_vocab: int = 256, context: int = 2048,
                         config_ids: Sequence[int] | None = None, architecture: str = "LlamaForCausalLMEagle3",
                         sidecar: bool = True, drop_weights: Sequence[str] = (), fc_in: int | None = None,
                         extra_config: dict[str, Any] | None = None) -> Path:
    """An EAGLE-3 drafter folder in SGLang's format (random small weights; shapes as the exporter writes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = list(config_ids) if config_ids is not None else [int(i) - 1 for i in physical_ids]
    inter = hidden * 2
    head_dim = hidden // heads
    cfg: dict[str, Any] = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "max_position_embeddings": context, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    cfg.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if sidecar:
        (folder / SIDECAR).write_text(json.dumps({"format": "sglang",
                                                  "aux_layer_ids_physical": [int(i) for i in physical_ids]}))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(hidden, fc_in or 3 * hidden),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(vocab) < draft_vocab,  # d2t all 0: draft id i is target id i
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for name in drop_weights:
        tensors.pop(name)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def export_eagle3_drafter(folder: Path, *, physical_ids: Sequence[int], target_layers: int = 8, hidden: int = 128,
                          heads: int = 4, kv_heads: int = 2, vocab: int = 1024, draft_vocab: int = 256,
                          context: int = 2048) -> Path:
    """A drafter written by eaglenest's own exporter (drafter.export), untrained weights."""
    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter

    cfg = DrafterModelConfig(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        intermediate_size=hidden * 2, vocab_size=vocab, draft_vocab_size=draft_vocab,
        aux_layer_ids=[int(i) for i in physical_ids], target_hidden_size=hidden, target_num_layers=target_layers,
        max_position_embeddings=context,
    )
    torch.manual_seed(0)
    return export_drafter(Eagle3Drafter(cfg), folder, fmt="sglang")
