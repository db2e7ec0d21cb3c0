"""Preflight: check a target + EAGLE-3 drafter + algorithm + engine before anything is served.

The seed incident (an EAGLE-3 drafter launched with ``--speculative-algorithm EAGLE``: no aux capture, ``fc`` skipped,
accept length 1.0, no error anywhere) is one of a family of silent mismatches between what a drafter was trained on
and what the serving engine feeds it. Every such contract is one named check here; ``eaglenest preflight`` and every
serve replica run the same list before the engine starts. Only JSON files and safetensors headers are read (plus the
two small vocab-mapping tensors), so a real target that cannot be loaded on this machine is still checked.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.layers import (
    LayerIdError,
    default_aux_layer_ids,
    sglang_captured_layers,
    validate_aux_layer_ids,
)
from eaglenest.engines.sglang_spec import FIRST_ID_RULE_ARCHS, REQUIRED_DRAFT_WEIGHTS, SIDECAR, sglang_config_ids_for

Engine = Literal["hf", "sglang"]
Algorithm = Literal["EAGLE3", "EAGLE"]

REQUIRED_TENSORS: tuple[str, ...] = (*REQUIRED_DRAFT_WEIGHTS, "t2d")
"""Everything an eaglenest EAGLE-3 export holds; SGLang drops unknown names silently, so absence is fatal."""

_SIDECAR_ID_KEYS = ("aux_layer_ids_physical", "aux_layer_ids", "physical_aux_layer_ids", "physical_layer_ids")


class PreflightError(RuntimeError):
    """A target/drafter/algorithm/engine combination that must not be served; the message lists each fix."""

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


@dataclass(frozen=True)
class TargetSummary:
    """What the checks need from the target: read from its config.json, or from a loaded engine's TargetInfo."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    architecture: str
    source: str = ""

    @classmethod
    def from_folder(cls, path: str | Path, *, context_length: int | None = None) -> TargetSummary:
        """A local HF folder's config.json; multimodal configs (Kimi-K2.5) keep the LM under ``text_config``."""
        p = Path(path)
        cfg = _read_json(p / "config.json", f"target {p}", fix="pass the target's model folder (with config.json)")
        text = cfg.get("text_config") or cfg
        missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
        if missing:
            raise ValueError(f"target config {p / 'config.json'} lacks {missing} (also looked under text_config)")
        arch = (cfg.get("architectures") or text.get("architectures") or ["?"])[0]
        return cls(
            num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            context_length=int(context_length or text.get("max_position_embeddings") or 0),
            architecture=str(arch), source=str(p),
        )

    @classmethod
    def from_info(cls, info: Any, *, context_length: int | None = None) -> TargetSummary:
        """From an engine's ``TargetInfo`` (the replica has the target loaded already)."""
        return cls(num_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                   context_length=int(context_length or info.max_position_embeddings or 0),
                   architecture=info.architecture, source=info.model)


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
        for c in self.failures:
            lines.append(f"  - [{c.name}] {c.message}" + (f"\n    fix: {c.fix}" if c.fix else ""))
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


# --------------------------------------------------------------------------------------------------------- inputs
def _read_json(path: Path, what: str, *, fix: str) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{what}: {path} does not exist; {fix}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e}); {fix}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object; {fix}")
    return data


def safetensors_header(folder: Path) -> dict[str, tuple[list[int], str, Path]]:
    """Tensor name -> (shape, dtype, file) from every ``*.safetensors`` header (8-byte length + JSON; no weights)."""
    out: dict[str, tuple[list[int], str, Path]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{f} is not a safetensors file (truncated header)")
            n = int.from_bytes(raw, "little")
            if n <= 0 or n > 100_000_000:
                raise ValueError(f"{f} is not a safetensors file (header length {n})")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name.removeprefix("model.")] = (list(meta["shape"]), str(meta["dtype"]), f)
    return out


