"""Headless matplotlib for the PNGs eaglenest writes (bench, tune, eval, suites, training curves).

One place that picks the Agg backend before pyplot loads (servers and Ray workers have no display) and saves a figure
the same way everywhere; matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay ``fig`` out, write it as a PNG at ``path`` (parents created) and free it; returns the path."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
