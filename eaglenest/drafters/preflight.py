"""Preflight: check a target + EAGLE-3 drafter + algorithm + engine before anything is served (one implementation).

The seed incident (an EAGLE-3 drafter launched with ``--speculative-algorithm EAGLE``: no aux capture, ``fc`` skipped,
accept length 1.0, no error anywhere) is one of a family of silent mismatches between what a drafter was trained on
and what the serving engine feeds it. Every such contract is one named check here; ``eaglenest preflight``, every
serve replica and the SGLang launcher (``eaglenest.engines.sglang.spec``) run the same list before an engine starts.
Only JSON files and safetensors headers are read (plus the two small vocab-mapping tensors and a few sampled embedding
rows), so a real target that cannot be loaded on this machine is still checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafters.eagle3.format import (
    DrafterExport,
    DrafterFormatError,
    read_drafter,
    vocab_mapping_problems,
)
from eaglenest.drafters.engine_checks import check_layers, check_vllm_launch
from eaglenest.drafters.registry import ALGORITHMS, algorithm_for_architecture
from eaglenest.drafters.shape_checks import check_draft_shape, check_shape_structure, check_tensors

Engine = Literal["hf", "sglang", "vllm"]
ENGINES = ("hf", "sglang", "vllm")
EMBED_SAMPLE_ROWS = 16


class SpeculativeConfigError(ValueError):
    """A drafter / algorithm / target / engine combination that must not be served; the message names the fix."""

    def __init__(self, message: str, fix: str = "") -> None:
        self.message, self.fix = message, fix
        super().__init__(f"{message}; fix: {fix}" if fix else message)


class PreflightError(SpeculativeConfigError):
    """A failed preflight; the message lists every failed check and its fix, ``report`` holds them all."""

    def __init__(self, report: PreflightReport) -> None:
        self.report = report
        super().__init__(report.failure_message())


@dataclass(frozen=True)
class Check:
    """One contract: ``ok`` or not, what was found, and (on failure) how to fix it."""

    name: str
    ok: bool
    message: str
    fix: str = ""


@dataclass
class PreflightReport:
    """Every check's outcome; ``ok`` only when all passed."""

    target: str
    drafter: str
    engine: str
    algorithm: str | None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, name: str, ok: bool, message: str, fix: str = "") -> bool:
        self.checks.append(Check(name, ok, message, "" if ok else fix))
        return ok

    def failure_message(self) -> str:
        lines = [f"preflight failed for drafter {self.drafter} on target {self.target} (engine {self.engine}, "
                 f"algorithm {self.algorithm or '?'}):"]
        lines += [f"  - [{c.name}] {c.message}" + (f"; fix: {c.fix}" if c.fix else "") for c in self.failures]
        return "\n".join(lines)

    def format(self) -> str:
        """A human-readable table, one line per check (fixes under failures)."""
        lines = [f"preflight: target {self.target}", f"           drafter {self.drafter}",
                 f"           engine {self.engine}, algorithm {self.algorithm or '?'}"]
        width = max((len(c.name) for c in self.checks), default=4)
        for c in self.checks:
            lines.append(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.message}")
            if c.fix:
                lines.append(f"        {'':<{width}}  fix: {c.fix}")
        lines.append("preflight passed" if self.ok else f"preflight FAILED: {len(self.failures)} check(s)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "target": self.target, "drafter": self.drafter, "engine": self.engine,
                "algorithm": self.algorithm, "checks": [asdict(c) for c in self.checks]}

    def raise_for_failures(self) -> PreflightReport:
        if not self.ok:
            raise PreflightError(self)
        return self


def derive_algorithm(drafter: DrafterExport, requested: str | None = None, *,
                     target_hidden_size: int | None = None) -> str:
    """The engine algorithm comes from the checkpoint (``eaglenest.drafters.registry``): an EAGLE-3 drafter is served
    with EAGLE3, always.

    Raises SpeculativeConfigError for a drafter no registered algorithm exports, and for a drafter under an engine
    algorithm that would silently misuse it (SGLang accepts EAGLE for an EAGLE-3 checkpoint); that message gives the
    state widths the drafter would get and the ones it needs (``target_hidden_size``, else the drafter's own record).
    """
    algo = algorithm_for_architecture(drafter.architecture)
    if algo is None:
        known = [a for alg in ALGORITHMS.values() for a in alg.export_architectures]
        raise SpeculativeConfigError(
            f"drafter architectures {drafter.config.get('architectures') or []} are not a drafter eaglenest serves",
            f"eaglenest serves drafters with architectures {known}; re-export the drafter with eaglenest export")
    if requested is None or requested == algo.sglang_algorithm:
        return algo.sglang_algorithm
    wrong = dict(algo.wrong_engine_algorithms)
    if requested not in wrong:
        raise SpeculativeConfigError(f"speculative algorithm {requested!r} is not supported here",
                                     f"use {algo.sglang_algorithm} (or leave it unset: it is derived from the drafter)")
    raise SpeculativeConfigError(
        f"the drafter is an {algo.title} checkpoint ({drafter.architecture}) but the algorithm is {requested}: "
        f"{wrong[requested]}{_state_widths(drafter, requested, target_hidden_size)}",
        f"use --algorithm {algo.sglang_algorithm} / serve.spec.algorithm: {algo.sglang_algorithm} (or leave it "
        f"unset: it is derived from the drafter)")


