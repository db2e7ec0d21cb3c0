"""Sizing a regen + training run before it starts: samples, tokens, storage per mode, engine and training hours.

Why: at Kimi-K2.5 size the data does not fit the way it is stored by default (~10 TB of hidden states for ~88K
samples), and the first run had to estimate its 24-55 engine hours by hand. This does the same arithmetic from the
config and from throughputs measured by eaglenest (BENCHMARKS.md, ``eaglenest bench`` / regen's
``ray_eaglenest_regen_tokens_per_second``, the trainer's tok/s log), so a run is sized before GPUs are reserved.

Storage modes (hidden-state bytes per token, H = the target's hidden size, as ``contracts.shards`` stores them; the
token ids and the loss mask add 5 bytes per token in every mode):
- ``bfloat16``: the three aux layers and the final normed state, 2 bytes each: 8·H;
- ``float8_e4m3fn``: 1 byte each plus one int8 power-of-two exponent per token and state: 4·H + 4;
- ``online`` (``eaglenest train --online``): hidden states stream from the engines to the trainer and are never
  written: 0. The first epoch is a regen pass; the answers are cached (ids and masks only), so every later epoch is
  a capture pass: ``capture_share`` of a regen pass's engine time (regen records its generate and capture seconds:
  a manifest's ``last_run.engine_seconds``). Without a measured share the plan assumes the H200 run's
  (``DEFAULT_CAPTURE_SHARE``) and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IDS_AND_MASK_BYTES = 5
"""int32 token id + one byte of loss mask per token"""
STORAGE_MODES = ("bfloat16", "float8_e4m3fn", "online")
DEFAULT_CAPTURE_SHARE = 0.55
"""capture seconds / (generate + capture seconds) of a regen pass, as measured on the H200 with SGLang (BENCHMARKS.md
"GPU end to end", second run: capture 43.1 s, generate 34.9 s); the plan's assumption when none is given"""


def hidden_bytes_per_token(hidden_size: int, mode: str) -> int:
    """Hidden-state bytes stored per token in ``mode`` (the shard contract's own figure; 0 online)."""
    from eaglenest.contracts.shards import hidden_bytes_per_token as stored

    if mode == "online":
        return 0
    if mode not in STORAGE_MODES:
        raise ValueError(f"unknown storage mode {mode!r}; allowed: {', '.join(STORAGE_MODES)}")
    return stored(hidden_size, mode)


@dataclass
class SourceCount:
    """How many samples one source contributes, and whether that was counted from a file or taken from its cap."""

    name: str
    samples: int | None
    how: str


@dataclass
class SizingInputs:
    """Everything the plan's arithmetic uses (the CLI fills it from a config and flags)."""

    hidden_size: int
    sources: list[SourceCount]
    prompt_tokens: float
    """average prompt tokens per sample (everything before the regenerated answers)"""
    answer_tokens: float
    """average generated tokens per sample (regenerated answers)"""
    engine_tokens_per_s: float | None = None
    """generated tokens per second of ONE engine (regen's steady state, or `eaglenest bench`'s baseline at batch)"""
    num_engines: int = 1
    gpus_per_engine: int = 1
    train_tokens_per_s: float | None = None
    """training tokens per second of ONE worker (the trainer's log line, or benchmarks/train_step.py)"""
    num_workers: int = 1
    epochs: int = 1
    capture_share: float | None = None
    """capture seconds / (generate + capture seconds) of a regen pass (a regen manifest's ``last_run.engine_seconds``):
    what an online epoch after the first costs, as a share of a regen pass; None = ``DEFAULT_CAPTURE_SHARE``"""
    notes: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(s.samples or 0 for s in self.sources)


