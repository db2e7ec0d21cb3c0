"""The drafter export folder, written and read only here: what SGLang loads as ``LlamaForCausalLMEagle3`` (the
``llama`` draft shape; or vLLM) or ``Eagle3DeepseekV2ForCausalLM`` (the ``mla`` shape, SGLang's
``models/kimi_k25_eagle3.py``).

``config.json`` + ``model.safetensors`` + ``eaglenest_drafter.json`` (the sidecar: the physical layer ids the drafter
was trained on, the target, the drafter config) + ``README.md`` (how to launch it in each engine, ``serving.py``). Aux
layer ids in config.json are written in each serving engine's convention (``eaglenest.contracts.layers``) under the
key that engine reads (``engine_ids.py``): SGLang reads ``eagle_config``'s and applies its rule for the target's
architecture (Llama: +1, so it gets physical - 1 there); vLLM reads the top-level key as physical ids. The default
format (``both``) writes both, so one folder loads right in either engine. The sidecar lets every eaglenest reader
translate back and cross-check. Unknown tensor names are silently dropped by SGLang, so the writer refuses a missing
tensor or a shape that does not fit the config before writing anything, and every reader of an export goes through
:func:`read_drafter` / :func:`read_export_config`.

The two shapes differ in ``config.json`` (MLA: ``model_type: deepseek_v3``, the transformers config class SGLang and
vLLM both read, with the MLA ranks) and in the attention tensors. SGLang's MLA loader maps a name by prefixing
``model.`` (``layers.0.`` becomes ``midlayer.``), so an MLA export's names carry no ``model.`` prefix, and it fuses
``q_a_proj`` and ``kv_a_proj_with_mqa`` itself (both must be present, or neither is loaded).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.contracts.layers import ENGINES, LayerIdError, engine_captured_layers, engine_layer_ids
from eaglenest.drafters.eagle3.config import DrafterModelConfig
from eaglenest.drafters.eagle3.engine_ids import (
    DEFAULT_FORMAT,
    FORMAT_ENGINES,
    IDS_KEY,
    WRITTEN,
    Format,
    FormatError,
    check_format,
    eagle_config_convention,
    id_keys,
    written_ids,
)
from eaglenest.drafters.eagle3.layout import (
    ARCHITECTURE,
    ARCHITECTURES,
    FC_NORM_WEIGHTS,
    MLA_ARCHITECTURE,
    MLA_REQUIRED_DRAFT_WEIGHTS,
    MODEL_TYPES,
    OPTIONAL_TENSORS,
    REQUIRED_DRAFT_WEIGHTS,
    REQUIRED_TENSORS,
    draft_shape_of,
    expected_shapes,
    mla_config,
    required_draft_weights,
    required_tensors,
)

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SIDECAR = "eaglenest_drafter.json"
"""Written next to config.json; records the physical aux layer ids the drafter trained on and its target."""
README = "README.md"
"""Written next to the weights: the exact launch settings for each engine the format serves."""
DTYPE_NAMES = ("bfloat16", "float16", "float32")

SIDECAR_ID_KEYS = ("aux_layer_ids_physical", "aux_layer_ids", "physical_aux_layer_ids", "physical_layer_ids")
"""Where a sidecar records the physical ids: the writer uses the first; the others are read from older exports
(``drafter_config.aux_layer_ids`` is read last)."""

__all__ = ["ARCHITECTURE", "ARCHITECTURES", "CONFIG", "DEFAULT_FORMAT", "FC_NORM_WEIGHTS", "MLA_ARCHITECTURE",
           "MLA_REQUIRED_DRAFT_WEIGHTS", "MODEL_TYPES", "OPTIONAL_TENSORS", "README", "REQUIRED_DRAFT_WEIGHTS",
           "REQUIRED_TENSORS", "SIDECAR", "WEIGHTS", "DrafterExport", "DrafterFormatError", "ExportError", "Format",
           "engine_config_ids",
           "draft_shape_of", "expected_shapes", "hf_config", "read_drafter", "read_export_config",
           "required_draft_weights", "required_tensors", "sidecar_record", "validate_tensors",
           "vocab_mapping_problems", "write_export"]


class ExportError(ValueError):
    """A drafter that would not load (or would load wrong) in the serving engine."""


class DrafterFormatError(ValueError):
    """A folder that is not a readable drafter export (missing or malformed config.json)."""


# ------------------------------------------------------------------------------------------------------ layer ids
def _check_format(fmt: str) -> None:
    try:
        check_format(fmt)
    except FormatError as e:
        raise ExportError(str(e)) from None


def engine_config_ids(cfg: DrafterModelConfig, fmt: Format = DEFAULT_FORMAT) -> dict[str, list[int]]:
    """``{engine: ids}`` for each engine ``fmt`` is written for: the ids that make that engine capture exactly the
    physical layers the drafter trained on, by the target's architecture (``contracts.layers.engine_layer_ids``)."""
    _check_format(fmt)
    out = {}
    for engine in FORMAT_ENGINES[fmt]:
        try:
            out[engine] = engine_layer_ids(cfg.aux_layer_ids, engine=engine, architecture=cfg.target_architecture,
                                           num_layers=cfg.target_num_layers)
        except LayerIdError as e:
            raise ExportError(f"{e}; export with --format {'vllm' if engine == 'sglang' else 'sglang'} for the other "
                              f"engine only") from e
    return out