def _state_widths(drafter: DrafterExport, requested: str, target_hidden_size: int | None) -> str:
    """What a wrong engine algorithm feeds this drafter, in numbers: the target's final hidden state (H wide) instead
    of the 3 aux layers its ``fc`` fuses (3 x H). Empty when no width is known."""
    cfg = drafter.config
    h = int(target_hidden_size or cfg.get("target_hidden_size") or cfg.get("hidden_size") or 0)
    if not h:
        return ""
    physical, _ = drafter.recorded_physical_ids()
    layers = f" of layers {physical}" if physical else ""
    fc = drafter.shape("fc.weight")
    takes = f"its fc.weight {fc} takes" if fc else "its fc takes"
    return (f"; in numbers: under {requested} the drafter would get {h}-wide states instead of the 3 x {h} = "
            f"{3 * h}-wide aux states{layers} {takes}")


# ---------------------------------------------------------------------------------------------------------- checks
def run_preflight(
    target: str | Path | TargetSpec,
    drafter: str | Path | DrafterExport,
    *,
    algorithm: str | None = None,
    engine: Engine = "hf",
    context_length: int | None = None,
    expected_physical_ids: Sequence[int] | None = None,
) -> PreflightReport:
    """Run every check and return the report (never raises for a bad combination; see ``raise_for_failures``).

    ``target``: a local model folder (config.json is read) or a TargetSpec. ``context_length``: the serving
    context when it differs from the target's ``max_position_embeddings`` (e.g. ``target.sglang.context_length``).
    ``expected_physical_ids``: the layers the drafter was trained on when its export does not record them
    (``target.aux_layer_ids``).
    """
    drafter_name = drafter.path if isinstance(drafter, DrafterExport) else str(drafter)
    report = PreflightReport(target=str(target.path if isinstance(target, TargetSpec) else target),
                             drafter=drafter_name, engine=engine, algorithm=algorithm)
    if engine not in ENGINES:
        report.add("engine", False, f"unknown engine {engine!r}",
                   "use --engine hf (CPU reference), sglang or vllm")
        return report

    # -- inputs: each unreadable input is one failed check, and nothing depending on it runs
    t: TargetSpec | None
    try:
        t = (target.with_context(context_length) if isinstance(target, TargetSpec)
             else TargetSpec.read(target, context_length=context_length))
        report.add("target_config", True, f"{t.architecture}: {t.num_layers} layers, hidden {t.hidden_size}, "
                                          f"vocab {t.vocab_size}, context {t.context_length}")
    except (ValueError, OSError) as e:
        report.add("target_config", False, str(e), "pass the target's local model folder (with config.json)")
        t = None
    try:
        d = drafter if isinstance(drafter, DrafterExport) else read_drafter(drafter)
        cfg = d.config
        report.add("drafter_config", True, f"{(cfg.get('architectures') or ['?'])[0]}, hidden "
                                           f"{cfg.get('hidden_size')}, draft vocab {cfg.get('draft_vocab_size')}")
    except DrafterFormatError as e:
        report.add("drafter_config", False, str(e), "export the drafter with drafter.export (eaglenest export)")
        return report
    if d.tensor_error:
        report.add("required_tensors", False, f"cannot read drafter weights: {d.tensor_error}",
                   "re-export the drafter (safetensors only)")
    if d.sidecar_error:
        report.add("sidecar", False, d.sidecar_error, "re-export the drafter with eaglenest.drafter.export")

    _check_algorithm(report, d, algorithm, t.hidden_size if t is not None else None)
    _check_structure(report, d)
    if d.tensors:
        check_tensors(report, d)
    if t is None:
        return report
    check_draft_shape(report, d, t)
    _check_target_match(report, d, t)
    check_layers(report, d, t, engine, expected_physical_ids)
    if engine == "vllm":
        check_vllm_launch(report, d)
    _check_hidden(report, d, t)
    _check_vocab(report, d, t)
    _check_context(report, d, t, engine)
    if d.tensors and t.path:
        _check_embedding(report, d, t)
    return report


