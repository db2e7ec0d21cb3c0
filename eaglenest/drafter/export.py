"""Export: an HF-style folder that SGLang loads as ``LlamaForCausalLMEagle3`` (or vLLM, with its layer-id rule).

``config.json`` + ``model.safetensors`` (+ ``eaglenest_drafter.json``, the sidecar with the physical layer ids and the
target). Aux layer ids are written in the serving engine's convention (``eaglenest.contracts.layers``): SGLang adds 1 to
what it reads, so it gets physical - 1; vLLM reads physical ids as they are. The sidecar lets every eaglenest loader
translate back and cross-check. Unknown tensor names are silently dropped by SGLang, so the exporter refuses a
missing tensor or a shape that does not fit the config before writing anything.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from eaglenest.contracts.layers import to_sglang_ids, to_vllm_ids
from eaglenest.drafter.model import DrafterModelConfig, Eagle3Drafter

Format = Literal["sglang", "vllm"]
SIDECAR = "eaglenest_drafter.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

REQUIRED_TENSORS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
OPTIONAL_TENSORS = ("embed_tokens.weight",)


class ExportError(ValueError):
    """A drafter that would not load (or would load wrong) in the serving engine."""


def expected_shapes(cfg: DrafterModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
    }


def validate_tensors(tensors: dict[str, torch.Tensor], cfg: DrafterModelConfig) -> None:
    """Every required tensor present, no stray names, shapes and dtypes that fit ``cfg``, d2t/t2d consistent."""
    shapes = expected_shapes(cfg)
    problems = []
    missing = [k for k in REQUIRED_TENSORS if k not in tensors]
    if missing:
        problems.append(f"missing tensors {missing}")
    unknown = sorted(set(tensors) - set(REQUIRED_TENSORS) - set(OPTIONAL_TENSORS))
    if unknown:
        problems.append(f"unexpected tensors {unknown} (SGLang would silently drop them)")
    for name, t in tensors.items():
        want = shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            problems.append(f"{name} has shape {tuple(t.shape)}, the config needs {want}")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t must be int64, got {tensors['d2t'].dtype}")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        problems.append(f"t2d must be bool, got {tensors['t2d'].dtype}")
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            problems.append(f"{name} holds NaN/inf values")
    if not problems and "d2t" in tensors and "t2d" in tensors:
        from eaglenest.drafter.vocab import VocabMapping

        try:
            VocabMapping.from_maps(tensors["d2t"], tensors["t2d"])
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ExportError("refusing to export this drafter: " + "; ".join(problems))


def config_layer_ids(physical: list[int], fmt: Format) -> list[int]:
    if fmt == "sglang":
        return to_sglang_ids(physical)
    if fmt == "vllm":
        return to_vllm_ids(physical)
    raise ExportError(f"unknown export format {fmt!r}; use 'sglang' or 'vllm'")


def physical_layer_ids(config_ids: list[int], fmt: Format) -> list[int]:
    """Inverse of :func:`config_layer_ids`."""
    if fmt == "sglang":
        return [int(i) + 1 for i in config_ids]
    if fmt == "vllm":
        return [int(i) for i in config_ids]
    raise ExportError(f"unknown export format {fmt!r}; use 'sglang' or 'vllm'")


def hf_config(cfg: DrafterModelConfig, fmt: Format, dtype: str) -> dict[str, Any]:
    """``config.json`` per the loader contract (reference: SGLang 0.5.x ``llama_eagle3.py``; vLLM ``llama_eagle3``)."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": config_layer_ids(cfg.aux_layer_ids, fmt),
            "use_aux_hidden_state": True,
        },
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out


def export_tensors(
    tensors: dict[str, torch.Tensor],
    cfg: DrafterModelConfig,
    output_dir: str | Path,
    *,
    fmt: Format = "sglang",
    dtype: str = "bfloat16",
    extra_sidecar: dict[str, Any] | None = None,
) -> Path:
    """Validate and write an export folder (atomically: a half-written export never replaces a good one)."""
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    config_layer_ids(cfg.aux_layer_ids, fmt)  # validates fmt
    validate_tensors(tensors, cfg)
    td = DTYPES[dtype]
    out_tensors = {
        k: (v.to(td) if v.is_floating_point() else v).detach().to("cpu").contiguous() for k, v in tensors.items()
    }
    sidecar = {
        "format": fmt,
        "aux_layer_ids_physical": list(cfg.aux_layer_ids),
        "config_aux_layer_ids": config_layer_ids(cfg.aux_layer_ids, fmt),
        "layer_id_convention": "physical - 1 (SGLang adds 1 back)" if fmt == "sglang" else "physical (vLLM)",
        "target": cfg.target,
        "target_num_layers": cfg.target_num_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "target_vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "dtype": dtype,
        "includes_embedding": "embed_tokens.weight" in out_tensors,
        "drafter_config": cfg.to_dict(),
        **(extra_sidecar or {}),
    }
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(out_tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, fmt, dtype), indent=2) + "\n")
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_drafter(
    drafter: Eagle3Drafter,
    output_dir: str | Path,
    *,
    fmt: Format = "sglang",
    dtype: str = "bfloat16",
    include_embedding: bool = True,
    extra_sidecar: dict[str, Any] | None = None,
) -> Path:
    """Export an in-memory drafter."""
    tensors = {k: v.detach().cpu() for k, v in drafter.state_dict().items()
               if include_embedding or k != "embed_tokens.weight"}
    return export_tensors(tensors, drafter.config, output_dir, fmt=fmt, dtype=dtype, extra_sidecar=extra_sidecar)