def config_layer_ids(cfg: DrafterModelConfig, fmt: Format = DEFAULT_FORMAT) -> list[int]:
    """The ids ``eagle_config`` carries in an export of ``fmt`` (SGLang's, except in the ``vllm`` format)."""
    return engine_config_ids(cfg, fmt)[WRITTEN[fmt]["eagle_config"]]


def physical_layer_ids(config_ids: Sequence[int], engine: str, *, architecture: str = "",
                       num_layers: int = 0) -> list[int]:
    """The physical layers ``engine`` captures from ``config_ids`` (``contracts.layers.engine_captured_layers``)."""
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}; use one of {list(ENGINES)}")
    return engine_captured_layers(config_ids, engine=engine, architecture=architecture, num_layers=num_layers)


def recorded_physical_ids(sidecar: Mapping[str, Any] | None) -> tuple[list[int] | None, str]:
    """(physical ids, where they were found) from a sidecar of any eaglenest version; (None, "") if it has none."""
    if sidecar is None:
        return None, ""
    for key in SIDECAR_ID_KEYS:
        if sidecar.get(key) is not None:
            return [int(i) for i in sidecar[key]], f"{SIDECAR}:{key}"
    inner = (sidecar.get("drafter_config") or {}).get("aux_layer_ids")
    if inner is not None:
        return [int(i) for i in inner], f"{SIDECAR}:drafter_config.aux_layer_ids"
    return None, ""


