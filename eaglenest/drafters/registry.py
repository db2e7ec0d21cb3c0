"""The drafter algorithms eaglenest builds, keyed by the ``algorithm`` field of the drafter config and the export's
sidecar. Training, export, preflight, the reference decoder and serve look an algorithm up here; its package
(``eaglenest.drafters.<name>``) holds the model, the training objective and the export format.

The engines' own algorithm strings live here too, with what each does to a drafter of each algorithm: SGLang accepts
``EAGLE`` for an EAGLE-3 checkpoint without a word and then feeds it the final hidden state instead of the fused aux
states (accept length 1.0), the failure eaglenest exists to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterAlgorithm:
    """One drafter algorithm as engines and exports name it."""

    name: str
    """the ``algorithm`` field (drafter config, sidecar)"""
    title: str
    """how people write it (messages)"""
    sglang_algorithm: str
    """``--speculative-algorithm`` / ``speculative_algorithm`` in SGLang"""
    vllm_method: str
    """``speculative_config["method"]`` in vLLM"""
    export_architectures: tuple[str, ...]
    """``architectures`` of the exported config.json, one per draft shape"""
    package: str
    """where its model, objective and export format live"""
    wrong_engine_algorithms: tuple[tuple[str, str], ...] = ()
    """(engine algorithm string, what it silently does to this drafter) for strings engines accept but must not get"""


EAGLE3 = DrafterAlgorithm(
    name="eagle3",
    title="EAGLE-3",
    sglang_algorithm="EAGLE3",
    vllm_method="eagle3",
    export_architectures=("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"),
    package="eaglenest.drafters.eagle3",
    wrong_engine_algorithms=(
        ("EAGLE", "the engine would feed it the final hidden state instead of the 3 aux layers, skip its fc, replace "
                  "its lm_head with the target's, and accept length would sit at 1.0 with no error"),
    ),
)

ALGORITHMS: dict[str, DrafterAlgorithm] = {a.name: a for a in (EAGLE3,)}


class UnknownAlgorithmError(ValueError):
    """A drafter algorithm or engine algorithm string eaglenest does not build or serve."""


def get_algorithm(name: str) -> DrafterAlgorithm:
    """The algorithm called ``name`` (the config/sidecar field)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        known = sorted(ALGORITHMS)
        raise UnknownAlgorithmError(f"unknown drafter algorithm {name!r}; eaglenest builds {known}") from None


def algorithm_for_architecture(architecture: str) -> DrafterAlgorithm | None:
    """The algorithm whose exports carry ``architectures: [architecture]``; None for a foreign checkpoint."""
    return next((a for a in ALGORITHMS.values() if architecture in a.export_architectures), None)


def engine_algorithm_names() -> list[str]:
    """Every engine algorithm string a user may write (``serve.spec.algorithm``, ``--algorithm``): the right ones
    and the accepted-but-wrong ones, which preflight refuses with the reason."""
    names = [a.sglang_algorithm for a in ALGORITHMS.values()]
    names += [w for a in ALGORITHMS.values() for w, _ in a.wrong_engine_algorithms if w not in names]
    return names
