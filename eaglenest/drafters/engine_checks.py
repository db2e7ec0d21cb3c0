"""Preflight checks whose answer depends on the serving engine: which target layers it will really capture for the
drafter, and what its loader accepts.

Called by ``eaglenest.drafters.preflight.run_preflight``. An export's ``config.json`` carries aux ids under the keys
each engine reads (``eaglenest.drafters.eagle3.engine_ids``); the ids are translated through the one layer-id rule
(``eaglenest.contracts.layers``) and compared with the physical layers the drafter was trained on (its sidecar).
Handing an engine a folder written for the other one (``--format sglang`` to vLLM: acceptance 3.6 -> 1.4 on the tiny
target, no error) is refused here with the command that writes a folder both engines read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eaglenest.contracts.layers import (
    LayerIdError,
    default_aux_layer_ids,
    engine_captured_layers,
    engine_layer_ids,
    validate_aux_layer_ids,
)
from eaglenest.drafters.eagle3.engine_ids import FORMAT_ENGINES, IDS_KEY, vllm_reads
from eaglenest.drafters.eagle3.format import SIDECAR, DrafterExport
from eaglenest.drafters.eagle3.serving import VLLM_VERSION, vllm_speculative_config

if TYPE_CHECKING:
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.drafters.preflight import PreflightReport

ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}


def _default(n: int) -> list[int] | str:
    return default_aux_layer_ids(n) if n >= 4 else "none (fewer than 4 layers)"


def check_layers(report: PreflightReport, d: DrafterExport, t: TargetSpec, engine: str,
                 expected_physical_ids: Sequence[int] | None) -> None:
    """``aux_layer_ids``: the layers ``engine`` captures for this drafter on this target are the ones it trained on."""
    physical, where = d.recorded_physical_ids()
    if physical is None and expected_physical_ids is not None:
        physical, where = [int(i) for i in expected_physical_ids], "target.aux_layer_ids"
    if engine == "hf":
        _check_hf(report, d, t, physical, where)
    elif engine == "vllm":
        _check_vllm(report, d, t, physical, where)
    else:
        _check_sglang(report, d, t, physical, where)


def _check_hf(report: PreflightReport, d: DrafterExport, t: TargetSpec, physical: list[int] | None,
              where: str) -> None:
    """The reference decoder taps transformers' hidden_states with the physical ids the drafter was trained on."""
    n, config_ids = t.num_layers, d.config_layer_ids
    if physical is None and config_ids is not None:
        physical = engine_captured_layers(config_ids, engine="sglang", architecture=t.architecture, num_layers=n)
        where = "config.json eagle_config read as SGLang ids"
    if physical is None:
        report.add("aux_layer_ids", False, f"the drafter records no aux layer ids (no {SIDECAR}, no eagle_config)",
                   "re-export the drafter with eaglenest.drafter.export (it writes both)")
        return
    try:
        validate_aux_layer_ids(physical, n)
        report.add("aux_layer_ids", True, f"physical ids {physical} ({where}) fit the {n}-layer target")
    except LayerIdError as e:
        report.add("aux_layer_ids", False, f"physical ids {physical} ({where}): {e}",
                   f"train the drafter on this target's layers (default {_default(n)}) or serve it with the "
                   f"target it was trained on")


def _ids_fix(d: DrafterExport, t: TargetSpec, engine: str, physical: list[int] | None, where: str) -> str:
    """How to make ``engine`` capture the trained layers: retrain (they do not fit), re-export (a folder written for
    the other engine), or the ids to write under the key ``engine`` reads."""
    n = t.num_layers
    try:
        validate_aux_layer_ids(physical or [], n)
    except LayerIdError:  # no config ids can give layers this target does not have (or 2 instead of 3)
        return (f"train a drafter on 3 layers of this target (default {_default(n)}), or serve this one with the "
                f"target it was trained on (layers {physical}, {where})")
    src = (d.sidecar or {}).get("source_checkpoint") or "<its training checkpoint>"
    reexport = f"eaglenest export --checkpoint {src} --output {d.path}"
    if d.format in FORMAT_ENGINES and engine not in FORMAT_ENGINES[d.format]:
        return (f"this folder was exported for {ENGINE_NAMES.get(d.format, d.format)} only (--format {d.format}); "
                f"re-export it with `{reexport}` (the default format, both, carries the ids SGLang and vLLM each "
                f"read, in one folder)")
    try:
        ids = engine_layer_ids(physical or [], engine=engine, architecture=t.architecture, num_layers=n)
    except LayerIdError:
        return "re-export the drafter for this target with eaglenest export"
    key = f"{IDS_KEY}: {ids} in the drafter's config.json" if engine == "sglang" else (
        f"\"{IDS_KEY}\": {ids} at the top level of the drafter's config.json (the key every vLLM model runner reads)")
    return (f"re-export the drafter with `{reexport}` (it writes the ids for this target's architecture), or "
            f"write {key}")