def export_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    fmt: Format = "sglang",
    dtype: str = "bfloat16",
    include_embedding: bool = True,
) -> Path:
    """Export a training checkpoint (a checkpoint folder or a training output folder: its newest checkpoint).

    The frozen embedding is copied from the target recorded in the checkpoint (it is not stored in checkpoints).
    """
    from eaglenest.drafter.checkpoint import find_latest_checkpoint, load_training_checkpoint

    src = find_latest_checkpoint(checkpoint)
    if src is None:
        raise FileNotFoundError(
            f"no drafter training checkpoint under {checkpoint} (expected drafter.safetensors, train_state.json, ...; "
            "run `eaglenest train` first or pass the checkpoint folder)"
        )
    ckpt = load_training_checkpoint(src)
    tensors = dict(ckpt.weights)
    if include_embedding:
        from eaglenest.drafter.target import load_target_embed_and_head

        try:
            embed, _ = load_target_embed_and_head(ckpt.config.target)
        except FileNotFoundError as e:
            raise ExportError(
                f"cannot copy the target embedding from {ckpt.config.target!r} ({e}); pass --no-embedding to export "
                "without it (SGLang and vLLM then share the target's embedding)"
            ) from e
        tensors["embed_tokens.weight"] = embed
    return export_tensors(
        tensors, ckpt.config, output_dir, fmt=fmt, dtype=dtype,
        extra_sidecar={"trained_steps": ckpt.step, "vocab_fingerprint": ckpt.mapping.fingerprint(),
                       "source_checkpoint": str(src)},
    )


def read_export_config(export_dir: str | Path) -> tuple[DrafterModelConfig, dict[str, Any], dict[str, Any]]:
    """(drafter config with physical ids, config.json, sidecar); refuses an export whose two records disagree."""
    d = Path(export_dir)
    for f in ("config.json", SIDECAR, WEIGHTS):
        if not (d / f).is_file():
            raise FileNotFoundError(
                f"{d / f} not found: {d} is not an eaglenest drafter export (run `eaglenest export` or "
                "`eaglenest train`, which writes OUT/export)"
            )
    hf = json.loads((d / "config.json").read_text())
    side = json.loads((d / SIDECAR).read_text())
    cfg = DrafterModelConfig.from_dict(side["drafter_config"])
    fmt = side.get("format")
    written = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if written is None or physical_layer_ids(written, fmt) != cfg.aux_layer_ids:
        raise ExportError(
            f"{d}: config.json eagle_aux_hidden_state_layer_ids {written} in {fmt} convention does not give the "
            f"physical ids {cfg.aux_layer_ids} recorded in {SIDECAR}; re-export the checkpoint"
        )
    if hf.get("architectures") != [ARCHITECTURE] or hf.get("num_hidden_layers") != 1:
        raise ExportError(f"{d}: config.json is not a 1-layer {ARCHITECTURE} drafter")
    return cfg, hf, side


def load_drafter(
    export_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    target_embedding: torch.Tensor | None = None,
) -> Eagle3Drafter:
    """Load an export; the model's ``config.aux_layer_ids`` are physical ids whatever the export format.

    Without an embedding in the file, ``target_embedding`` (or the recorded target's) is used.
    """
    cfg, _, side = read_export_config(export_dir)
    tensors = load_file(str(Path(export_dir) / WEIGHTS))
    validate_tensors(tensors, cfg)
    if "embed_tokens.weight" not in tensors:
        if target_embedding is None:
            from eaglenest.drafter.target import load_target_embed_and_head

            target_embedding, _ = load_target_embed_and_head(side["target"])
        tensors["embed_tokens.weight"] = target_embedding
    model = Eagle3Drafter(cfg)
    load_dtype = dtype or DTYPES.get(side.get("dtype", "float32"), torch.float32)
    model.to(load_dtype)
    model.load_state_dict({k: v.to(load_dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                          strict=True)
    return model.to(device).eval()
