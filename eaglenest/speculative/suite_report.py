"""The per-suite table of :func:`eaglenest.speculative.suite_eval.evaluate_suites`, as Markdown and as a PNG.

One line per suite (its overall accept length), then one per category and one per turn, each with the share of verify
steps that accepted at least 1, 2, ... draft tokens, so a drafter's weak domain shows next to its strong one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.plotting import pyplot, save_figure


def table_rows(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(suite, row label, row) for every line of the table: the suite, then its categories and turns."""
    rows = []
    for name, rep in doc["suites"].items():
        rows.append((name, "all", rep))
        many = len(rep["per_category"]) > 1
        rows += [(name, c, r) for c, r in rep["per_category"].items() if many]
        rows += [(name, t, r) for t, r in (rep.get("per_turn") or {}).items()]
    return rows


def suites_markdown(doc: dict[str, Any]) -> str:
    """The table as Markdown (printed by ``eaglenest eval --suite``, kept next to suites.json)."""
    depth = max((len(pp["depth"]) for rep in doc["suites"].values() if (pp := rep.get("per_position"))), default=0)
    head = ["suite", "category", "requests", "accept length"] + [f">= {d}" for d in range(1, depth + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for suite, label, r in table_rows(doc):
        pp = (r.get("per_position") or {}).get("accepted_at_least") or [float("nan")] * depth  # served: not reported
        acc = "n/a" if r["accept_length"] is None else f"{r['accept_length']:.3f}"  # every request of it failed
        cells = [suite, label, str(r["requests"]), acc] + [f"{a:.2f}" for a in pp]
        lines.append("| " + " | ".join(cells) + " |")
    failed = {n: f for n, rep in doc["suites"].items() if (f := rep.get("failed_requests"))}
    if failed:
        lines.append("")
        lines += [f"{n}: failed requests: " + "; ".join(f"{k} (x{c})" for k, c in f.items()) for n, f in failed.items()]
    skipped = {n: s for n, rep in doc["suites"].items() if (s := rep.get("skipped_too_long"))}
    if skipped:
        lines.append("")
        lines += [f"{n}: skipped (prompt + answer past the target's context): "
                  + ", ".join(f"{c} {k}" for c, k in s.items()) for n, s in skipped.items()]
    return "\n".join(lines) + "\n"


def write_suites(doc: dict[str, Any], out: str | Path) -> tuple[str, Path]:
    """``suites.json``, ``suites.md`` and ``suites.png`` of ``doc`` in folder ``out``; returns the Markdown table and
    the PNG's path."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suites.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = suites_markdown(doc)
    (out / "suites.md").write_text(table)
    return table, plot_suites(doc, out / "suites.png")


def plot_suites(doc: dict[str, Any], path: str | Path) -> Path:
    """PNG: accept length per suite and category (bars) and per-position acceptance per suite (curves)."""
    plt = pyplot()

    rows = [(s, label, r) for s, label, r in table_rows(doc) if not label.startswith("turn ")]
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 4 + 0.45 * len(rows)), 4.8),
                             gridspec_kw={"width_ratios": [max(2, len(rows) // 4), 1]})
    suites = list(doc["suites"])
    colors = {s: f"C{i}" for i, s in enumerate(suites)}
    xs = range(len(rows))
    from matplotlib.colors import to_rgba

    axes[0].bar(xs, [r["accept_length"] or 0.0 for _, _, r in rows],
                color=[to_rgba(colors[s], 1.0 if label == "all" else 0.5) for s, label, _ in rows])
    axes[0].set_xticks(list(xs), [f"{s}" if label == "all" else label for s, label, _ in rows], rotation=60,
                       ha="right", fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylabel("accept length (tokens / verify forward)")
    axes[0].set_title("accept length per suite (solid) and category")
    for s in suites:
        pp = doc["suites"][s].get("per_position")
        if not pp:  # a served endpoint reports accept lengths only
            continue
        axes[1].plot(pp["depth"], pp["accepted_at_least"], marker="o", color=colors[s], label=s)
        axes[1].set_xticks(pp["depth"])
    axes[1].set_ylim(0, 1.05)
    axes[1].set_xlabel("draft depth")
    axes[1].set_ylabel("verify steps accepting >= depth")
    axes[1].set_title("per-position acceptance")
    if axes[1].lines:
        axes[1].legend(fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "not reported by the served API", ha="center", va="center",
                     transform=axes[1].transAxes)
    return save_figure(fig, path)
