"""Speculative launch of SGLang from a validated config: the checks SGLang itself does not make.

SGLang decides EAGLE-3 behaviour from the algorithm string alone and accepts ``EAGLE`` with an EAGLE-3 drafter without
a warning (the drafter then gets the final hidden state instead of the 3 aux layers, and accept length sits at 1.0).
Here the algorithm is derived from the drafter checkpoint, steps/topk/draft tokens are always all given, and the
drafter's layer ids are checked against the target with SGLang 0.5.14's own numbering rule. No sglang import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.config import SGLangEngineConfig, SpecConfig
from eaglenest.contracts.layers import LayerIdError, sglang_captured_layers, validate_aux_layer_ids
from eaglenest.engines.sglang_args import engine_kwargs

SIDECAR = "eaglenest_drafter.json"
"""Written next to config.json by eaglenest's exporter; records the physical aux layer ids the drafter trained on."""

_SIDECAR_ID_KEYS = ("aux_layer_ids_physical", "aux_layer_ids")
"""Where eaglenest.drafter.export records the physical ids (``drafter_config.aux_layer_ids`` is checked too)."""

FIRST_ID_RULE_ARCHS = frozenset({
    # sglang 0.5.14 models whose set_eagle3_layers_to_capture adds 1 only when the first id is 1 (PR #25454):
    # models/deepseek_v2.py (and subclasses in glm4_moe.py, mistral_large_3.py), glm4_moe_lite.py, kimi_k25.py.
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "Glm4MoeLiteForCausalLM",
})
"""Every other architecture with EAGLE-3 support (llama.py, qwen*.py, ...) always adds 1."""

REQUIRED_DRAFT_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.self_attn.q_proj.weight",
                          "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                          "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                          "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
                          "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                          "midlayer.post_attention_layernorm.weight")
"""Names SGLang's LlamaForCausalLMEagle3.load_weights maps (``model.`` prefix optional); unknown names it drops."""


class SpeculativeConfigError(ValueError):
    """A drafter / algorithm / target combination that must not be launched; the message names the fix."""


@dataclass(frozen=True)
class TargetFacts:
    """What the launch checks need to know about the target."""

    num_layers: int
    hidden_size: int
    architecture: str
    context_length: int

    @property
    def first_id_rule(self) -> bool:
        return self.architecture in FIRST_ID_RULE_ARCHS

    @classmethod
    def from_model_dir(cls, path: str | Path, *, context_length: int | None = None) -> TargetFacts:
        """Read a local HF folder's config.json (multimodal configs: the ``text_config`` part)."""
        cfg = _read_json(Path(path) / "config.json", "target")
        text = cfg.get("text_config") or cfg
        arch = (cfg.get("architectures") or ["?"])[0]
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            architecture=arch,
            context_length=int(context_length or text.get("max_position_embeddings") or 0),
        )


@dataclass(frozen=True)
class DrafterCheckpoint:
    """An exported drafter folder as SGLang will see it."""

    path: str
    architecture: str
    config: Mapping[str, Any]
    config_layer_ids: list[int] | None
    physical_layer_ids: list[int] | None
    weight_shapes: Mapping[str, list[int]] = field(default_factory=dict)

    @property
    def is_eagle3(self) -> bool:
        return self.architecture.endswith("Eagle3")


def read_drafter(path: str | Path) -> DrafterCheckpoint:
    """Read config.json, the eaglenest sidecar (if any) and the safetensors headers (no weights are loaded)."""
    p = Path(path)
    if not p.is_dir():
        raise SpeculativeConfigError(
            f"drafter folder {p} does not exist; export one with `eaglenest train` / eaglenest.drafter.export"
        )
    cfg = _read_json(p / "config.json", "drafter")
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise SpeculativeConfigError(f"drafter {p}/config.json must name exactly one architecture, got {archs}")
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    physical = None
    side = p / SIDECAR
    if side.is_file():
        meta = _read_json(side, "drafter sidecar")
        for key in _SIDECAR_ID_KEYS:
            if meta.get(key) is not None:
                physical = [int(i) for i in meta[key]]
                break
        if physical is None and isinstance(meta.get("drafter_config"), dict):
            ids_in_cfg = meta["drafter_config"].get("aux_layer_ids")
            physical = None if ids_in_cfg is None else [int(i) for i in ids_in_cfg]
        if physical is None:
            raise SpeculativeConfigError(
                f"{side} records no physical aux layer ids (expected one of {_SIDECAR_ID_KEYS})"
            )
    return DrafterCheckpoint(
        path=str(p.resolve()), architecture=str(archs[0]), config=cfg,
        config_layer_ids=None if ids is None else [int(i) for i in ids], physical_layer_ids=physical,
        weight_shapes=_safetensors_shapes(p),
    )


