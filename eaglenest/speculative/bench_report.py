"""The bench's reports: the per-batch-size report dict, its verdict, its Markdown page and its PNG.

Kept apart from :mod:`eaglenest.speculative.bench` (which measures) so each module reads on its own.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.plotting import pyplot, save_figure

if TYPE_CHECKING:
    from eaglenest.speculative.bench import VariantStats


def build_report(variants: list[VariantStats], **meta: Any) -> dict[str, Any]:
    """One batch size's report: baseline, every config (speedup, accept length, greedy match), the best one."""
    base = variants[0]
    base_tps = base.median_tok_per_s()
    rows = []
    failed = [{"config": v.name, "drafter": v.drafter, "error": v.error} for v in variants[1:] if v.error]
    for v in variants[1:]:
        if v.error:
            continue
        tps = v.median_tok_per_s()
        ratios = [s / b for s, b in zip(v.tok_per_s(), base.tok_per_s(), strict=False) if b > 0]
        greedy_match, identical = None, None
        if meta["sampling"].greedy and not v.ceiling:
            pairs = [(x, y) for r, b in zip(v.rounds, base.rounds, strict=False)
                     for x, y in zip(r.tokens, b.tokens, strict=False)]
            identical = sum(x == y for x, y in pairs) / len(pairs) if pairs else None
            greedy_match = identical == 1.0
        draft_s = sum(r.draft_s for r in v.rounds)
        verify_s = sum(r.verify_s for r in v.rounds)
        rows.append({
            "config": v.name,
            "num_steps": v.spec.num_steps if v.spec else None, "topk": v.spec.topk if v.spec else None,
            "num_draft_tokens": v.spec.num_draft_tokens if v.spec else None,
            "tok_per_s": tps,
            "tok_per_s_rounds": v.tok_per_s(),
            "accept_length": v.accept_length(),
            "accept_length_per_prompt": v.accept_length_per_prompt(),
            "speedup": tps / base_tps if base_tps > 0 else 0.0,
            "speedup_median_of_round_ratios": statistics.median(ratios) if ratios else 0.0,
            "draft_share": draft_s / (draft_s + verify_s) if draft_s + verify_s > 0 else None,
            "outputs_match_baseline": greedy_match,
            "identical_outputs_fraction": identical,
            "ceiling": v.ceiling,
            "drafter": v.drafter,
            "plan": v.plan is not None,
        })
    real = [r for r in rows if not r["ceiling"] and not r["plan"]]  # the best *static* config
    best = max(real, key=lambda r: r["speedup"]) if real else None
    end = getattr(base, "rounds_end", None)
    sampling = meta.pop("sampling")
    return {
        **meta,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "baseline": {"tok_per_s": base_tps, "tok_per_s_rounds": base.tok_per_s(),
                     "completion_tokens": base.rounds[0].completion_tokens if base.rounds else 0,
                     **({"tok_per_s_end": statistics.median(
                         [r.completion_tokens / r.seconds for r in end if r.seconds > 0])} if end else {})},
        "configs": rows,
        "failed": failed,
        "best": best,
        "speculation_wins": bool(best and best["speedup"] > 1.0),
        "verdict": verdict(best),
    }


def verdict(best: dict[str, Any] | None) -> str:
    """One plain sentence: does speculation pay off, with which config."""
    if best is None:
        return "no speculative config was measured"
    if best["speedup"] > 1.0:
        return (f"speculation wins: best config {best['config']} runs {best['speedup']:.2f}x the baseline "
                f"({best['tok_per_s']:.1f} tok/s, accept length {best['accept_length']:.2f})")
    return (f"SPECULATION LOSES: even the best config {best['config']} runs at {best['speedup']:.2f}x the baseline "
            f"(accept length {best['accept_length']:.2f}); serve without speculation, or train the drafter on more "
            "target-regenerated data and re-run the benchmark")


