"""Where a configured target's files are: ``tiny`` is the embedded tiny target (built and cached on first use),
anything else a folder or a hub id. Lives with the engines because resolving ``tiny`` builds a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.config import TargetConfig
from eaglenest.contracts.target import CONFIG


def resolve_target_path(cfg: TargetConfig) -> str:
    """The folder (or hub id) of ``cfg.model``; ``tiny`` builds the tiny target once and returns its cache folder."""
    if cfg.model == "tiny":
        from eaglenest.engines.tiny import ensure_tiny_target

        return str(ensure_tiny_target(cfg.tiny, cfg.cache_dir))
    return cfg.model


def local_target_folder(cfg: Any) -> Path | None:
    """The target's local folder (``tiny`` is built/cached on first use), or None for a hub id.

    ``cfg``: a TargetConfig, or the root config (its ``target`` section)."""
    p = Path(resolve_target_path(getattr(cfg, "target", cfg))).expanduser()
    return p if (p / CONFIG).is_file() else None