def plan(inp: SizingInputs) -> dict[str, Any]:
    """The plan as numbers (bytes, seconds, hours); :func:`format_plan` prints it."""
    samples = inp.samples
    tokens = samples * (inp.prompt_tokens + inp.answer_tokens)
    generated = samples * inp.answer_tokens
    share = DEFAULT_CAPTURE_SHARE if inp.capture_share is None else inp.capture_share
    storage = {mode: tokens * (hidden_bytes_per_token(inp.hidden_size, mode) + IDS_AND_MASK_BYTES)
               for mode in STORAGE_MODES}
    out: dict[str, Any] = {"samples": samples, "tokens": tokens, "generated_tokens": generated,
                           "bytes_per_token": {m: hidden_bytes_per_token(inp.hidden_size, m) + IDS_AND_MASK_BYTES
                                               for m in STORAGE_MODES},
                           "storage_bytes": storage, "engine_hours": None, "engine_gpu_hours": None,
                           "online_engine_hours": None, "capture_share": share,
                           "capture_share_assumed": inp.capture_share is None,
                           "training_hours": None, "training_gpu_hours": None}
    if inp.engine_tokens_per_s:
        wall = generated / (inp.engine_tokens_per_s * inp.num_engines) / 3600
        out["engine_hours"] = wall
        out["engine_gpu_hours"] = wall * inp.num_engines * inp.gpus_per_engine
        # online: epoch 1 regenerates (a regen pass), every later epoch captures the cached answers only
        out["online_engine_hours"] = wall * (1 + (inp.epochs - 1) * share)
    if inp.train_tokens_per_s:
        wall = tokens * inp.epochs / (inp.train_tokens_per_s * inp.num_workers) / 3600
        out["training_hours"] = wall
        out["training_gpu_hours"] = wall * inp.num_workers
    return out


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _hours(h: float | None, hint: str) -> str:
    return f"{h:,.1f} h" if h is not None else f"? ({hint})"


def format_plan(inp: SizingInputs, p: dict[str, Any]) -> str:
    """The table an operator reads before reserving GPUs."""
    lines = ["source                      samples  from", "-" * 60]
    for s in inp.sources:
        lines.append(f"{s.name:<26}{'?' if s.samples is None else f'{s.samples:,}':>9}  {s.how}")
    lines += [f"{'total':<26}{p['samples']:>9,}", "",
              f"tokens: {p['tokens']:,.0f} ({inp.prompt_tokens:,.0f} prompt + {inp.answer_tokens:,.0f} generated "
              f"per sample on average); generated: {p['generated_tokens']:,.0f}", "",
              f"storage (H = {inp.hidden_size})        bytes/token   total"]
    for m in STORAGE_MODES:
        lines.append(f"  {m:<26}{p['bytes_per_token'][m]:>11,}   {_size(p['storage_bytes'][m])}")
    eng = inp.engine_tokens_per_s
    lines += ["",
              f"regen: {_hours(p['engine_hours'], 'give --engine-tokens-per-s')} wall on {inp.num_engines} engine(s)"
              + (f" at {eng:,.0f} generated tok/s each = {p['engine_gpu_hours']:,.0f} GPU hours "
                 f"({inp.gpus_per_engine} GPU(s) per engine)" if eng else ""),
              f"training: {_hours(p['training_hours'], 'give --train-tokens-per-s')} wall on {inp.num_workers} "
              f"worker(s), {inp.epochs} epoch(s)"
              + (f" at {inp.train_tokens_per_s:,.0f} tok/s each = {p['training_gpu_hours']:,.0f} GPU hours"
                 if inp.train_tokens_per_s else ""),
              f"online (train --online): epoch 1 is a regen pass, later epochs capture the cached answers only "
              f"({p['capture_share']:.2f} of a pass each): "
              f"{_hours(p['online_engine_hours'], 'give --engine-tokens-per-s')} of engine wall for {inp.epochs} "
              "epoch(s), running beside training (the slower side sets the pace), 0 bytes of hidden states"]
    notes = list(inp.notes)
    if p["capture_share_assumed"] and inp.epochs > 1:
        notes.append(f"capture share of a regen pass assumed {DEFAULT_CAPTURE_SHARE} (H200 + SGLang, BENCHMARKS.md: "
                     "capture 43.1 s of 78.0 engine seconds): pass --capture-share, capture / (generate + capture) of "
                     "a small regen's manifest.json last_run.engine_seconds")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def count_source(name: str, path: str | None, max_samples: int | None) -> SourceCount:
    """Rows a source will give: counted from a local file (capped), else its cap (hub datasets are not fetched)."""
    if path is None or not Path(path).is_file():
        how = "max_samples (hub source: not counted)" if path is None else f"max_samples ({path} not found)"
        return SourceCount(name, max_samples, how)
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(p).metadata.num_rows
    elif p.suffix == ".jsonl":
        with p.open("rb") as fh:
            rows = sum(1 for line in fh if line.strip())
    else:
        return SourceCount(name, max_samples, f"max_samples ({p.suffix} files are not counted)")
    n = rows if max_samples is None else min(rows, max_samples)
    return SourceCount(name, n, f"{rows:,} rows in {p.name}" + (f", capped at {max_samples:,}" if n < rows else ""))
