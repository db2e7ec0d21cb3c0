"""SGLang's adaptive speculation, configured from measurements: the ``speculative_adaptive_config`` JSON and kwargs.

SGLang 0.5.14 (``srt/speculative/adaptive_spec_params.py``) reads a JSON object whose integer-string keys are batch
sizes, each holding ``candidate_steps`` (0 = drafting off) and optional hysteresis/EMA knobs; a live batch is routed
to the largest key not above it (after padding to a CUDA-graph batch size), and that slot's EMA of the accept length
moves between its candidates. Keys that are not digits are ignored by SGLang (we keep eaglenest's provenance there).
With ``speculative_adaptive`` on, ``speculative_num_steps`` must be one of the candidates, topk is 1 and the draft
tokens are steps + 1 (``arg_groups/speculative_hook.py``).

SGLang silently falls back to static parameters (a log warning only) when the launch has attention data
parallelism, multi-layer EAGLE, two-batch overlap or PD multiplexing, or topk != 1 (``adaptive_unsupported_reason``);
:func:`adaptive_refusal` finds those before the engine starts so serve can say so and choose what to run instead.

At steps 0 SGLang still runs the drafter's KV catch-up (``draft_extend``) every step unless
``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` is set, read by its scheduler process: :attr:`AdaptiveSpec.env`.
No sglang import here (the contract tests parse what this module builds with SGLang's own code).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIP_ZERO_STEP_ENV = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"

REFUSING_FLAGS: dict[str, str] = {
    "enable_dp_attention": "attention data parallelism (SGLang's adaptive decisions are not synchronised across DP "
                           "ranks)",
    "enable_multi_layer_eagle": "multi-layer EAGLE (its worker does not implement adaptive steps)",
    "enable_two_batch_overlap": "two-batch overlap (the adaptive state swap would drop its attention wrapper)",
    "enable_pdmux": "PD multiplexing (the adaptive state swap does not update its attention backends)",
}
"""launch arguments under which SGLang 0.5.14 turns adaptive speculation off, and why"""


@dataclass(frozen=True)
class AdaptiveSpec:
    """Per bucket (its smallest batch size) the candidate steps, best first; what serve and tune launch."""

    buckets: tuple[tuple[int, tuple[int, ...]], ...]
    skip_zero_step_draft_extend: bool = True
    provenance: str = ""
    """where the numbers come from (a schedule path), written into the JSON for whoever reads it later"""

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("an adaptive configuration needs at least one bucket")
        lows = [lo for lo, _ in self.buckets]
        if lows != sorted(set(lows)) or lows[0] < 1:
            raise ValueError(f"bucket batch sizes must be ascending, distinct and >= 1, got {lows}")
        for lo, steps in self.buckets:
            if not steps or any(s < 0 for s in steps):
                raise ValueError(f"bucket {lo}: candidate steps must be non-negative, got {list(steps)}")

    @property
    def initial_steps(self) -> int:
        """What the engine starts with: the first bucket's best candidate (SGLang requires one of the candidates)."""
        return self.buckets[0][1][0]

    @property
    def all_steps(self) -> list[int]:
        return sorted({s for _, steps in self.buckets for s in steps})

    @property
    def env(self) -> dict[str, str]:
        """Environment the engine's scheduler must start with."""
        return {SKIP_ZERO_STEP_ENV: "1"} if self.skip_zero_step_draft_extend and 0 in self.all_steps else {}

    def steps_for(self, batch_size: int) -> tuple[int, ...]:
        """Candidates SGLang routes ``batch_size`` to (largest key not above it; below the first: the first)."""
        chosen = self.buckets[0][1]
        for lo, steps in self.buckets:
            if lo <= batch_size:
                chosen = steps
        return chosen

    def config(self) -> dict[str, Any]:
        """The JSON object SGLang's ``_load_adaptive_config`` reads."""
        out: dict[str, Any] = {"eaglenest": {"provenance": self.provenance,
                                             "note": "written by eaglenest from a tuned schedule"}}
        for lo, steps in self.buckets:
            out[str(lo)] = {"candidate_steps": list(steps)}
        return out

    def write(self, folder: str | Path | None = None) -> Path:
        """The config as a file named by its content (the same schedule always gives the same path)."""
        text = json.dumps(self.config(), indent=2, sort_keys=True) + "\n"
        name = f"eaglenest-adaptive-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        path = Path(folder or tempfile.gettempdir()) / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
        return path


def adaptive_refusal(engine_kwargs: Mapping[str, Any], *, topk: int = 1) -> str | None:
    """Why SGLang would turn adaptive speculation off for this launch (None: it runs)."""
    if topk != 1:
        return f"speculative topk {topk} (SGLang's adaptive mode takes chains only, topk 1)"
    for flag, why in REFUSING_FLAGS.items():
        if engine_kwargs.get(flag):
            return f"{flag}: {why}"
    return None


def adaptive_kwargs(spec: AdaptiveSpec, config_path: str | Path) -> dict[str, Any]:
    """Speculative kwargs for an adaptive launch (replacing the static steps/topk/draft tokens)."""
    steps = spec.initial_steps
    return {"speculative_adaptive": True, "speculative_adaptive_config": str(config_path),
            "speculative_num_steps": steps, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": steps + 1}


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the block (the engine's scheduler processes inherit it), restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
