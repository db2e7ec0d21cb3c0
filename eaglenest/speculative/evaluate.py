"""Acceptance evaluation: accept length of a drafter on held-out prompts, overall, per domain and per position.

Accept length = tokens emitted per target verify forward, bonus token included (SGLang's definition; 1.0 means
no draft token was ever accepted). Overall and per-domain values pool all verify steps:
``1 + accepted draft tokens / verify steps``. Per-position acceptance: at draft depth ``j``, the share of verify
steps that accepted at least ``j`` draft tokens, and the conditional rate given depth ``j - 1`` was accepted.

Prompt files are JSONL, one record per line: ``{"messages": [...], "tools": [...]?, "domain": "math"}``
(rendered with the target's chat template), ``{"prompt": "text", "domain": ...}`` (used raw) or
``{"input_ids": [...], "domain": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eaglenest.config import SpecConfig
from eaglenest.contracts.metrics import accept_length
from eaglenest.engines.base import SamplingParams
from eaglenest.plotting import pyplot, save_figure


class PromptFileError(ValueError):
    """A prompt file that cannot be used."""


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL prompt file; every record needs ``messages``, ``prompt`` or ``input_ids``.

    ``limit`` keeps that many records spread evenly over the file (files are often grouped by domain).
    """
    p = Path(path)
    if not p.is_file():
        raise PromptFileError(f"prompt file {p} does not exist (JSONL with 'messages' and 'domain' per line)")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or not any(k in rec for k in ("messages", "prompt", "input_ids")):
            raise PromptFileError(f"{p}:{n}: each line needs 'messages', 'prompt' or 'input_ids'")
        out.append(rec)
    if not out:
        raise PromptFileError(f"prompt file {p} holds no prompts")
    if limit is not None and limit < len(out):
        out = [out[(i * len(out)) // limit] for i in range(limit)]
    return out


def prompt_ids(tokenizer: Any, rec: dict[str, Any] | Sequence[int]) -> list[int]:
    """Token ids of one prompt record (chat messages get the assistant generation prompt)."""
    from eaglenest.engines.base import render_chat_ids

    if not isinstance(rec, dict):
        return [int(t) for t in rec]
    if "input_ids" in rec:
        return [int(t) for t in rec["input_ids"]]
    if "messages" in rec:
        return render_chat_ids(tokenizer, rec["messages"], tools=rec.get("tools"), add_generation_prompt=True)
    return list(tokenizer.encode(rec["prompt"], add_special_tokens=False))


def summarize(results: Sequence[Any], domains: Sequence[str], max_depth: int) -> dict[str, Any]:
    """Pool per-request :class:`~eaglenest.speculative.decoder.SpecResult` statistics into the evaluation report."""

    def pooled(rs: Sequence[Any]) -> dict[str, Any]:
        steps = sum(r.draft_steps for r in rs)
        acc = sum(sum(r.accepted_per_step) for r in rs)
        return {
            "accept_length": accept_length(steps, acc),
            "requests": len(rs),
            "verify_steps": steps,
            "accepted_tokens": acc,
            "completion_tokens": sum(len(r.token_ids) for r in rs),
        }

    every = [a for r in results for a in r.accepted_per_step]
    reached = [sum(1 for a in every if a >= j) for j in range(max_depth + 1)]
    at_least = [reached[j] / len(every) if every else 0.0 for j in range(1, max_depth + 1)]
    conditional = [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, max_depth + 1)]
    per_domain = {}
    for d in sorted(set(domains)):
        per_domain[d] = pooled([r for r, dd in zip(results, domains, strict=True) if dd == d])
    draft_s = sum(r.draft_time_s for r in results)
    verify_s = sum(r.verify_time_s for r in results)
    return {
        **pooled(results),
        "accept_length_per_request_mean": (sum(r.accept_length for r in results) / len(results)) if results else 0.0,
        "per_domain": per_domain,
        "per_position": {"depth": list(range(1, max_depth + 1)), "accepted_at_least": at_least,
                         "conditional": conditional},
        "draft_time_s": draft_s,
        "verify_time_s": verify_s,
    }


def evaluate_acceptance(
    target: Any,
    drafter: Any,
    prompts: Sequence[dict[str, Any] | Sequence[int]],
    spec: SpecConfig | None = None,
    *,
    sampling: SamplingParams | None = None,
    mode: str | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Accept length of ``drafter`` on ``target`` (an ``HFEngine`` or a ``(model, tokenizer)`` pair).

    ``drafter``: an ``Eagle3Drafter``, a ``DraftModel`` or an export folder. ``mode``: ``eagle3`` (default),
    ``off_by_one`` or ``eagle`` (what feeds the drafter; see :mod:`speculative.draft`). Returns the summary dict
    of :func:`summarize` plus the spec, mode and sampling used.
    """
    from eaglenest.speculative.decoder import SpecDecoder

    spec = spec or SpecConfig()
    sampling = sampling or SamplingParams(temperature=0.0, max_new_tokens=64)
    if isinstance(drafter, (str, Path)):
        from eaglenest.drafters.eagle3.model import load_drafter

        drafter = load_drafter(drafter)
    if isinstance(target, tuple):
        model, tokenizer = target
        dec = SpecDecoder(model, tokenizer, drafter, spec, mode=mode)  # type: ignore[arg-type]
    else:
        tokenizer = target.tokenizer
        dec = SpecDecoder.from_engine(target, drafter, spec, mode=mode)
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    domains = [str(p.get("domain", "all")) if isinstance(p, dict) else "all" for p in prompts]
    results = []
    chunks = range(0, len(ids), batch_size)
    if progress:
        from tqdm import tqdm

        chunks = tqdm(chunks, desc=f"eval {dec.mode}", unit="batch")
    for i in chunks:
        results += dec.generate(ids[i:i + batch_size], sampling)
    report = summarize(results, domains, spec.num_steps)
    report.update({
        "mode": dec.mode,
        "spec": spec.model_dump(),
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                     "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed},
    })
    return report


def plot_acceptance(reports: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """PNG: accept length per domain (one bar group per mode) and per-position acceptance curves."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = list(reports)
    domains = sorted({d for r in reports.values() for d in r["per_domain"]}) + ["overall"]
    width = 0.8 / max(1, len(modes))
    for k, m in enumerate(modes):
        r = reports[m]
        vals = [r["per_domain"].get(d, {}).get("accept_length", 0.0) for d in domains[:-1]] + [r["accept_length"]]
        xs = [i + k * width for i in range(len(domains))]
        color = f"C{k}"
        axes[0].bar(xs, vals, width=width, label=m, color=color)
        pp = r["per_position"]
        axes[1].plot(pp["depth"], pp["accepted_at_least"], marker="o", color=color, label=f"{m}: accepted >= depth")
        axes[1].plot(pp["depth"], pp["conditional"], marker="x", ls="--", color=color, label=f"{m}: conditional")
        axes[1].set_xticks(pp["depth"])
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(domains))], domains, rotation=20)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylabel("accept length (tokens / verify forward)")
    axes[0].set_title("accept length per domain")
    axes[0].legend()
    axes[1].set_xlabel("draft depth")
    axes[1].set_ylabel("acceptance")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("per-position acceptance")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path)
