"""Training checkpoints: full state (weights, optimizer, scheduler, step, data position, vocab) without pickle.

Layout of one checkpoint folder::

    drafter.safetensors     trainable weights + d2t/t2d (the frozen embedding is re-copied from the target)
    drafter_config.json     DrafterModelConfig
    vocab.safetensors       the draft vocab mapping and the counts it came from
    optimizer.safetensors   every optimizer state tensor, keyed ``state/<param index>/<name>``
    optimizer.json          param groups and non-tensor state
    train_state.json        step, epoch, data position, scheduler state, fingerprints
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglenest.drafters.eagle3.model import DrafterModelConfig, Eagle3Drafter
from eaglenest.drafters.vocab import VOCAB_FILE, VocabMapping

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"
OPT_TENSORS = "optimizer.safetensors"
OPT_META = "optimizer.json"
STATE = "train_state.json"
REQUIRED = (WEIGHTS, CONFIG, VOCAB_FILE, OPT_TENSORS, OPT_META, STATE)
FROZEN = ("embed_tokens.weight",)


def drafter_tensors(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """State dict without the frozen target embedding, contiguous, on the CPU."""
    return {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items() if k not in FROZEN}


def optimizer_to_files(opt_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (safetensors) and JSON-able structure."""
    tensors: dict[str, torch.Tensor] = {}
    meta_state: dict[str, dict[str, Any]] = {}
    for pid, st in opt_state["state"].items():
        entry: dict[str, Any] = {}
        for name, value in st.items():
            if torch.is_tensor(value):
                key = f"state/{pid}/{name}"
                tensors[key] = value.detach().to("cpu").contiguous()
                entry[name] = {"tensor": key}
            else:
                entry[name] = {"value": value}
        meta_state[str(pid)] = entry
    return tensors, {"state": meta_state, "param_groups": opt_state["param_groups"]}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for pid, entry in meta["state"].items():
        state[int(pid)] = {
            name: tensors[v["tensor"]] if "tensor" in v else v["value"] for name, v in entry.items()
        }
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def state_fingerprint(opt_state: dict[str, Any]) -> str:
    """A hash of an optimizer state (every tensor's bytes + the group hyperparameters), to prove a faithful reload.
    CPU tensors are hashed in place (no copy: at Kimi's widths the state is ~9.5 GB)."""
    h = hashlib.sha256()
    for pid in sorted(opt_state["state"], key=int):
        for name in sorted(opt_state["state"][pid]):
            v = opt_state["state"][pid][name]
            h.update(f"{pid}/{name}".encode())
            if torch.is_tensor(v):
                v = v.detach().to("cpu").contiguous()
                h.update(str(v.dtype).encode() + str(tuple(v.shape)).encode())
                h.update(memoryview(v.reshape(-1).view(torch.uint8).numpy()) if v.numel() else b"")
            else:
                h.update(repr(v).encode())
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
              for g in opt_state["param_groups"]]
    h.update(json.dumps(groups, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def save_training_checkpoint(
    out_dir: str | Path,
    *,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    mapping: VocabMapping,
    state: dict[str, Any],
) -> Path:
    """Write every file of a checkpoint into ``out_dir`` (train_state.json last: its presence marks completeness)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(drafter_tensors(drafter), str(out / WEIGHTS), metadata={"format": "eaglenest-drafter-train"})
    drafter.config.save(out / CONFIG)
    mapping.save(out / VOCAB_FILE)
    tensors, meta = optimizer_to_files(optimizer.state_dict())
    save_file(tensors, str(out / OPT_TENSORS))
    opt_state = optimizer_from_files(tensors, meta)  # the CPU copies just written: hashed without a second copy
    (out / OPT_META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=_json_default) + "\n")
    full_state = dict(state)
    full_state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    full_state["optimizer_fingerprint"] = state_fingerprint(opt_state)
    full_state["vocab_fingerprint"] = mapping.fingerprint()
    (out / STATE).write_text(json.dumps(full_state, indent=2, sort_keys=True, default=_json_default) + "\n")
    return out


def _json_default(o: Any) -> Any:
    if torch.is_tensor(o):
        return o.item() if o.numel() == 1 else o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"cannot store {type(o).__name__} in a checkpoint's JSON")


@dataclass
class TrainingCheckpoint:
    """A loaded checkpoint folder."""

    path: Path
    config: DrafterModelConfig
    weights: dict[str, torch.Tensor]
    mapping: VocabMapping
    optimizer_state: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def is_training_checkpoint(path: str | Path) -> bool:
    return all((Path(path) / f).is_file() for f in REQUIRED)


def load_training_checkpoint(path: str | Path, *, optimizer: bool = True) -> TrainingCheckpoint:
    """A checkpoint folder, read; ``optimizer=False`` leaves the optimizer's tensors unread (an export needs the
    weights only, and at Kimi's widths the optimizer state is ~9.5 GB)."""
    p = Path(path)
    missing = [f for f in REQUIRED if not (p / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{p} is not a complete drafter training checkpoint: missing {missing}")
    meta = json.loads((p / OPT_META).read_text())
    return TrainingCheckpoint(
        path=p,
        config=DrafterModelConfig.load(p / CONFIG),
        weights=load_file(str(p / WEIGHTS)),
        mapping=VocabMapping.load(p / VOCAB_FILE),
        optimizer_state=optimizer_from_files(load_file(str(p / OPT_TENSORS)), meta) if optimizer else {},
        state=json.loads((p / STATE).read_text()),
    )


def restore(
    ckpt: TrainingCheckpoint,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> None:
    """Load weights (strict, except the frozen embedding), optimizer and scheduler state."""
    missing, unexpected = drafter.load_state_dict(ckpt.weights, strict=False)
    missing = [k for k in missing if k not in FROZEN]
    if missing or unexpected:
        raise KeyError(f"checkpoint {ckpt.path} does not fit the drafter: missing {missing}, unexpected {unexpected}")
    if optimizer is not None:
        optimizer.load_state_dict(ckpt.optimizer_state)
    if scheduler is not None and ckpt.state.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt.state["scheduler"])


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Every complete training checkpoint under ``root`` as (step, folder), oldest step first."""
    found = []
    for state in Path(root).rglob(STATE):
        if is_training_checkpoint(state.parent):
            found.append((int(json.loads(state.read_text()).get("step", 0)), state.parent))
    return sorted(found, key=lambda x: (x[0], str(x[1])))


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete training checkpoint under ``root`` (a checkpoint itself, or a training output dir)."""
    root = Path(root)
    if is_training_checkpoint(root):
        return root
    best: tuple[int, float, Path] | None = None
    for state in root.rglob(STATE):
        d = state.parent
        if not is_training_checkpoint(d):
            continue
        step = int(json.loads(state.read_text()).get("step", 0))
        key = (step, state.stat().st_mtime, d)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]