def _load_tensor(name: str, where: dict[str, tuple[list[int], str, Path]]) -> Any:
    from safetensors import safe_open

    _, _, f = where[name]
    with safe_open(str(f), framework="pt") as fh:
        names = set(fh.keys())
        key = name if name in names else f"model.{name}"
        return fh.get_tensor(key)


def derive_algorithm(architecture: str) -> str | None:
    """The algorithm a checkpoint must be served with: ``*Eagle3`` architectures -> EAGLE3."""
    return "EAGLE3" if architecture.endswith("Eagle3") else None


# ---------------------------------------------------------------------------------------------------------- checks
def run_preflight(
    target: str | Path | TargetSummary,
    drafter: str | Path,
    *,
    algorithm: str | None = None,
    engine: Engine = "hf",
    context_length: int | None = None,
) -> PreflightReport:
    """Run every check and return the report (never raises for a bad combination; see ``raise_for_failures``).

    ``target``: a local model folder (config.json is read) or a TargetSummary. ``context_length``: the serving
    context when it differs from the target's ``max_position_embeddings`` (e.g. ``target.sglang.context_length``).
    """
    d = Path(drafter)
    report = PreflightReport(target=str(target.source if isinstance(target, TargetSummary) else target),
                             drafter=str(d), engine=engine, algorithm=algorithm)
    if engine not in ("hf", "sglang"):
        report.add("engine", False, f"unknown engine {engine!r}", "use --engine hf (CPU reference) or sglang (GPU)")
        return report

    # -- inputs: each unreadable input is one failed check, and nothing depending on it runs
    try:
        t = target if isinstance(target, TargetSummary) else TargetSummary.from_folder(target,
                                                                                      context_length=context_length)
        report.add("target_config", True, f"{t.architecture}: {t.num_layers} layers, hidden {t.hidden_size}, "
                                          f"vocab {t.vocab_size}, context {t.context_length}")
    except ValueError as e:
        report.add("target_config", False, str(e), "pass the target's local model folder (with config.json)")
        t = None
    try:
        cfg = _read_json(d / "config.json", f"drafter {d}", fix="export the drafter with eaglenest.drafter.export")
        report.add("drafter_config", True, f"{(cfg.get('architectures') or ['?'])[0]}, hidden "
                                           f"{cfg.get('hidden_size')}, draft vocab {cfg.get('draft_vocab_size')}")
    except ValueError as e:
        report.add("drafter_config", False, str(e), "export the drafter with drafter.export (eaglenest export)")
        return report
    try:
        tensors = safetensors_header(d)
        if not tensors:
            raise ValueError(f"no *.safetensors files in {d}")
    except (ValueError, OSError) as e:
        report.add("required_tensors", False, f"cannot read drafter weights: {e}",
                   "re-export the drafter (safetensors only)")
        tensors = {}
    sidecar = None
    if (d / SIDECAR).is_file():
        try:
            sidecar = _read_json(d / SIDECAR, f"drafter sidecar {d}", fix="re-export the drafter")
        except ValueError as e:
            report.add("sidecar", False, str(e), "re-export the drafter with eaglenest.drafter.export")

    _check_algorithm(report, cfg, algorithm)
    _check_structure(report, cfg)
    if tensors:
        _check_tensors(report, tensors)
    if t is None:
        return report
    _check_target_match(report, sidecar, t)
    _check_layers(report, cfg, sidecar, t, engine)
    _check_hidden(report, cfg, tensors, t)
    _check_vocab(report, cfg, tensors, t)
    _check_context(report, cfg, t, engine)
    if tensors and not isinstance(target, TargetSummary):
        _check_embedding(report, tensors, Path(target), sidecar)
    return report