# --------------------------------------------------------------------------------------------------- config.json
def hf_config(cfg: DrafterModelConfig, fmt: Format, dtype: str) -> dict[str, Any]:
    """``config.json`` per the loader contract (reference: SGLang 0.5.x ``llama_eagle3.py`` / ``kimi_k25_eagle3.py``;
    vLLM ``llama_eagle3`` / ``deepseek_eagle3``)."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.draft_shape]],
        "model_type": MODEL_TYPES[cfg.draft_shape],
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
        **id_keys(fmt, engine_config_ids(cfg, fmt)),
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.is_mla:
        out.update(mla_config(cfg))
    if cfg.fc_norm:
        out["fc_norm"] = True
    if cfg.norm_output:
        out["norm_output"] = True
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out


# ------------------------------------------------------------------------------------------------------- tensors
def vocab_mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """What is wrong with a draft -> target vocab map: ``d2t[i] = target_id(i) - i``, ``t2d`` marks those ids."""
    import torch

    dv, v = int(d2t.numel()), int(t2d.numel())
    ids = d2t.to(torch.long) + torch.arange(dv)
    marks = t2d.to(torch.bool)
    if dv and (int(ids.min()) < 0 or int(ids.max()) >= v):
        return [f"d2t + arange maps into [{int(ids.min())}, {int(ids.max())}], outside the target vocab [0, {v})"]
    problems = []
    if len(torch.unique(ids)) != dv:
        problems.append("d2t maps two draft ids to the same target id")
    if int(marks.sum()) != dv:
        problems.append(f"d2t and t2d disagree: t2d marks {int(marks.sum())} target ids, expected {dv} (draft vocab)")
    elif not problems and not bool(marks[ids].all()):
        problems.append("d2t and t2d disagree: some target ids reached by d2t are not marked in t2d")
    return problems


def validate_tensors(tensors: Mapping[str, torch.Tensor], cfg: DrafterModelConfig) -> None:
    """Every required tensor present, no stray names, shapes and dtypes that fit ``cfg``, d2t/t2d consistent."""
    import torch

    shapes = expected_shapes(cfg)
    required = required_tensors(cfg)
    problems = []
    missing = [k for k in required if k not in tensors]
    if missing:
        problems.append(f"missing tensors {missing} for a {cfg.draft_shape}-shaped drafter")
    unknown = sorted(set(tensors) - set(required) - set(OPTIONAL_TENSORS))
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
        problems.extend(vocab_mapping_problems(tensors["d2t"], tensors["t2d"]))
    if problems:
        raise ExportError("refusing to export this drafter: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------------- write
def sidecar_record(cfg: DrafterModelConfig, fmt: Format, dtype: str, *, includes_embedding: bool) -> dict[str, Any]:
    """The sidecar :func:`write_export` writes next to config.json (physical ids, target shape, drafter config)."""
    conventions = {"sglang": f"SGLang's rule for {cfg.target_architecture or 'Llama-style'} targets",
                   "vllm": "physical (vLLM)"}
    return {
        "format": fmt,
        SIDECAR_ID_KEYS[0]: list(cfg.aux_layer_ids),
        "config_aux_layer_ids": config_layer_ids(cfg, fmt),
        "engine_aux_layer_ids": engine_config_ids(cfg, fmt),
        "layer_id_convention": {place: conventions[engine] for place, engine in WRITTEN[fmt].items()},
        "target_architecture": cfg.target_architecture,
        "algorithm": cfg.algorithm,
        "target": cfg.target,
        "target_num_layers": cfg.target_num_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "target_vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "dtype": dtype,
        "includes_embedding": includes_embedding,
        "drafter_config": cfg.to_dict(),
    }


def write_export(
    tensors: Mapping[str, torch.Tensor],
    cfg: DrafterModelConfig,
    output_dir: str | Path,
    *,
    fmt: Format = DEFAULT_FORMAT,
    dtype: str = "bfloat16",
    extra_sidecar: dict[str, Any] | None = None,
) -> Path:
    """Validate and write an export folder (atomically: a half-written export never replaces a good one)."""
    import torch
    from safetensors.torch import save_file

    from eaglenest.drafters.eagle3.serving import serving_readme

    if dtype not in DTYPE_NAMES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}")
    config_layer_ids(cfg, fmt)  # validates fmt and the ids for this target before anything is written
    validate_tensors(tensors, cfg)
    td = getattr(torch, dtype)
    out_tensors = {
        k: (v.to(td) if v.is_floating_point() else v).detach().to("cpu").contiguous() for k, v in tensors.items()
    }
    sidecar = {**sidecar_record(cfg, fmt, dtype, includes_embedding="embed_tokens.weight" in out_tensors),
               **(extra_sidecar or {})}
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(out_tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(hf_config(cfg, fmt, dtype), indent=2) + "\n")
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        (tmp / README).write_text(serving_readme(cfg, fmt, out.resolve(), engine_config_ids(cfg, fmt)))
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


# ---------------------------------------------------------------------------------------------------------- read
def read_export_config(export_dir: str | Path) -> tuple[DrafterModelConfig, dict[str, Any], dict[str, Any]]:
    """(drafter config with physical ids, config.json, sidecar) of an eaglenest export; refuses an export whose two
    records disagree."""
    d = Path(export_dir)
    for f in (CONFIG, SIDECAR, WEIGHTS):
        if not (d / f).is_file():
            raise FileNotFoundError(
                f"{d / f} not found: {d} is not an eaglenest drafter export (run `eaglenest export` or "
                "`eaglenest train`, which writes OUT/export)"
            )
    hf = json.loads((d / CONFIG).read_text())
    side = json.loads((d / SIDECAR).read_text())
    cfg = DrafterModelConfig.from_dict(side["drafter_config"])
    fmt = side.get("format") or "sglang"
    places = WRITTEN.get(fmt, {"eagle_config": fmt})
    for place, engine in places.items():
        written = written_ids(hf)[place]
        if written is None and place == "top":
            continue  # exports written before the top-level key (vLLM's) was added
        if written is None or physical_layer_ids(written, engine, architecture=cfg.target_architecture,
                                                 num_layers=cfg.target_num_layers) != cfg.aux_layer_ids:
            key = IDS_KEY if place == "top" else f"eagle_config.{IDS_KEY}"
            raise ExportError(
                f"{d}: config.json {key} {written} in {engine}'s convention does not give the physical ids "
                f"{cfg.aux_layer_ids} recorded in {SIDECAR}; re-export the checkpoint"
            )
    want = ARCHITECTURES[cfg.draft_shape]
    if hf.get("architectures") != [want] or hf.get("num_hidden_layers") != 1:
        raise ExportError(f"{d}: config.json is not a 1-layer {want} drafter (the sidecar records a "
                          f"{cfg.draft_shape}-shaped drafter)")
    return cfg, hf, side


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an export, as its safetensors header describes it."""

    shape: list[int]
    file: Path
    key: str
    """the name in the file (an optional ``model.`` prefix kept)"""


