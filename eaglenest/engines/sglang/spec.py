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
from eaglenest.drafters.preflight import preflight_or_raise
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
    launch = speculative_launch(read_drafter(drafter_path), target, spec, expected_physical_ids=expected_physical_ids)
    kw = engine_kwargs(model_path, engine_cfg, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
                       target=target)
    kw.update(launch.engine_kwargs())
    return kw, launch
