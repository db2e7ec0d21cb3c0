"""Preflight checks that depend on the draft shape (``llama`` / ``mla``; ``eaglenest.drafters.eagle3.layout``).

Called by ``eaglenest.drafters.preflight.run_preflight``: the tensors the shape's SGLang loader needs (it drops an
unknown name silently, so a missing one stays random), the MLA config keys ``Eagle3DeepseekV2ForCausalLM`` reads, and
whether the drafter's attention fits the target's (``eaglenest.targets``: an MLA drafter needs an MLA target).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eaglenest.drafters.eagle3.config import MLA_WIDTHS
from eaglenest.drafters.eagle3.format import ARCHITECTURES, DrafterExport, required_draft_weights

if TYPE_CHECKING:
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafters.preflight import PreflightReport

MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
"""``model_type`` values whose transformers/SGLang config class carries the MLA keys (``kimi_k2``: SGLang 0.5.14's
alias of DeepseekV3Config; plain transformers and vLLM know ``deepseek_v3``)."""
REEXPORT = "re-export the drafter with eaglenest export (train.drafter.draft_shape selects the shape)"


def _fc_norm(cfg: Any) -> bool:
    return bool(cfg.get("fc_norm") or cfg.get("use_aux_norm"))


def check_shape_structure(d: DrafterExport) -> list[str]:
    """config.json problems of the drafter's shape (added to the ``drafter_structure`` check)."""
    cfg, shape = d.config, d.draft_shape
    problems = []
    recorded = ((d.sidecar or {}).get("drafter_config") or {}).get("draft_shape")
    if shape is not None and recorded is not None and recorded != shape:
        problems.append(f"config.json is a {d.architecture} ({shape}-shaped) drafter but {d.path}'s sidecar records "
                        f"draft_shape {recorded!r}")
    if shape != "mla":
        return problems
    bad = [k for k in MLA_WIDTHS if not (isinstance(cfg.get(k), int) and cfg[k] > 0)]
    if bad:
        problems.append(f"an MLA drafter's config.json needs positive {bad} (SGLang's {ARCHITECTURES['mla']} raises "
                        f"without q_lora_rank, and sizes its MLA cache from the ranks)")
    if cfg.get("model_type") not in MLA_MODEL_TYPES:
        problems.append(f"model_type {cfg.get('model_type')!r} is not one whose config class carries the MLA keys "
                        f"({list(MLA_MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.get('hidden_act')!r}: the MLA drafter's dense MLP is SiLU-gated")
    return problems


def mla_tensor_shapes(cfg: Any) -> dict[str, list[int]]:
    """The MLA attention tensors' shapes as config.json's widths define them (what SGLang allocates and loads)."""
    h, heads = int(cfg.get("hidden_size") or 0), int(cfg.get("num_attention_heads") or 0)
    qa, kva = int(cfg.get("q_lora_rank") or 0), int(cfg.get("kv_lora_rank") or 0)
    nope, rope = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("qk_rope_head_dim") or 0)
    v = int(cfg.get("v_head_dim") or 0)
    a = "midlayer.self_attn."
    return {f"{a}q_a_proj.weight": [qa, 2 * h], f"{a}q_a_layernorm.weight": [qa],
            f"{a}q_b_proj.weight": [heads * (nope + rope), qa], f"{a}kv_a_proj_with_mqa.weight": [kva + rope, 2 * h],
            f"{a}kv_a_layernorm.weight": [kva], f"{a}kv_b_proj.weight": [heads * (nope + v), kva],
            f"{a}o_proj.weight": [h, heads * v]}


def check_tensors(report: PreflightReport, d: DrafterExport) -> None:
    """``required_tensors``: every tensor the shape's loader maps is present under a name it maps."""
    shape = d.draft_shape or "llama"
    required = (*required_draft_weights(shape, _fc_norm(d.config)), "t2d")
    missing = [k for k in required if k not in d.tensors]
    problems = [f"weights missing {missing} (SGLang would leave them random, silently)"] if missing else []
    if shape == "mla":
        prefixed = d.prefixed_tensors
        if prefixed:
            problems.append(f"tensors {prefixed[:4]}{' ...' if len(prefixed) > 4 else ''} carry a 'model.' prefix: "
                            f"SGLang's {ARCHITECTURES['mla']} loader adds its own and drops them")
        wrong = [f"{k} is {d.shape(k)}, config.json needs {want}" for k, want in mla_tensor_shapes(d.config).items()
                 if k in d.tensors and d.shape(k) != want]
        problems.extend(wrong)
    names = ("fc.weight, midlayer.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,"
             "kv_b_proj,o_proj}.weight" if shape == "mla" else "fc.weight, midlayer.self_attn.{q,k,v,o}_proj.weight")
    report.add("required_tensors", not problems,
               "; ".join(problems) or f"all {len(required)} tensors of a {shape}-shaped drafter present",
               f"{REEXPORT}; tensor names must be {names}, midlayer.mlp.*, midlayer.*norm.weight, norm.weight, "
               f"lm_head.weight, d2t, t2d")


def check_draft_shape(report: PreflightReport, d: DrafterExport, t: TargetSpec) -> None:
    """``draft_shape``: an MLA drafter is served only with an MLA target (DeepSeek-V3 / Kimi-K2.5); a Llama-shaped
    drafter serves any target (SGLang gives it its own non-MLA draft KV cache, e.g. lightseekorg/kimi-k2.5-eagle3)."""
    shape, attention = d.draft_shape, t.arch.attention
    if shape is None:
        return  # reported by the algorithm check
    if shape == "mla" and attention != "mla":
        report.add("draft_shape", False,
                   f"the drafter is an MLA drafter ({d.architecture}) but the target {t.architecture} has {attention} "
                   f"attention: the MLA shape exists to share the layout of an MLA target's KV cache (SGLang serves "
                   f"{d.architecture} for DeepSeek-V3-class targets), so this pairing is a wrong drafter or target",
                   "train a Llama-shaped drafter for this target (train.drafter.draft_shape: llama, the default), or "
                   "serve this drafter with the MLA target it was trained on (DeepSeek-V3 / Kimi-K2.5)")
        return
    report.add("draft_shape", True, f"{shape}-shaped drafter ({d.architecture}) on a target with {attention} attention")