def _check_sglang(report: PreflightReport, d: DrafterExport, t: TargetSpec, physical: list[int] | None,
                  where: str) -> None:
    """What SGLang 0.5.14 will really capture from ``eagle_config``'s ids, by target architecture."""
    n, config_ids = t.num_layers, d.config_layer_ids
    rule = "adds 1 only when the first id is 1" if t.arch.sglang_rule == "first_id" else "adds 1 to every id"
    captured = engine_captured_layers(config_ids, engine="sglang", architecture=t.architecture, num_layers=n)
    try:
        validate_aux_layer_ids(captured, n)
    except LayerIdError as e:
        fix = (_ids_fix(d, t, "sglang", physical, where) if physical is not None
               else "re-export the drafter against this target with eaglenest export")
        report.add("aux_layer_ids", False, f"SGLang ({t.architecture}: {rule}) would capture layers {captured} from "
                                           f"{IDS_KEY} {config_ids}: {e}", fix)
        return
    if physical is None:
        report.add("aux_layer_ids", False, f"SGLang would capture physical layers {captured}, but the layers the "
                                           f"drafter was trained on are unknown (no {SIDECAR})",
                   "re-export the drafter with eaglenest export (it records the physical ids), or give "
                   "them (target.aux_layer_ids)")
        return
    if list(physical) != captured:
        report.add("aux_layer_ids", False,
                   f"SGLang 0.5.14 ({t.architecture}: {rule}) would capture physical layers {captured} from "
                   f"{IDS_KEY} {config_ids}, but the drafter was trained on {physical}",
                   _ids_fix(d, t, "sglang", physical, where))
        return
    report.add("aux_layer_ids", True, f"SGLang captures physical layers {captured} from config ids {config_ids} "
                                      f"({rule}), as trained ({where})")


def _check_vllm(report: PreflightReport, d: DrafterExport, t: TargetSpec, physical: list[int] | None,
                where: str) -> None:
    """What each of vLLM 0.32's model runners will capture: V1 (CPU, and GPU without Triton) reads the top-level key,
    else ``eagle_config``'s; V2 (a GPU's default) reads only the top-level key, else takes the target's default taps."""
    n = t.num_layers
    reads = vllm_reads(d.config)
    seen: dict[tuple[tuple[int, ...] | None, str], list[str]] = {}
    for runner, (ids, src) in reads.items():
        seen.setdefault((None if ids is None else tuple(ids), src), []).append(runner)
    outcomes = []
    for (ids, src), runners in seen.items():
        captured = engine_captured_layers(None if ids is None else list(ids), engine="vllm",
                                          architecture=t.architecture, num_layers=n)
        which = "both model runners" if len(runners) > 1 else f"model runner {runners[0].upper()}"
        label = f"vLLM {VLLM_VERSION} ({which})"
        from_ = f"{src} {list(ids)}" if ids is not None else src
        outcomes.append((label, from_, captured))
    for label, from_, captured in outcomes:
        try:
            validate_aux_layer_ids(captured, n)
        except LayerIdError as e:
            fix = (_ids_fix(d, t, "vllm", physical, where) if physical is not None
                   else "re-export the drafter against this target with eaglenest export")
            report.add("aux_layer_ids", False, f"{label} would capture layers {captured} from {from_}: {e}", fix)
            return
    if physical is None:
        report.add("aux_layer_ids", False, "; ".join(f"{label} would capture physical layers {c} from {f}"
                                                     for label, f, c in outcomes)
                   + f", but the layers the drafter was trained on are unknown (no {SIDECAR})",
                   "re-export the drafter with eaglenest export (it records the physical ids), or give "
                   "them (target.aux_layer_ids)")
        return
    wrong = [(label, f, c) for label, f, c in outcomes if c != list(physical)]
    if wrong:
        report.add("aux_layer_ids", False,
                   "; ".join(f"{label} would capture physical layers {c} from {f}" for label, f, c in wrong)
                   + f", but the drafter was trained on {physical}", _ids_fix(d, t, "vllm", physical, where))
        return
    report.add("aux_layer_ids", True, "; ".join(f"{label} captures physical layers {c} from {f}"
                                                for label, f, c in outcomes) + f", as trained ({where})")


def check_vllm_launch(report: PreflightReport, d: DrafterExport) -> None:
    """What vLLM's loader and launch need beyond the layers: a draft vocab smaller than the target's (vLLM 0.32 has no
    ``d2t`` parameter otherwise and refuses the tensor), and ``"method": "eagle3"`` in the launch."""
    cfg = d.config
    dv, v = cfg.get("draft_vocab_size"), cfg.get("vocab_size")
    if "d2t" in d.tensors and dv is not None and dv == v:
        report.add("vllm_loader", False,
                   f"draft_vocab_size {dv} is the whole target vocab and the export carries d2t: vLLM {VLLM_VERSION} "
                   "allocates no d2t for a full-vocab drafter and refuses to load the folder (\"There is no module "
                   "or parameter named 'draft_id_to_target_id'\")",
                   "train with a draft vocab smaller than the target's (train.drafter.draft_vocab_size)")
    else:
        report.add("vllm_loader", True, f"draft vocab {dv} < target vocab {v}: vLLM maps draft ids with d2t")
    spec = json.dumps(vllm_speculative_config(d.path))
    report.add("vllm_method", True, f"launch with speculative_config={spec}: without \"method\": \"eagle3\" vLLM "
                                    "loads the folder as a plain draft model and dies at the first decode")
