"""TargetSpec: the one reader of a target folder (config.json, generation_config.json, safetensors).

Every stage asks a target the same questions (layers, hidden size, vocab, context, eos ids, dtype, architecture, the
embedding and lm_head); they are answered here, from the files, so a trainer or a preflight never instantiates a
(possibly trillion-parameter) model to learn its shape. Multimodal wrappers (Kimi-K2.5) keep the language model
under ``text_config``; that part is what a drafter sees. Tensor shapes come from the safetensors headers through
``safe_open(...).get_slice(name).get_shape()``; no weights are read unless a tensor is asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.targets import TargetArch, arch_for

if TYPE_CHECKING:
    import torch


CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHT_INDEX = "model.safetensors.index.json"


class TargetSpecError(ValueError):
    """A target config that cannot be read or lacks a fact every stage needs."""


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


@dataclass(frozen=True)
class TargetSpec:
    """The target's facts as every stage sees them (the language-model part of ``config.json``).

    Built by :meth:`read` from a folder, :meth:`from_config` from a config dict (an in-memory model), or by hand
    for a check that has no folder; fields a hand-built spec leaves at 0 are unknown.
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str = "?"
    context_length: int = 0
    """the serving context: ``max_position_embeddings`` unless an engine setting lowers it (:meth:`with_context`)"""
    max_position_embeddings: int = 0
    path: str = ""
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    """as config.json writes it (an id or a list); :meth:`eos_token_ids` adds generation_config.json's"""
    dtype: str = "bfloat16"
    """the checkpoint's declared ``torch_dtype`` (bfloat16 when the config names none)"""
    kv_lora_rank: int = 0
    """MLA's latent key/value width (DeepseekV3/Kimi: 512; 0 without MLA): the width of its KV cache entries"""

    # ------------------------------------------------------------------------------------------------ reading
    @classmethod
    def read(cls, path: str | Path, *, context_length: int | None = None, hub: bool = False) -> TargetSpec:
        """A local folder's config.json. ``hub=True`` also takes a hub id (only its config.json is fetched)."""
        folder = Path(path).expanduser()
        cfg_path = folder / CONFIG
        if not cfg_path.is_file() and hub and not folder.exists():
            from transformers.utils import cached_file

            cfg_path = Path(cached_file(str(path), CONFIG))
        if not cfg_path.is_file():
            raise FileNotFoundError(
                f"{cfg_path} not found: the target is needed as a local folder (config.json + safetensors); "
                "download it first (e.g. `huggingface-cli download <id> --local-dir DIR`) and set target.model: DIR"
            )
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TargetSpecError(f"target config {cfg_path} is not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise TargetSpecError(f"target config {cfg_path} must hold a JSON object")
        return cls.from_config(raw, path=str(path), context_length=context_length)

    @classmethod
    def from_config(cls, raw: dict[str, Any], *, path: str = "", context_length: int | None = None,
                    architecture: str | None = None) -> TargetSpec:
        """From a config dict (config.json's content, or ``model.config.to_dict()`` of a loaded model)."""
        tc = raw.get("text_config") or raw
        missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in tc]
        if missing:
            raise TargetSpecError(f"target config {Path(path) / CONFIG} lacks {missing} (also looked under "
                                  f"text_config)")
        heads = int(tc.get("num_attention_heads") or 0)
        hidden = int(tc["hidden_size"])
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        theta = tc.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
        arch = (raw.get("architectures") or tc.get("architectures") or [architecture or "?"])[0]
        max_pos = int(tc.get("max_position_embeddings") or 0)
        return cls(
            path=str(path),
            architecture=str(arch),
            num_layers=int(tc["num_hidden_layers"]),
            hidden_size=hidden,
            vocab_size=int(tc["vocab_size"]),
            max_position_embeddings=max_pos,
            context_length=int(context_length or max_pos),
            num_attention_heads=heads,
            num_key_value_heads=int(tc.get("num_key_value_heads") or heads),
            head_dim=int(tc.get("head_dim") or (hidden // heads if heads else 0)),
            intermediate_size=int(tc.get("intermediate_size") or 4 * hidden),
            rope_theta=float(theta),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
            bos_token_id=tc.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=tc.get("eos_token_id", raw.get("eos_token_id")),
            dtype=str(tc.get("torch_dtype") or tc.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            kv_lora_rank=int(tc.get("kv_lora_rank") or 0),
        )

    @classmethod
    def from_info(cls, info: Any, *, context_length: int | None = None) -> TargetSpec:
        """From a loaded engine's ``TargetInfo`` (a replica whose target is not a local folder)."""
        return cls(path=str(info.model), architecture=str(info.architecture), num_layers=int(info.num_layers),
                   hidden_size=int(info.hidden_size), vocab_size=int(info.vocab_size),
                   max_position_embeddings=int(info.max_position_embeddings or 0),
                   context_length=int(context_length or info.max_position_embeddings or 0), dtype=str(info.dtype),
                   eos_token_id=list(info.eos_token_ids))

    def with_context(self, context_length: int | None) -> TargetSpec:
        """The same target served with a smaller context (``target.sglang.context_length``); None keeps it."""
        return replace(self, context_length=int(context_length)) if context_length else self

    # ------------------------------------------------------------------------------------------------- facts
    @property
    def arch(self) -> TargetArch:
        """The architecture record (``eaglenest.targets``): layer-id rules, capture hooks, widths."""
        return arch_for(self.architecture)

    @property
    def first_id_rule(self) -> bool:
        """SGLang 0.5.14's DeepSeek/Kimi layer numbering applies (``eaglenest.targets.deepseek_v3``)."""
        return self.arch.sglang_rule == "first_id"

    @property
    def folder(self) -> Path:
        return Path(self.path).expanduser()

    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json's eos ids plus generation_config.json's (a chat model often lists its end-of-turn there)."""
        eos = set(_eos_list(self.eos_token_id))
        gen = self.folder / GENERATION_CONFIG
        if self.path and gen.is_file():
            eos.update(_eos_list(json.loads(gen.read_text()).get("eos_token_id")))
        return tuple(sorted(eos))

    # ----------------------------------------------------------------------------------------------- tensors
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> safetensors file name, for single-file and sharded checkpoints."""
        index = self.folder / WEIGHT_INDEX
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder} has no safetensors weights (model.safetensors or "
                                    f"{WEIGHT_INDEX})")
        from safetensors import safe_open

        out: dict[str, str] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                out.update({k: f.name for k in fh.keys()})  # noqa: SIM118 - safe_open has no __iter__
        return out

    def tensor_shape(self, name: str) -> list[int]:
        """One tensor's shape, from its file's header (no weights read)."""
        from safetensors import safe_open

        wmap = self.weight_map()
        if name not in wmap:
            raise KeyError(f"{name} is not a tensor of {self.folder}")
        with safe_open(str(self.folder / wmap[name]), framework="pt") as fh:
            return list(fh.get_slice(name).get_shape())

    def embed_name(self) -> str:
        """The language model's input embedding (vision towers and MTP heads skipped)."""
        names = list(self.weight_map())
        name = _pick(names, "embed_tokens.weight") or _pick(names, "wte.weight")
        if name is None:
            raise KeyError(f"no embedding tensor (*embed_tokens.weight) in {self.folder}")
        return name

    def lm_head_name(self) -> str:
        """The output projection; a tied model's is its embedding."""
        name = _pick(list(self.weight_map()), "lm_head.weight")
        if name is not None:
            return name
        if not self.tie_word_embeddings:
            raise KeyError(f"no lm_head.weight in {self.folder} and tie_word_embeddings is false")
        return self.embed_name()

    def embed_shape(self) -> list[int]:
        return self.tensor_shape(self.embed_name())

    def lm_head_shape(self) -> list[int]:
        return self.tensor_shape(self.lm_head_name())

    def load_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        wmap = self.weight_map()
        if name not in wmap:
            raise KeyError(f"{name} is not a tensor of {self.folder}")
        with safe_open(str(self.folder / wmap[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    def load_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The input embedding ``[V, H]`` and output projection ``[V, H]`` (tied models: the same tensor)."""
        embed_name, head_name = self.embed_name(), self.lm_head_name()
        embed = self.load_tensor(embed_name)
        return embed, (embed if head_name == embed_name else self.load_tensor(head_name))

    def embed_rows(self, rows: list[int]) -> torch.Tensor:
        """A few rows of the input embedding, read by slice (never the whole tensor)."""
        import torch
        from safetensors import safe_open

        name = self.embed_name()
        with safe_open(str(self.folder / self.weight_map()[name]), framework="pt") as fh:
            sl = fh.get_slice(name)
            return torch.stack([sl[r:r + 1][0] for r in rows])


def _pick(names: list[str], suffix: str) -> str | None:
    hits = [n for n in names if n.endswith(suffix) and "vision" not in n and "mtp" not in n]
    return min(hits, key=len) if hits else None
