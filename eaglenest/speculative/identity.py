"""What a tuned schedule was measured on: target, drafter and engine, as fingerprints that serve can recompute.

A schedule's numbers belong to one target, one drafter and one engine on one kind of machine: a retrained drafter
accepts differently, another GPU or engine version moves the cost of a verify step. ``eaglenest tune`` records this
identity and serve compares it with its own before applying a schedule (a stale one is refused, naming the fix).

Folder fingerprints read ``config.json`` whole and, of every ``*.safetensors`` file, its size, its header and eight
64 KiB samples spread over the data: a retrained or different checkpoint changes them, a copied folder does not, and
a 1T-parameter target is fingerprinted in well under a second (reading the weights whole would take minutes).
"""

from __future__ import annotations

import hashlib
import json
import platform
import struct
from pathlib import Path
from typing import Any

SAMPLES = 8
SAMPLE_BYTES = 64 * 1024


def folder_fingerprint(folder: str | Path) -> str:
    """``sha256:<hex>`` of a model folder's config and sampled weights (see the module docstring)."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist")
    h = hashlib.sha256()
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(b"config.json\0" + cfg.read_bytes())
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{root} has no *.safetensors weights to fingerprint")
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(head + fh.read(min(n, size)))
            data_start = 8 + n
            span = max(size - data_start - SAMPLE_BYTES, 0)
            for k in range(SAMPLES):
                fh.seek(data_start + (span * k) // max(SAMPLES - 1, 1))
                h.update(fh.read(SAMPLE_BYTES))
    return "sha256:" + h.hexdigest()


def cpu_name() -> str:
    """The CPU model as Linux names it (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hf_engine_identity(cfg: Any) -> dict[str, Any]:
    """The transformers engine as serve runs it (``cfg``: the ``target`` section): versions, machine, threads
    (serve's rule: ``cpu_threads`` or 1) and the CPU linear kernel setting."""
    import torch
    import transformers

    device = "cpu" if cfg.device in ("auto", "cpu") and not torch.cuda.is_available() else cfg.device
    machine = cpu_name() if device == "cpu" else torch.cuda.get_device_name(0)
    return {"engine": "hf", "version": f"transformers-{transformers.__version__} torch-{torch.__version__}",
            "device": f"{device}: {machine}", "dtype": cfg.dtype,
            "threads": cfg.cpu_threads or 1, "cpu_kernels": cfg.cpu_kernels}


def sglang_engine_identity(cfg: Any) -> dict[str, Any]:
    """The SGLang engine (``cfg``: the ``target`` section): its version, the GPU, tensor parallelism, backends."""
    import torch

    from eaglenest.engines.sglang.symbols import installed_sglang_version

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    sg = cfg.sglang
    return {"engine": "sglang", "version": f"sglang-{installed_sglang_version()}", "device": f"cuda: {gpu}",
            "dtype": cfg.dtype, "tp_size": sg.tp_size, "attention_backend": sg.attention_backend,
            "extra_args": json.loads(json.dumps(sg.extra_args, sort_keys=True, default=str))}


def serving_identity(target_cfg: Any, drafter_folder: str | Path, *,
                     parts: tuple[str, ...] = ("target", "drafter", "engine")) -> dict[str, Any]:
    """The identity a schedule records (tune) and serve recomputes: ``target_cfg`` is the ``target`` section.

    A hub id that is not a local folder is identified by its name (pin a revision by downloading it). ``parts``:
    only these (a serve driver on a CPU head node cannot describe the GPU engine)."""
    from eaglenest.engines.location import local_target_folder, resolve_target_path

    out: dict[str, Any] = {}
    if "target" in parts:
        folder = local_target_folder(target_cfg)
        out["target"] = ({"path": str(folder), "fingerprint": folder_fingerprint(folder)} if folder is not None else
                         {"path": resolve_target_path(target_cfg),
                          "fingerprint": "hub:" + resolve_target_path(target_cfg)})
    if "drafter" in parts:
        out["drafter"] = {"path": str(drafter_folder), "fingerprint": folder_fingerprint(drafter_folder)}
    if "engine" in parts:
        out["engine"] = (hf_engine_identity(target_cfg) if target_cfg.engine == "hf"
                         else sglang_engine_identity(target_cfg))
    return out


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences that make a schedule stale (paths may differ: a copied folder is the same)."""
    out = []
    for part in ("target", "drafter"):
        if part not in recorded and part not in current:
            continue
        a, b = recorded.get(part, {}), current.get(part, {})
        if a.get("fingerprint") != b.get("fingerprint"):
            out.append(f"{part}: tuned on {a.get('path')} ({_short(a.get('fingerprint'))}), serving "
                       f"{b.get('path')} ({_short(b.get('fingerprint'))})")
    if "engine" not in recorded and "engine" not in current:
        return out
    ea, eb = recorded.get("engine", {}), current.get("engine", {})
    for key in sorted(set(ea) | set(eb)):
        if ea.get(key) != eb.get(key):
            out.append(f"engine {key}: tuned with {ea.get(key)!r}, serving with {eb.get(key)!r}")
    return out


def _short(fp: str | None) -> str:
    return (fp or "none").split(":")[-1][:12]

