"""The drafter store: every drafter the flywheel deploys is a copy under ``WORKDIR/drafters/`` that nothing rewrites.

Why copies: a swap and its rollback name folders, and a rollback must find the previous drafter exactly as it was
served, even when a training run later rewrites its ``OUT/export``. The folder name carries a digest of the weights
and configs (:func:`digest`), so the audit log says which bytes were gated and which were deployed.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

FILES = ("config.json", "eaglenest_drafter.json", "model.safetensors")


def digest(folder: str | Path) -> str:
    """sha256 (first 16 hex) over a drafter export's weights and configs."""
    h = hashlib.sha256()
    for name in FILES:
        p = Path(folder) / name
        if p.is_file():
            h.update(name.encode())
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def stage(workdir: str | Path, drafter: str | Path, label: str) -> Path:
    """Copy ``drafter`` to ``WORKDIR/drafters/<label>-<digest>`` (kept as is when that copy exists already)."""
    src = Path(drafter).resolve()
    dst = Path(workdir) / "drafters" / f"{label}-{digest(src)}"
    if not dst.is_dir():
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.replace(dst)
    return dst.resolve()


__all__ = ["digest", "stage"]
