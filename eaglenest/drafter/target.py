"""What the drafter needs from the target folder: its shape facts and two frozen tensors (embedding, lm_head).

Read straight from ``config.json`` and the safetensors files, so a trainer never instantiates the (possibly
trillion-parameter) target just to copy 2 of its tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.config import TargetConfig


@dataclass(frozen=True)
class TargetFacts:
    """The target's shape as the drafter sees it (from the language-model part of ``config.json``)."""

    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None


def resolve_target_path(cfg: TargetConfig) -> str:
    """``tiny`` is the embedded tiny target (built on first use); anything else is a local folder."""
    if cfg.model == "tiny":
        from eaglenest.engines.tiny import ensure_tiny_target

        return str(ensure_tiny_target(cfg.tiny, cfg.cache_dir))
    return cfg.model


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("text_config") or raw


def read_target_facts(path: str | Path) -> TargetFacts:
    """Parse ``config.json`` of a local target folder; a hub id must be downloaded first (said in the error)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{cfg_path} not found: the drafter needs the target as a local folder (config.json + safetensors); "
            "download it first (e.g. `huggingface-cli download <id> --local-dir DIR`) and set target.model: DIR"
        )
    raw = json.loads(cfg_path.read_text())
    tc = _text_config(raw)
    heads = int(tc["num_attention_heads"])
    hidden = int(tc["hidden_size"])
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    theta = tc.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
    return TargetFacts(
        path=str(path),
        num_layers=int(tc["num_hidden_layers"]),
        hidden_size=hidden,
        vocab_size=int(tc["vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(tc.get("num_key_value_heads") or heads),
        head_dim=int(tc.get("head_dim") or hidden // heads),
        intermediate_size=int(tc.get("intermediate_size") or 4 * hidden),
        max_position_embeddings=int(tc.get("max_position_embeddings") or 2048),
        rope_theta=float(theta),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
        bos_token_id=tc.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_id=tc.get("eos_token_id", raw.get("eos_token_id")),
    )


def _weight_index(path: Path) -> dict[str, str]:
    """tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _pick(names: list[str], suffix: str) -> str | None:
    hits = [n for n in names if n.endswith(suffix) and "vision" not in n and "mtp" not in n]
    return min(hits, key=len) if hits else None


def load_target_embed_and_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding ``[V, H]`` and output projection ``[V, H]`` (tied models: the same tensor)."""
    from safetensors import safe_open

    path = Path(path)
    wmap = _weight_index(path)
    names = list(wmap)
    embed_name = _pick(names, "embed_tokens.weight") or _pick(names, "wte.weight")
    head_name = _pick(names, "lm_head.weight")
    if embed_name is None:
        raise KeyError(f"no embedding tensor (*embed_tokens.weight) in {path}")
    if head_name is None:
        if not read_target_facts(path).tie_word_embeddings:
            raise KeyError(f"no lm_head.weight in {path} and tie_word_embeddings is false")
        head_name = embed_name

    def load(name: str) -> torch.Tensor:
        with safe_open(str(path / wmap[name]), framework="pt") as f:
            return f.get_tensor(name)

    embed = load(embed_name)
    head = embed if head_name == embed_name else load(head_name)
    return embed, head
