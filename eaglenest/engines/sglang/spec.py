"""Speculative launch of SGLang from a validated config: the ``sglang.Engine`` kwargs, built only after preflight.

SGLang decides EAGLE-3 behaviour from the algorithm string alone and accepts ``EAGLE`` with an EAGLE-3 drafter without
a warning (the drafter then gets the final hidden state instead of the 3 aux layers, and accept length sits at 1.0).
Here the algorithm is derived from the drafter checkpoint, steps/topk/draft tokens are always all given, and the
drafter x target x algorithm checks are ``eaglenest.drafters.preflight``'s, run with SGLang 0.5.14's layer
numbering (``engine="sglang"``). No sglang import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.config import SGLangEngineConfig, SpecConfig
from eaglenest.contracts.layers import engine_captured_layers
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.format import DrafterExport, read_drafter
from eaglenest.drafters.preflight import SpeculativeConfigError, preflight_or_raise
from eaglenest.engines.sglang.args import engine_kwargs


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


def speculative_launch(drafter: DrafterExport, target: TargetSpec, spec: SpecConfig,
                       *, expected_physical_ids: Sequence[int] | None = None) -> SpeculativeLaunch:
    """The launch for ``drafter`` on ``target``, after every preflight check passed (else PreflightError)."""
    report = preflight_or_raise(target, drafter, algorithm=spec.algorithm, engine="sglang",
                                expected_physical_ids=expected_physical_ids)
    captured = engine_captured_layers(drafter.config_layer_ids, engine="sglang", architecture=target.architecture,
                                      num_layers=target.num_layers)
    return SpeculativeLaunch(algorithm=str(report.algorithm), draft_model_path=str(Path(drafter.path).resolve()),
                             num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
                             captured_layers=tuple(captured))


FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)
"""The head sizes flashinfer's (non-MLA) attention kernels are built for (its ``DISPATCH_HEAD_DIM``). An EAGLE draft
on flashinfer merges partial attention states while SGLang captures the draft's CUDA graphs, and raises on any other
size: the Llama-shaped head at Kimi-K2.5's widths (64 heads of 7168 / 64 = 112) killed the sixth Kimi-width run's bench
engine at start."""


def draft_head_dim(drafter: DrafterExport) -> int | None:
    """The attention head size of a Llama-shaped drafter's layer (None for MLA drafters, whose heads are not one
    size, or a config without the numbers)."""
    if drafter.draft_shape != "llama":
        return None
    cfg = drafter.config
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return int(hidden) // int(heads) if heads and hidden else None


def draft_attention_backend(kw: dict[str, Any], drafter: DrafterExport) -> str | None:
    """The backend the drafter's own attention must run on when the target's cannot run it (None: the target's).

    A Llama-shaped drafter whose head size flashinfer lacks drafts on triton beside a flashinfer target (whose MLA
    verify pass is the reason to run flashinfer at all); an explicit ``speculative_draft_attention_backend:
    flashinfer`` for such a drafter is refused with the fix rather than left to fail inside the engine's start."""
    head_dim = draft_head_dim(drafter)
    asked = kw.get("speculative_draft_attention_backend")
    backend = asked or kw.get("decode_attention_backend") or kw.get("attention_backend")
    if backend != "flashinfer" or head_dim is None or head_dim in FLASHINFER_HEAD_DIMS:
        return None
    if asked:
        raise SpeculativeConfigError(
            f"speculative_draft_attention_backend: flashinfer cannot run this drafter's attention (head_dim "
            f"{head_dim}; flashinfer's kernels take {', '.join(map(str, FLASHINFER_HEAD_DIMS))}): set "
            "target.sglang.extra_args.speculative_draft_attention_backend to triton, or leave it unset")
    return "triton"


def speculative_engine_kwargs(
    model_path: str,
    engine_cfg: SGLangEngineConfig,
    drafter_path: str | Path,
    spec: SpecConfig,
    *,
    target: TargetSpec | None = None,
    expected_physical_ids: Sequence[int] | None = None,
    dtype: str = "auto",
    seed: int | None = 0,
    trust_remote_code: bool = False,
) -> tuple[dict[str, Any], SpeculativeLaunch]:
    """``sglang.Engine`` kwargs for speculative serving, built only after the preflight passed."""
    target = target or TargetSpec.read(model_path, context_length=engine_cfg.context_length)
    drafter = read_drafter(drafter_path)
    launch = speculative_launch(drafter, target, spec, expected_physical_ids=expected_physical_ids)
    kw = engine_kwargs(model_path, engine_cfg, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
                       target=target)
    kw.update(launch.engine_kwargs())
    draft_backend = draft_attention_backend(kw, drafter)
    if draft_backend is not None:
        kw["speculative_draft_attention_backend"] = draft_backend
    return kw, launch