@dataclass(frozen=True)
class DrafterExport:
    """An export folder as a serving engine sees it: config.json, the sidecar (if any), tensor shapes (no weights).

    Unreadable parts are recorded (``sidecar_error``, ``tensor_error``) rather than raised, so a preflight can
    report each as its own failed check.
    """

    path: str
    config: Mapping[str, Any]
    sidecar: Mapping[str, Any] | None = None
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)
    """keyed by the name without the ``model.`` prefix SGLang also accepts"""
    sidecar_error: str | None = None
    tensor_error: str | None = None

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return str(archs[0]) if len(archs) == 1 else "?"

    @property
    def is_eagle3(self) -> bool:
        return self.draft_shape is not None

    @property
    def draft_shape(self) -> str | None:
        """``llama`` / ``mla`` by config.json's architecture (None: not an EAGLE-3 drafter eaglenest knows)."""
        shape = draft_shape_of(self.architecture)
        if shape is None and self.architecture.endswith("Eagle3"):
            return "llama"  # another engine's name for the Llama-shaped head (e.g. vLLM's Eagle3LlamaForCausalLM)
        return shape

    @property
    def prefixed_tensors(self) -> list[str]:
        """Tensor names written with a ``model.`` prefix (as the file has them)."""
        return sorted(e.key for e in self.tensors.values() if e.key.startswith("model."))

    @property
    def config_layer_ids(self) -> list[int] | None:
        """``eagle_config.eagle_aux_hidden_state_layer_ids`` as written (the engine's convention)."""
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return None if ids is None else [int(i) for i in ids]

    @property
    def format(self) -> str | None:
        """The format recorded in the sidecar (``both``, ``sglang``, ``vllm``; None without a sidecar)."""
        fmt = (self.sidecar or {}).get("format")
        return str(fmt) if fmt else None

    def recorded_physical_ids(self) -> tuple[list[int] | None, str]:
        """(physical ids the drafter was trained on, where recorded) from the sidecar; (None, "") when unknown."""
        return recorded_physical_ids(self.sidecar)

    def trained_layer_ids(self) -> list[int] | None:
        """The physical ids: the sidecar's, else config.json read in the sidecar's format (SGLang's by default)."""
        ids, _ = self.recorded_physical_ids()
        written = self.config_layer_ids
        if ids is None and written is not None:
            side = self.sidecar or {}
            ids = physical_layer_ids(written, eagle_config_convention(self.format),
                                     architecture=str(side.get("target_architecture") or ""),
                                     num_layers=int(side.get("target_num_layers") or 0))
        return ids

    def shape(self, name: str) -> list[int] | None:
        entry = self.tensors.get(name)
        return None if entry is None else entry.shape

    def load_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        entry = self.tensors[name]
        with safe_open(str(entry.file), framework="pt") as fh:
            return fh.get_tensor(entry.key)

    def tensor_rows(self, name: str, rows: Sequence[int]) -> torch.Tensor:
        """A few rows of a 2-D tensor, read by slice."""
        import torch
        from safetensors import safe_open

        entry = self.tensors[name]
        with safe_open(str(entry.file), framework="pt") as fh:
            sl = fh.get_slice(entry.key)
            return torch.stack([sl[r:r + 1][0] for r in rows])


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DrafterFormatError(f"{what} {path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise DrafterFormatError(f"{what} {path} must hold a JSON object")
    return data


def tensor_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every ``*.safetensors`` tensor's shape from the file headers (``safe_open`` slices; no weights read)."""
    from safetensors import safe_open

    out: dict[str, TensorEntry] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key.removeprefix("model.")] = TensorEntry(list(fh.get_slice(key).get_shape()), f, key)
    return out


def read_drafter(path: str | Path) -> DrafterExport:
    """Read an export folder's config.json, sidecar and tensor shapes; raises DrafterFormatError only when
    config.json is missing or malformed (everything else is left for the checks)."""
    p = Path(path)
    if not (p / CONFIG).is_file():
        raise DrafterFormatError(f"drafter {p}: {p / CONFIG} does not exist; export the drafter with "
                                 f"`eaglenest export` (eaglenest.drafter.export) or `eaglenest train`")
    cfg = _read_json(p / CONFIG, f"drafter {p}: config")
    sidecar, sidecar_error = None, None
    if (p / SIDECAR).is_file():
        try:
            sidecar = _read_json(p / SIDECAR, f"drafter {p}: sidecar")
        except DrafterFormatError as e:
            sidecar_error = str(e)
    tensors: dict[str, TensorEntry] = {}
    tensor_error = None
    try:
        tensors = tensor_entries(p)
        if not tensors:
            tensor_error = f"no *.safetensors files in {p}"
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a corrupt header
        tensor_error = f"{type(e).__name__}: {e}"
    return DrafterExport(path=str(p), config=cfg, sidecar=sidecar, tensors=tensors, sidecar_error=sidecar_error,
                         tensor_error=tensor_error)