def _check_algorithm(report: PreflightReport, cfg: dict[str, Any], requested: str | None) -> None:
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if len(archs) == 1 else "?"
    derived = derive_algorithm(arch)
    if derived is None:
        report.add("algorithm", False, f"drafter architectures {archs} are not an EAGLE-3 drafter",
                   "eaglenest serves EAGLE-3 drafters only (architectures: [LlamaForCausalLMEagle3]); re-export "
                   "the drafter with eaglenest.drafter.export")
        return
    if requested is None:
        report.algorithm = derived
        report.add("algorithm", True, f"{derived}, derived from the checkpoint ({arch})")
    elif requested == derived:
        report.add("algorithm", True, f"{requested} matches the checkpoint ({arch})")
    else:
        report.add("algorithm", False,
                   f"the drafter is an EAGLE-3 checkpoint ({arch}) but the algorithm is {requested}: the engine would "
                   f"feed it the final hidden state instead of the 3 aux layers, skip its fc, replace its lm_head with "
                   f"the target's, and accept length would sit at 1.0 with no error",
                   "use --algorithm EAGLE3 / serve.spec.algorithm: EAGLE3 (or leave it unset: it is derived from "
                   "the drafter)")


def _check_structure(report: PreflightReport, cfg: dict[str, Any]) -> None:
    problems = []
    if int(cfg.get("num_hidden_layers", -1)) != 1:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')} (SGLang's EAGLE-3 drafter needs 1)")
    if "num_nextn_predict_layers" in cfg:
        problems.append("config carries num_nextn_predict_layers (a DeepSeek MTP key that sizes the draft KV pool 0)")
    if not (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        problems.append("eagle_config.use_aux_hidden_state is false (EAGLE-3 needs the aux layers)")
    report.add("drafter_structure", not problems, "; ".join(problems) or "1 decoder layer, aux hidden states on",
               "re-export the drafter with drafter.export (num_hidden_layers: 1, no num_nextn_predict_layers)")


def _check_tensors(report: PreflightReport, tensors: dict[str, Any]) -> None:
    missing = [k for k in REQUIRED_TENSORS if k not in tensors]
    report.add("required_tensors", not missing,
               f"missing tensors {missing} (SGLang leaves unknown/missing modules random without an error)" if missing
               else f"all {len(REQUIRED_TENSORS)} required tensors present",
               "re-export the drafter with drafter.export; tensor names must be fc.weight, midlayer.*, norm.weight, "
               "lm_head.weight, d2t, t2d")


def _check_target_match(report: PreflightReport, sidecar: dict[str, Any] | None, t: TargetSummary) -> None:
    """The sidecar records the target the drafter was trained on; a different shape means another target."""
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


def _recorded_physical_ids(cfg: dict[str, Any], sidecar: dict[str, Any] | None) -> tuple[list[int] | None, str]:
    if sidecar is not None:
        for key in _SIDECAR_ID_KEYS:
            if sidecar.get(key) is not None:
                return [int(i) for i in sidecar[key]], f"{SIDECAR}:{key}"
        inner = (sidecar.get("drafter_config") or {}).get("aux_layer_ids")
        if inner is not None:
            return [int(i) for i in inner], f"{SIDECAR}:drafter_config.aux_layer_ids"
    return None, ""


def _check_layers(report: PreflightReport, cfg: dict[str, Any], sidecar: dict[str, Any] | None,
                  t: TargetSummary, engine: str) -> None:
    config_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    config_ids = None if config_ids is None else [int(i) for i in config_ids]
    physical, where = _recorded_physical_ids(cfg, sidecar)
    n = t.num_layers
    if engine == "hf":
        # the reference decoder taps transformers' hidden_states with the physical ids the drafter was trained on
        if physical is None and config_ids is not None:
            physical, where = [i + 1 for i in config_ids], "config.json eagle_config read as SGLang ids (+1)"
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
        return
    # sglang: check what SGLang 0.5.14 will really capture from the config ids, by target architecture
    family = t.architecture in FIRST_ID_RULE_ARCHS
    rule = "adds 1 only when the first id is 1" if family else "adds 1 to every id"
    captured = sglang_captured_layers(config_ids, n, deepseek_family=family)
    try:
        validate_aux_layer_ids(captured, n)
    except LayerIdError as e:
        fix = "re-export the drafter against this target with eaglenest.drafter.export"
        if physical is not None:
            with contextlib.suppress(LayerIdError):
                fix = (f"write eagle_aux_hidden_state_layer_ids: "
                       f"{sglang_config_ids_for(physical, n, first_id_rule=family)} in the drafter's config.json")
        report.add("aux_layer_ids", False, f"SGLang ({t.architecture}: {rule}) would capture layers {captured} from "
                                           f"eagle_aux_hidden_state_layer_ids {config_ids}: {e}", fix)
        return
    if physical is None:
        report.add("aux_layer_ids", False, f"SGLang would capture physical layers {captured}, but the layers the "
                                           f"drafter was trained on are unknown (no {SIDECAR})",
                   "re-export the drafter with eaglenest.drafter.export (it records the physical ids)")
        return
    if list(physical) != captured:
        try:
            want = f"write eagle_aux_hidden_state_layer_ids: {sglang_config_ids_for(physical, n, first_id_rule=family)}"
        except LayerIdError:
            want = "re-export the drafter for this target"
        report.add("aux_layer_ids", False,
                   f"SGLang 0.5.14 ({t.architecture}: {rule}) would capture physical layers {captured} from "
                   f"eagle_aux_hidden_state_layer_ids {config_ids}, but the drafter was trained on {physical}", want)
        return
    report.add("aux_layer_ids", True, f"SGLang captures physical layers {captured} from config ids {config_ids} "
                                      f"({rule}), as trained ({where})")


def _default(n: int) -> list[int] | str:
    return default_aux_layer_ids(n) if n >= 4 else "none (fewer than 4 layers)"


def _check_hidden(report: PreflightReport, cfg: dict[str, Any], tensors: dict[str, Any], t: TargetSummary) -> None:
    h = t.hidden_size
    target_hidden = int(cfg.get("target_hidden_size") or cfg.get("hidden_size") or 0)
    problems = []
    if target_hidden != h:
        problems.append(f"the drafter was built for target hidden size {target_hidden}, the target has {h}")
    if int(cfg.get("hidden_size") or 0) != h:
        problems.append(f"drafter hidden_size {cfg.get('hidden_size')} != target hidden {h} (the drafter shares the "
                        f"target's embedding)")
    report.add("hidden_size", not problems, "; ".join(problems) or f"hidden size {h} matches the target",
               "this drafter belongs to another target: train one on this target's hidden states")
    fc = tensors.get("fc.weight")
    if fc is None:
        return  # reported by required_tensors
    shape = fc[0]
    want = [int(cfg.get("hidden_size") or h), 3 * h]
    report.add("fc_input", shape == want,
               f"fc.weight is {shape}; EAGLE-3 fuses 3 aux layers: [hidden, 3 x {h}] = {want}" if shape != want
               else f"fc.weight {shape} takes 3 x {h} target hidden",
               "the drafter must be trained on 3 aux layers of this target (fc input = 3 x target hidden); "
               "re-train/re-export it for this target")


def _check_vocab(report: PreflightReport, cfg: dict[str, Any], tensors: dict[str, Any], t: TargetSummary) -> None:
    v = t.vocab_size
    dv = cfg.get("draft_vocab_size")
    problems = []
    if int(cfg.get("vocab_size") or 0) != v:
        problems.append(f"drafter vocab_size {cfg.get('vocab_size')} != target vocab {v}")
    if dv is None:
        problems.append("draft_vocab_size is missing (SGLang would then use the target's lm_head, not the drafter's)")
    elif int(dv) > v:
        problems.append(f"draft_vocab_size {dv} exceeds the target vocab {v}")
    lm = tensors.get("lm_head.weight")
    if lm is not None and dv is not None and lm[0][0] != int(dv):
        problems.append(f"lm_head.weight has {lm[0][0]} rows but draft_vocab_size is {dv}")
    report.add("vocab", not problems, "; ".join(problems) or f"target vocab {v}, draft vocab {dv}",
               "re-export the drafter for this target's tokenizer (vocab_size = target vocab, draft_vocab_size = "
               "lm_head rows)")
    if "d2t" not in tensors or "t2d" not in tensors or dv is None:
        return
    _check_mapping(report, tensors, int(dv), v)


def _check_mapping(report: PreflightReport, tensors: dict[str, Any], dv: int, v: int) -> None:
    import torch

    fix = "rebuild the vocab mapping (drafter.vocab) and re-export; d2t[i] = target_id(i) - i, t2d marks those ids"
    d2t_shape, t2d_shape = tensors["d2t"][0], tensors["t2d"][0]
    problems = []
    if d2t_shape != [dv]:
        problems.append(f"d2t has shape {d2t_shape}, expected [{dv}] (draft vocab)")
    if t2d_shape != [v]:
        problems.append(f"t2d has shape {t2d_shape}, expected [{v}] (target vocab)")
    if problems:
        report.add("vocab_mapping", False, "; ".join(problems), fix)
        return
    d2t = _load_tensor("d2t", tensors).to(torch.long)
    t2d = _load_tensor("t2d", tensors).to(torch.bool)
    ids = d2t + torch.arange(dv)
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        problems.append(f"d2t + arange maps into [{int(ids.min())}, {int(ids.max())}], outside the target vocab "
                        f"[0, {v})")
    elif len(torch.unique(ids)) != dv:
        problems.append("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != dv:
        problems.append(f"t2d marks {int(t2d.sum())} target ids, expected {dv} (draft vocab)")
    elif not problems and not bool(t2d[ids].all()):
        problems.append("t2d and d2t disagree: some target ids reached by d2t are not marked in t2d")
    report.add("vocab_mapping", not problems, "; ".join(problems) or f"d2t/t2d consistent ({dv} draft ids)", fix)


def _check_context(report: PreflightReport, cfg: dict[str, Any], t: TargetSummary, engine: str) -> None:
    draft_ctx = int(cfg.get("max_position_embeddings") or 0)
    ok = not t.context_length or draft_ctx >= t.context_length
    extra = " (SGLang refuses to start)" if engine == "sglang" else " (the drafter was not built for long positions)"
    report.add("context_length", ok,
               f"drafter max_position_embeddings {draft_ctx} >= target context {t.context_length}" if ok
               else f"drafter max_position_embeddings {draft_ctx} < target context {t.context_length}{extra}",
               "re-export the drafter with max_position_embeddings >= the target context (train.drafter."
               "max_position_embeddings), or serve with a smaller context (target.sglang.context_length)")


EMBED_SAMPLE_ROWS = 16


def _target_embedding_rows(folder: Path, rows: list[int]) -> Any | None:
    """A few rows of the target's input embedding, read by slice from its safetensors (never the whole tensor)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wmap = dict(json.loads(index.read_text())["weight_map"])
    else:
        wmap = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                wmap.update({k: f.name for k in fh.keys()})  # noqa: SIM118 - safe_open has no __iter__
    hits = [n for n in wmap if n.endswith("embed_tokens.weight") and "vision" not in n and "mtp" not in n]
    if not hits:
        return None
    name = min(hits, key=len)
    import torch

    with safe_open(str(folder / wmap[name]), framework="pt") as fh:
        sl = fh.get_slice(name)
        return torch.stack([sl[r:r + 1][0] for r in rows])


def _check_embedding(report: PreflightReport, tensors: dict[str, Any], folder: Path,
                     sidecar: dict[str, Any] | None) -> None:
    """Same shapes do not mean the same target (Kimi-K2 vs K2.5, a rebuilt model): the drafter's copy of the
    target's embedding must match the target's own, sampled on a few rows."""
    if "embed_tokens.weight" not in tensors:
        report.add("target_embedding", True, "not checked: the export carries no embedding (the engine shares the "
                                             "target's)")
        return
    import torch

    vocab = tensors["embed_tokens.weight"][0][0]
    rows = sorted({int(i) for i in torch.linspace(0, vocab - 1, EMBED_SAMPLE_ROWS).tolist()})
    try:
        theirs = _target_embedding_rows(folder, rows)
    except (OSError, ValueError, KeyError) as e:
        report.add("target_embedding", True, f"not checked: cannot read the target's embedding ({e})")
        return
    if theirs is None:
        report.add("target_embedding", True, "not checked: no target weights in the folder (config only)")
        return
    from safetensors import safe_open

    _, _, f = tensors["embed_tokens.weight"]
    with safe_open(str(f), framework="pt") as fh:
        names = set(fh.keys())
        name = "embed_tokens.weight" if "embed_tokens.weight" in names else "model.embed_tokens.weight"
        sl = fh.get_slice(name)
        ours = torch.stack([sl[r:r + 1][0] for r in rows])
    a, b = ours.float(), theirs.float()
    if a.shape != b.shape:
        report.add("target_embedding", True, f"not checked: embedding widths differ ({a.shape[-1]} vs {b.shape[-1]}; "
                                             f"see hidden_size)")
        return
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    recorded = (sidecar or {}).get("target") or "?"
    report.add("target_embedding", err < 2e-2,
               f"the drafter's embedding matches the target's on {len(rows)} sampled rows (rel. error {err:.1e})"
               if err < 2e-2 else
               f"the drafter's copy of the target embedding differs from this target's (rel. error {err:.2f} on "
               f"{len(rows)} sampled rows): it was trained on another target of the same shape (recorded: "
               f"{recorded})",
               "serve the drafter with the target it was trained on, or train a drafter on this target's hidden "
               "states")


def preflight_or_raise(target: str | Path | TargetSummary, drafter: str | Path, *, algorithm: str | None = None,
                       engine: Engine = "hf", context_length: int | None = None) -> PreflightReport:
    """``run_preflight`` that raises PreflightError (message = every failed check and its fix)."""
    return run_preflight(target, drafter, algorithm=algorithm, engine=engine,
                         context_length=context_length).raise_for_failures()


def physical_aux_ids(drafter: str | Path) -> list[int] | None:
    """The physical aux layer ids a drafter export was trained on (sidecar first, else SGLang ids + 1)."""
    d = Path(drafter)
    sidecar = json.loads((d / SIDECAR).read_text()) if (d / SIDECAR).is_file() else None
    cfg = json.loads((d / "config.json").read_text())
    ids, _ = _recorded_physical_ids(cfg, sidecar)
    if ids is None and (sidecar or {}).get("format") == "vllm":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        cfg_ids: Sequence[int] | None = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = None if cfg_ids is None else [int(i) + 1 for i in cfg_ids]
    return ids


def local_target_folder(cfg: EaglenestConfig) -> Path | None:
    """The target's local folder (``tiny`` is built/cached on first use), or None for a hub id."""
    model = cfg.target.model
    if model == "tiny":
        from eaglenest.engines.tiny import ensure_tiny_target

        return Path(ensure_tiny_target(cfg.target.tiny, cfg.target.cache_dir))
    p = Path(model).expanduser()
    return p if (p / "config.json").is_file() else None


def preflight_for_config(cfg: EaglenestConfig, drafter: str | Path, *, target_info: Any = None) -> PreflightReport:
    """The checks for a serve config: target and engine from ``target:``, algorithm from ``serve.spec``."""
    engine = cfg.target.engine
    ctx = cfg.target.sglang.context_length if engine == "sglang" else None
    folder = local_target_folder(cfg)
    if folder is not None:
        target: Path | TargetSummary = folder
    elif target_info is not None:
        target = TargetSummary.from_info(target_info, context_length=ctx)
    else:
        raise ValueError(f"target {cfg.target.model!r} is not a local folder; preflight needs its config.json "
                         f"(download the model and set target.model to the folder)")
    return run_preflight(target, drafter, algorithm=cfg.serve.spec.algorithm, engine=engine, context_length=ctx)