def report_markdown(report: dict[str, Any], title: str = "Speculative decoding benchmark") -> str:
    """The report as a Markdown page (table per config, the best one, the verdict)."""
    lines = [f"# {title}", ""]
    kernel = f" ({report['linear_kernel']} linears)" if report.get("linear_kernel") else ""
    lines.append(f"Engine `{report['engine']}`{kernel}, {report['num_prompts']} prompts, "
                 f"batch size {report['batch_size']}, max_new_tokens {report['max_new_tokens']}, "
                 f"temperature {report['temperature']}, "
                 f"{report['repeats']} interleaved rounds (medians).")
    lines.append("")
    b = report["baseline"]
    lines.append(f"Baseline (same engine, no drafter): **{b['tok_per_s']:.1f} tok/s**.")
    if "tok_per_s_end" in b:
        lines.append(f"Baseline re-run after the sweep: {b['tok_per_s_end']:.1f} tok/s (drift check).")
    lines += ["", "| config (steps-topk-tokens) | tok/s | accept length | speedup | draft share | greedy == baseline |",
              "|---|---|---|---|---|---|"]
    for r in report["configs"]:
        share = "" if r["draft_share"] is None else f"{100 * r['draft_share']:.0f}%"
        match = {None: "n/a", True: "yes"}.get(r["outputs_match_baseline"],
                                              f"**{100 * (r['identical_outputs_fraction'] or 0):.0f}% of prompts**")
        mark = " **(best)**" if report["best"] and r["config"] == report["best"]["config"] else ""
        if r.get("ceiling"):
            match, mark = "n/a (every draft accepted)", " (bound)"
        elif r.get("plan"):
            mark = " (per batch size)"
        lines.append(f"| {r['config']}{mark} | {r['tok_per_s']:.1f} | {r['accept_length']:.2f} | "
                     f"{r['speedup']:.2f}x | {share} | {match} |")
    for f in report.get("failed") or []:
        lines.append(f"| {f['config']} | failed | | | | {f['error'][:200]} |")
    lines += ["", f"**Verdict:** {report['verdict']}", ""]
    return "\n".join(lines)