def _check_algorithm(report: PreflightReport, d: DrafterExport, requested: str | None,
                     target_hidden_size: int | None) -> None:
    try:
        derived = derive_algorithm(d, requested, target_hidden_size=target_hidden_size)
    except SpeculativeConfigError as e:
        report.add("algorithm", False, e.message, e.fix)
        return
    if requested is None:
        report.algorithm = derived
        report.add("algorithm", True, f"{derived}, derived from the checkpoint ({d.architecture})")
    else:
        report.add("algorithm", True, f"{requested} matches the checkpoint ({d.architecture})")


def _check_structure(report: PreflightReport, d: DrafterExport) -> None:
    cfg = d.config
    problems = []
    if int(cfg.get("num_hidden_layers", -1)) != 1:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')} (SGLang's EAGLE-3 drafter needs 1)")
    if "num_nextn_predict_layers" in cfg:
        problems.append("config carries num_nextn_predict_layers (a DeepSeek MTP key that sizes the draft KV pool 0)")
    if not (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        problems.append("eagle_config.use_aux_hidden_state is false (EAGLE-3 needs the aux layers)")
    problems.extend(check_shape_structure(d))
    report.add("drafter_structure", not problems, "; ".join(problems) or "1 decoder layer, aux hidden states on",
               "re-export the drafter with drafter.export (num_hidden_layers: 1, no num_nextn_predict_layers)")


def _check_target_match(report: PreflightReport, d: DrafterExport, t: TargetSpec) -> None:
    """The sidecar records the target the drafter was trained on; a different shape means another target."""
    sidecar = d.sidecar
    if sidecar is None:
        return
    pairs = [("target_num_layers", t.num_layers, "layers"), ("target_hidden_size", t.hidden_size, "hidden size"),
             ("target_vocab_size", t.vocab_size, "vocab")]
    problems = [f"{what} {sidecar[key]} (trained) != {have} (this target)" for key, have, what in pairs
                if sidecar.get(key) is not None and int(sidecar[key]) != have]
    recorded = sidecar.get("target") or "?"
    report.add("trained_target", not problems,
               f"the drafter was trained on target {recorded}: " + "; ".join(problems) if problems
               else f"shape of the trained target ({recorded}) matches",
               "serve the drafter with the target it was trained on, or train a drafter for this target")


def _check_hidden(report: PreflightReport, d: DrafterExport, t: TargetSpec) -> None:
    cfg, h = d.config, t.hidden_size
    target_hidden = int(cfg.get("target_hidden_size") or cfg.get("hidden_size") or 0)
    problems = []
    if target_hidden != h:
        problems.append(f"the drafter was built for target hidden size {target_hidden}, the target has {h}")
    if int(cfg.get("hidden_size") or 0) != h:
        problems.append(f"drafter hidden_size {cfg.get('hidden_size')} != target hidden {h} (the drafter shares the "
                        f"target's embedding)")
    report.add("hidden_size", not problems, "; ".join(problems) or f"hidden size {h} matches the target",
               "this drafter belongs to another target: train one on this target's hidden states")
    shape = d.shape("fc.weight")
    if shape is None:
        return  # reported by required_tensors
    want = [int(cfg.get("hidden_size") or h), 3 * h]
    report.add("fc_input", shape == want,
               f"fc.weight is {shape} (fc.weight takes {shape[-1]} inputs); EAGLE-3 fuses 3 aux layers: "
               f"[hidden, 3 x {h}] = {want}" if shape != want
               else f"fc.weight {shape} takes 3 x {h} target hidden",
               "the drafter must be trained on 3 aux layers of this target (fc input = 3 x target hidden); "
               "re-train/re-export it for this target")


def _check_vocab(report: PreflightReport, d: DrafterExport, t: TargetSpec) -> None:
    cfg, v = d.config, t.vocab_size
    dv = cfg.get("draft_vocab_size")
    problems = []
    if int(cfg.get("vocab_size") or 0) != v:
        problems.append(f"drafter vocab_size {cfg.get('vocab_size')} != target vocab {v}")
    if dv is None:
        problems.append("draft_vocab_size is missing (SGLang would then use the target's lm_head, not the drafter's)")
    elif int(dv) > v:
        problems.append(f"draft_vocab_size {dv} exceeds the target vocab {v}")
    lm = d.shape("lm_head.weight")
    if lm is not None and dv is not None and lm[0] != int(dv):
        problems.append(f"lm_head.weight has {lm[0]} rows but draft_vocab_size is {dv}")
    report.add("vocab", not problems, "; ".join(problems) or f"target vocab {v}, draft vocab {dv}",
               "re-export the drafter for this target's tokenizer (vocab_size = target vocab, draft_vocab_size = "
               "lm_head rows)")
    if "d2t" not in d.tensors or "t2d" not in d.tensors or dv is None:
        return
    _check_mapping(report, d, int(dv), v)


def _check_mapping(report: PreflightReport, d: DrafterExport, dv: int, v: int) -> None:
    fix = "rebuild the vocab mapping (drafters.vocab) and re-export; d2t[i] = target_id(i) - i, t2d marks those ids"
    d2t_shape, t2d_shape = d.shape("d2t"), d.shape("t2d")
    problems = []
    if d2t_shape != [dv]:
        problems.append(f"d2t has shape {d2t_shape}, expected [{dv}] (draft vocab)")
    if t2d_shape != [v]:
        problems.append(f"t2d has shape {t2d_shape}, expected [{v}] (target vocab)")
    if not problems:
        problems = vocab_mapping_problems(d.load_tensor("d2t"), d.load_tensor("t2d"))
    report.add("vocab_mapping", not problems, "; ".join(problems) or f"d2t/t2d consistent ({dv} draft ids)", fix)


def _check_context(report: PreflightReport, d: DrafterExport, t: TargetSpec, engine: str) -> None:
    draft_ctx = int(d.config.get("max_position_embeddings") or 0)
    ok = not t.context_length or draft_ctx >= t.context_length
    extra = " (SGLang refuses to start)" if engine == "sglang" else " (the drafter was not built for long positions)"
    report.add("context_length", ok,
               f"drafter max_position_embeddings {draft_ctx} >= target context {t.context_length}" if ok
               else f"drafter max_position_embeddings {draft_ctx} < target context {t.context_length}{extra}",
               "re-export the drafter with max_position_embeddings >= the target context (train.drafter."
               "max_position_embeddings), or serve with a smaller context (target.sglang.context_length)")


def _check_embedding(report: PreflightReport, d: DrafterExport, t: TargetSpec) -> None:
    """Same shapes do not mean the same target (Kimi-K2 vs K2.5, a rebuilt model): the drafter's copy of the
    target's embedding must match the target's own, sampled on a few rows."""
    shape = d.shape("embed_tokens.weight")
    if shape is None:
        report.add("target_embedding", True, "not checked: the export carries no embedding (the engine shares the "
                                             "target's)")
        return
    import torch

    rows = sorted({int(i) for i in torch.linspace(0, shape[0] - 1, EMBED_SAMPLE_ROWS).tolist()})
    try:
        theirs = t.embed_rows(rows)
    except FileNotFoundError:
        report.add("target_embedding", True, "not checked: no target weights in the folder (config only)")
        return
    except (OSError, ValueError, KeyError) as e:
        report.add("target_embedding", True, f"not checked: cannot read the target's embedding ({e})")
        return
    a, b = d.tensor_rows("embed_tokens.weight", rows).float(), theirs.float()
    if a.shape != b.shape:
        report.add("target_embedding", True, f"not checked: embedding widths differ ({a.shape[-1]} vs {b.shape[-1]}; "
                                             f"see hidden_size)")
        return
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    recorded = (d.sidecar or {}).get("target") or "?"
    report.add("target_embedding", err < 2e-2,
               f"the drafter's embedding matches the target's on {len(rows)} sampled rows (rel. error {err:.1e})"
               if err < 2e-2 else
               f"the drafter's copy of the target embedding differs from this target's (rel. error {err:.2f} on "
               f"{len(rows)} sampled rows): it was trained on another target of the same shape (recorded: "
               f"{recorded})",
               "serve the drafter with the target it was trained on, or train a drafter on this target's hidden "
               "states")


# ------------------------------------------------------------------------------------------------------ entry points
def preflight_or_raise(target: str | Path | TargetSpec, drafter: str | Path | DrafterExport, *,
                       algorithm: str | None = None, engine: Engine = "hf", context_length: int | None = None,
                       expected_physical_ids: Sequence[int] | None = None) -> PreflightReport:
    """``run_preflight`` that raises PreflightError (message = every failed check and its fix)."""
    return run_preflight(target, drafter, algorithm=algorithm, engine=engine, context_length=context_length,
                         expected_physical_ids=expected_physical_ids).raise_for_failures()


def preflight_for_config(cfg: EaglenestConfig, drafter: str | Path, *, folder: Path | None,
                         target_info: Any = None) -> PreflightReport:
    """The checks for a serve config: target and engine from ``target:``, algorithm from ``serve.spec``.

    ``folder``: the target's local folder (``eaglenest.engines.location.local_target_folder``), None for a hub id,
    then ``target_info`` (a loaded engine's) stands in."""
    engine = cfg.target.engine
    ctx = cfg.target.sglang.context_length if engine == "sglang" else None
    if folder is not None:
        target: Path | TargetSpec = folder
    elif target_info is not None:
        target = TargetSpec.from_info(target_info, context_length=ctx)
    else:
        raise ValueError(f"target {cfg.target.model!r} is not a local folder; preflight needs its config.json "
                         f"(download the model and set target.model to the folder)")
    return run_preflight(target, drafter, algorithm=cfg.serve.spec.algorithm, engine=engine, context_length=ctx)
