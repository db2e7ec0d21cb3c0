"""PNG of the training curves: per-step loss_k and acc_k, training (thin) and held-out (markers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.plotting import pyplot, save_figure


def plot_training_curves(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Two panels (loss_k, acc_k) over training steps; returns None when there is nothing to plot."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        return None
    plt = pyplot()

    first = (train or evals)[0]
    steps_k = sorted(int(k.split("_")[1]) for k in first if k.startswith("acc_"))
    cmap = plt.get_cmap("viridis", max(2, len(steps_k)))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for k in steps_k:
        color = cmap(k)
        for ax, key in ((axes[0], "loss"), (axes[1], "acc")):
            if train:
                ax.plot([r["step"] for r in train], [r[f"{key}_{k}"] for r in train], color=color, lw=0.8,
                        alpha=0.6, label=f"train {key}_{k}")
            if evals:
                ax.plot([r["step"] for r in evals], [r[f"{key}_{k}"] for r in evals], color=color, marker="o",
                        ms=3, lw=1.5, label=f"held-out {key}_{k}")
    if evals:
        axes[2].plot([r["step"] for r in evals], [r["sim_accept_length"] for r in evals], marker="o", label="held-out")
    if train:
        axes[2].plot([r["step"] for r in train], [r["sim_accept_length"] for r in train], lw=0.8, alpha=0.6,
                     label="train")
    axes[0].set_title("TTT loss per step k (soft cross-entropy)")
    axes[1].set_title("top-1 agreement acc_k with the target")
    axes[2].set_title("simulated accept length 1 + Σ_k Π_{j≤k} acc_j")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].legend(fontsize=6, ncol=2)
    axes[2].legend(fontsize=8)
    return save_figure(fig, path)
