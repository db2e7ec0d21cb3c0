"""A tuned schedule as a page and a picture: the table per bucket and the tok/s curves of every option.

The PNG has two panels over the measured batch sizes (log scale): tok/s of the baseline, of "off" and of every
shape, with the schedule's choice drawn over them; and each option's ratio to the baseline with the noise band, so
"never slower than the baseline beyond noise" can be read off the picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.plotting import pyplot, save_figure
from eaglenest.speculative.schedule import Schedule


def schedule_markdown(s: Schedule) -> str:
    """One row per bucket: what runs, how fast it measured, the noise, and the chain SGLang's adaptive mode uses."""
    lines = ["# Tuned schedule", "", f"Engine: `{s.identity.get('engine', {}).get('engine')}` "
             f"({s.identity.get('engine', {}).get('version')}, {s.identity.get('engine', {}).get('device')}); "
             f"drafter `{s.identity.get('drafter', {}).get('path')}`.", "",
             "| batch sizes | runs | tok/s | x baseline (worst temperature) | noise | SGLang adaptive candidates |",
             "|---|---|---|---|---|---|"]
    for b in s.buckets:
        if not b.measured:
            lines.append(f"| {b.label} | off (not measured) | | | | 0 |")
            continue
        tps = b.choice.tok_per_s or b.baseline_tok_per_s  # "off" unmeasured (a plain engine): the baseline
        unsafe = "" if b.safe else " **(even off loses)**"
        lines.append(f"| {b.label} | {b.choice.label}{unsafe} | {tps:.1f} | {b.choice.median_ratio:.3f} | "
                     f"{100 * b.noise:.1f}% | {', '.join(map(str, b.chain_steps))} |")
    if s.drift:
        w = s.drift["worst"]
        lines += ["", f"Drift check: the baseline re-measured at batch {w['batch_size']} moved "
                      f"{100 * w['relative']:+.1f}% (noise {100 * w['noise']:.1f}%): "
                      + ("within noise." if s.drift["all_within_noise"] else
                         "**beyond noise: the machine was not steady; re-run the tune on a quiet machine.**")]
    return "\n".join(lines) + "\n"


def plot_schedule(s: Schedule, path: str | Path) -> Path:
    """The PNG described in the module docstring."""
    plt = pyplot()

    measured = [b for b in s.buckets if b.measured]
    if not measured:
        raise ValueError("the schedule has no measured bucket to plot")
    xs = [b.max_batch for b in measured]
    labels: list[str] = []
    for b in measured:
        labels += [o.label for o in b.options if o.label not in labels]
    fig, (ax, ar) = plt.subplots(1, 2, figsize=(14, 5))
    ax.plot(xs, [b.baseline_tok_per_s for b in measured], "k--", lw=2, label="baseline (no drafter)")
    for label in labels:
        pts = [(b.max_batch, o) for b in measured for o in b.options if o.label == label]
        style = {"color": "grey", "ls": ":"} if label == "off" else {}
        ax.plot([x for x, _ in pts], [o.tok_per_s for _, o in pts], marker=".", alpha=0.6, label=label, **style)
        ar.plot([x for x, _ in pts], [o.median_ratio for _, o in pts], marker=".", alpha=0.6, label=label, **style)
    chosen = [b.choice.tok_per_s or b.baseline_tok_per_s for b in measured]
    ax.plot(xs, chosen, color="tab:green", lw=4, alpha=0.5, label="schedule")
    for x, y, b in zip(xs, chosen, measured, strict=True):
        ax.annotate(b.choice.label, (x, y), fontsize=8, xytext=(3, 6), textcoords="offset points")
    ar.plot(xs, [b.choice.median_ratio for b in measured], color="tab:green", lw=4, alpha=0.5, label="schedule")
    ar.fill_between(xs, [1 - b.noise for b in measured], [1 + b.noise for b in measured], color="black",
                    alpha=0.12, label="baseline +- noise")
    ar.axhline(1.0, color="black", ls="--")
    engine = s.identity.get("engine", {}).get("engine", "?")
    for a, title, ylabel in ((ax, f"throughput ({engine})", "tokens / s"),
                             (ar, "vs baseline (worst temperature)", "x baseline")):
        a.set_xscale("log", base=2)
        a.set_xticks(xs, [str(x) for x in xs])
        a.set_xlabel("concurrent requests (batch size)")
        a.set_ylabel(ylabel)
        a.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def summary_lines(s: Schedule) -> list[str]:
    """Short lines for the terminal: bucket -> choice."""
    out: list[str] = []
    for b in s.buckets:
        what: Any = b.choice.label if b.measured else "off (not measured)"
        out.append(f"  batch {b.label:>8}: {what}" + ("" if b.choice.off or not b.measured else
                                                      f" ({b.choice.median_ratio:.2f}x baseline)"))
    return out
