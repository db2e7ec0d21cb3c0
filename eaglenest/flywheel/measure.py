"""Accept length of a drafter on a prompt set, through the target engine at the serving config.

The serving config is ``target:`` (engine, device, dtype) and ``serve.spec`` (steps, topk, draft tokens): the gate and
the checkpoint choice decode what the server would, greedily, ``flywheel.max_new_tokens`` per prompt. On the hf
engine this is ``eaglenest.speculative.evaluate`` (the reference decoder: serve's own decoder). On SGLang every
drafter gets its own speculative engine (SGLang loads its drafter at start), measured as ``eaglenest bench`` measures
(``spec_verify_ct`` and ``completion_tokens`` per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.metrics import accept_length
from eaglenest.engines.base import SamplingParams


class Measurer:
    """Measures drafters for one serving config; the hf target is loaded once and shared."""

    def __init__(self, cfg: EaglenestConfig, max_new_tokens: int) -> None:
        self.cfg = cfg
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
        self._engine: Any = None

    @property
    def engine(self) -> Any:
        """The hf target engine (loaded on first use)."""
        if self._engine is None:
            from eaglenest.engines import load_engine

            self._engine = load_engine(self.cfg.target)
        return self._engine

    def measure(self, drafter: str | Path, prompts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``{"accept_length", "requests", "verify_steps", "per_domain": {domain: accept length}}``."""
        return self.measure_sets(drafter, {"all": prompts})["all"]

    def measure_sets(self, drafter: str | Path, sets: dict[str, Sequence[dict[str, Any]]]) -> dict[str, Any]:
        """:meth:`measure` for every prompt set, one engine for the drafter (an SGLang start is the cost)."""
        if not sets or not all(sets.values()):
            raise ValueError("no prompts to measure accept length on")
        if self.cfg.target.engine == "sglang":
            return self._sglang(str(drafter), sets)
        from eaglenest.drafters.eagle3.model import load_drafter
        from eaglenest.speculative.evaluate import evaluate_acceptance

        eng = self.engine  # the drafter as serve loads it: the target's device and dtype, its embedding
        model = load_drafter(drafter, device=eng.device, dtype=eng.dtype, target_embedding=eng.embed_weight())
        out = {}
        for name, prompts in sets.items():
            report = evaluate_acceptance(eng, model, list(prompts), self.cfg.serve.spec, sampling=self.sampling)
            out[name] = {"accept_length": report["accept_length"], "requests": report["requests"],
                         "verify_steps": report["verify_steps"],
                         "per_domain": {d: v["accept_length"] for d, v in report["per_domain"].items()}}
        return out

    def _sglang(self, drafter: str, sets: dict[str, Sequence[dict[str, Any]]]) -> dict[str, Any]:
        from eaglenest.engines.sglang.engine import SGLangEngine
        from eaglenest.speculative.evaluate import prompt_ids

        engine = SGLangEngine.speculative(self.cfg.target, drafter, self.cfg.serve.spec,
                                          concurrency=self.cfg.serve.max_concurrent_requests)
        out = {}
        try:
            for name, prompts in sets.items():
                gens = engine.generate_ids([prompt_ids(engine.tokenizer, p) for p in prompts], self.sampling)
                out[name] = _pooled(prompts, gens)
        finally:
            engine.close()
        return out

    def close(self) -> None:
        self._engine = None


def _pooled(prompts: Sequence[dict[str, Any]], gens: Sequence[Any]) -> dict[str, Any]:
    """Accept length pooled over SGLang's per-request counts, overall and per domain (as ``eaglenest bench``)."""
    per: dict[str, list[int]] = {}
    total = [0, 0]
    for p, g in zip(prompts, gens, strict=True):
        verify = int(g.meta.get("spec_verify_ct") or 0)
        accepted = max(0, int(g.meta.get("completion_tokens", len(g.token_ids))) - verify) if verify else 0
        d = per.setdefault(str(p.get("domain", "all")), [0, 0])
        for acc in (d, total):
            acc[0] += verify
            acc[1] += accepted
    return {"accept_length": accept_length(*total), "requests": len(prompts), "verify_steps": total[0],
            "per_domain": {k: accept_length(*v) for k, v in per.items()}}


__all__ = ["Measurer"]