def derive_algorithm(drafter: DrafterCheckpoint, requested: str | None = None) -> str:
    """The algorithm string comes from the checkpoint: an ``*Eagle3`` drafter is served with EAGLE3, always."""
    if requested is not None and requested not in ("EAGLE3", "EAGLE"):
        raise SpeculativeConfigError(f"speculative algorithm {requested!r} is not supported here; use EAGLE3")
    if drafter.is_eagle3:
        if requested == "EAGLE":
            raise SpeculativeConfigError(
                f"drafter {drafter.path} is an EAGLE-3 checkpoint ({drafter.architecture}) but the algorithm is EAGLE. "
                f"SGLang would accept this silently: the drafter would get the final hidden state instead of the 3 aux "
                f"layers, skip its fc, lose its lm_head, and accept length would sit at 1.0. Set serve.spec.algorithm: "
                f"EAGLE3 (or leave it unset: it is derived from the drafter)"
            )
        return "EAGLE3"
    raise SpeculativeConfigError(
        f"drafter {drafter.path} has architecture {drafter.architecture}; eaglenest serves EAGLE-3 drafters only "
        f"(architectures: [LlamaForCausalLMEagle3]); re-export it with eaglenest.drafter.export"
    )


def sglang_config_ids_for(physical_ids: Sequence[int], num_layers: int, *, first_id_rule: bool) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang 0.5.14 capture exactly ``physical_ids``."""
    phys = [int(i) for i in physical_ids]
    for cand in ([i - 1 for i in phys], phys):
        if sglang_captured_layers(cand, num_layers, deepseek_family=first_id_rule) == phys:
            return cand
    raise LayerIdError(
        f"no eagle_aux_hidden_state_layer_ids make SGLang capture physical layers {phys} for this target"
    )


@dataclass(frozen=True)
class SpeculativeLaunch:
    """A checked speculative launch: everything ``sglang.Engine`` needs beyond the generation kwargs."""

    algorithm: str
    draft_model_path: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    captured_layers: tuple[int, ...]

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "speculative_algorithm": self.algorithm,
            "speculative_draft_model_path": self.draft_model_path,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": self.topk,
            "speculative_num_draft_tokens": self.num_draft_tokens,
        }


def preflight(drafter: DrafterCheckpoint, target: TargetFacts, spec: SpecConfig,
              *, expected_physical_ids: Sequence[int] | None = None) -> SpeculativeLaunch:
    """Every check SGLang skips or makes too late; returns the launch or raises SpeculativeConfigError."""
    algorithm = derive_algorithm(drafter, spec.algorithm)
    cfg = drafter.config
    problems: list[str] = []
    if int(cfg.get("num_hidden_layers", -1)) != 1:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')}; SGLang's EAGLE-3 drafter needs 1")
    if "num_nextn_predict_layers" in cfg:
        problems.append("config carries num_nextn_predict_layers (a DeepSeek MTP key): remove it")
    target_hidden = int(cfg.get("target_hidden_size") or cfg.get("hidden_size") or 0)
    if target_hidden != target.hidden_size:
        problems.append(f"drafter expects target hidden size {target_hidden}, the target has {target.hidden_size}")
    fc = drafter.weight_shapes.get("fc.weight")
    if fc is not None and fc[-1] != 3 * target.hidden_size:
        problems.append(f"fc.weight takes {fc[-1]} inputs; EAGLE-3 fuses 3 x {target.hidden_size} = "
                        f"{3 * target.hidden_size} (3 aux layers of the target)")
    if drafter.weight_shapes:
        names = {k.removeprefix("model.") for k in drafter.weight_shapes}
        missing = [k for k in REQUIRED_DRAFT_WEIGHTS if k not in names]
        if missing:
            problems.append(f"weights missing (SGLang would leave them random, silently): {missing}")
        d2t = drafter.weight_shapes.get("d2t")
        dv = cfg.get("draft_vocab_size")
        if d2t is not None and dv is not None and d2t[0] != int(dv):
            problems.append(f"d2t has {d2t[0]} entries but draft_vocab_size is {dv}")
    draft_ctx = int(cfg.get("max_position_embeddings") or 0)
    if target.context_length and draft_ctx < target.context_length:
        problems.append(f"max_position_embeddings {draft_ctx} < the target context length {target.context_length}; "
                        f"SGLang refuses to start (re-export with a larger value, or lower "
                        f"target.sglang.context_length)")
    if not cfg.get("eagle_config", {}).get("use_aux_hidden_state", True):
        problems.append("eagle_config.use_aux_hidden_state is false; an EAGLE-3 drafter needs the aux layers")

    recorded = drafter.physical_layer_ids if drafter.physical_layer_ids is not None else expected_physical_ids
    captured: list[int] = []
    try:
        captured = sglang_captured_layers(drafter.config_layer_ids, target.num_layers,
                                          deepseek_family=target.first_id_rule)
        validate_aux_layer_ids(captured, target.num_layers)
    except LayerIdError as e:
        problems.append(f"eagle_aux_hidden_state_layer_ids {drafter.config_layer_ids}: SGLang would capture "
                        f"{captured or '?'}: {e}")
    if recorded is None:
        problems.append(f"the physical layer ids the drafter was trained on are unknown (no {SIDECAR}); re-export "
                        f"with eaglenest.drafter.export or pass the ids (target.aux_layer_ids)")
    elif captured and list(recorded) != captured:
        want = sglang_config_ids_for(recorded, target.num_layers, first_id_rule=target.first_id_rule)
        problems.append(f"SGLang 0.5.14 would capture physical layers {captured} for a {target.architecture} target "
                        f"from eagle_aux_hidden_state_layer_ids {drafter.config_layer_ids}, but the drafter was "
                        f"trained on {list(recorded)}; write eagle_aux_hidden_state_layer_ids: {want}")
    if problems:
        raise SpeculativeConfigError(f"drafter {drafter.path} cannot be served with this target:\n  - "
                                     + "\n  - ".join(problems))
    return SpeculativeLaunch(algorithm=algorithm, draft_model_path=drafter.path, num_steps=spec.num_steps,
                             topk=spec.topk, num_draft_tokens=spec.num_draft_tokens, captured_layers=tuple(captured))


def speculative_engine_kwargs(
    model_path: str,
    engine_cfg: SGLangEngineConfig,
    drafter_path: str | Path,
    spec: SpecConfig,
    *,
    target: TargetFacts | None = None,
    expected_physical_ids: Sequence[int] | None = None,
    dtype: str = "auto",
    seed: int | None = 0,
    trust_remote_code: bool = False,
) -> tuple[dict[str, Any], SpeculativeLaunch]:
    """``sglang.Engine`` kwargs for speculative serving, built only after ``preflight`` passed."""
    target = target or TargetFacts.from_model_dir(model_path, context_length=engine_cfg.context_length)
    launch = preflight(read_drafter(drafter_path), target, spec, expected_physical_ids=expected_physical_ids)
    kw = engine_kwargs(model_path, engine_cfg, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code)
    kw.update(launch.engine_kwargs())
    return kw, launch


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise SpeculativeConfigError(f"{what} config {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpeculativeConfigError(f"{what} config {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise SpeculativeConfigError(f"{what} config {path} must be a JSON object")
    return data


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (8-byte length + JSON), without reading any weights."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = list(meta["shape"])
    return shapes