def plot_bench(report: dict[str, Any], path: str | Path) -> Path:
    """PNG: tok/s per config against the baseline line, and speedup vs accept length."""
    plt = pyplot()

    rows = report["configs"]
    if not rows:
        raise ValueError("nothing to plot: every speculative config failed (see the report's 'failed')")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["config"] for r in rows]
    colors = ["tab:green" if r["speedup"] > 1 else "tab:red" for r in rows]
    axes[0].bar(names, [r["tok_per_s"] for r in rows], color=colors)
    axes[0].axhline(report["baseline"]["tok_per_s"], color="black", ls="--", label="baseline")
    axes[0].set_ylabel("tokens / s")
    axes[0].set_xlabel("num_steps-topk-num_draft_tokens")
    axes[0].set_title(f"throughput ({report['engine']}, batch {report['batch_size']})")
    axes[0].legend()
    axes[1].scatter([r["accept_length"] for r in rows], [r["speedup"] for r in rows], c=colors)
    for r in rows:
        axes[1].annotate(r["config"], (r["accept_length"], r["speedup"]), fontsize=8)
    axes[1].axhline(1.0, color="black", ls="--")
    axes[1].set_xlabel("accept length")
    axes[1].set_ylabel("speedup vs baseline")
    axes[1].set_title("speedup vs accept length")
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------ several batch sizes at once
def sweep_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size: the baseline, the best static config and the schedule (a ``schedule`` plan variant), and
    their ratios; the worst ratios over the sweep (what "never slower, at any load" is judged by)."""
    rows = []
    for r in reports:
        base = r["baseline"]["tok_per_s"]
        best = r.get("best")
        sched = next((c for c in r["configs"] if c.get("plan") and c["config"] == "schedule"), None)
        row = {"batch_size": r["batch_size"], "baseline": base,
               "best_static": None if best is None else {"config": best["config"], "tok_per_s": best["tok_per_s"]},
               "best_static_vs_baseline": None if best is None or base <= 0 else best["tok_per_s"] / base,
               "schedule": None if sched is None else sched["tok_per_s"],
               "schedule_vs_baseline": None if sched is None or base <= 0 else sched["tok_per_s"] / base,
               "schedule_vs_best_static": (None if sched is None or best is None or best["tok_per_s"] <= 0
                                           else sched["tok_per_s"] / best["tok_per_s"])}
        rows.append(row)

    def worst(key: str) -> float | None:
        vals = [x[key] for x in rows if x[key] is not None]
        return min(vals) if vals else None

    return {"engine": reports[0]["engine"] if reports else None, "rows": rows,
            "worst_schedule_vs_baseline": worst("schedule_vs_baseline"),
            "worst_schedule_vs_best_static": worst("schedule_vs_best_static")}


def sweep_markdown(summary: dict[str, Any]) -> str:
    lines = ["# Baseline, best static config and schedule per batch size", "",
             "| batch | baseline tok/s | best static (tok/s, x baseline) | schedule tok/s | schedule x baseline | "
             "schedule x best static |", "|---|---|---|---|---|---|"]

    def f(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in summary["rows"]:
        b = r["best_static"]
        best = "" if b is None else f"{b['config']} ({b['tok_per_s']:.1f}, {r['best_static_vs_baseline']:.2f}x)"
        lines.append(f"| {r['batch_size']} | {r['baseline']:.1f} | {best} | {f(r['schedule'], '.1f')} | "
                     f"{f(r['schedule_vs_baseline'], '.3f')} | {f(r['schedule_vs_best_static'], '.3f')} |")
    if summary["worst_schedule_vs_baseline"] is not None:
        lines += ["", f"Worst over the sweep: schedule {summary['worst_schedule_vs_baseline']:.3f}x the baseline, "
                      f"{summary['worst_schedule_vs_best_static']:.3f}x the best static config."]
    return "\n".join(lines) + "\n"


def plot_sweep(summary: dict[str, Any], path: str | Path) -> Path:
    """PNG: tok/s of the baseline, the best static config and the schedule over the batch sizes, and the ratios."""
    plt = pyplot()

    rows = summary["rows"]
    xs = [r["batch_size"] for r in rows]
    fig, (ax, ar) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax.plot(xs, [r["baseline"] for r in rows], "k--", marker="o", label="baseline")
    best = [(r["batch_size"], r["best_static"]) for r in rows if r["best_static"]]
    ax.plot([x for x, _ in best], [b["tok_per_s"] for _, b in best], marker="s", label="best static config")
    for x, b in best:
        ax.annotate(b["config"], (x, b["tok_per_s"]), fontsize=7, xytext=(2, 4), textcoords="offset points")
    sched = [(r["batch_size"], r) for r in rows if r["schedule"] is not None]
    if sched:
        ax.plot([x for x, _ in sched], [r["schedule"] for _, r in sched], color="tab:green", lw=3, marker="o",
                label="schedule")
        ar.plot([x for x, _ in sched], [r["schedule_vs_baseline"] for _, r in sched], color="tab:green",
                marker="o", label="schedule / baseline")
        ar.plot([x for x, _ in sched], [r["schedule_vs_best_static"] for _, r in sched], color="tab:blue",
                marker="s", label="schedule / best static")
    ar.plot([x for x, _ in best], [r["best_static_vs_baseline"] for r in rows if r["best_static"]], color="grey",
            ls=":", label="best static / baseline")
    ar.axhline(1.0, color="black", ls="--")
    for a, ylabel in ((ax, "tokens / s"), (ar, "ratio")):
        a.set_xscale("log", base=2)
        a.set_xticks(xs, [str(x) for x in xs])
        a.set_xlabel("concurrent requests (batch size)")
        a.set_ylabel(ylabel)
        a.legend(fontsize=8)
    ax.set_title(f"throughput ({summary['engine']})")
    ar.set_title("against the baseline and the best static config")
    return save_figure(fig, path)


def write_sweep(reports: list[dict[str, Any]], out: Path | None) -> None:
    """Baseline, best static config and the schedule side by side over the batch sizes (printed; files in out)."""
    summary = sweep_summary(reports)
    print(sweep_markdown(summary))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "bench-sweep.md").write_text(sweep_markdown(summary))
        plot_sweep(summary, out / "bench-sweep.png")
        print(f"wrote {out / 'bench-sweep'}.json, .md, .png")
