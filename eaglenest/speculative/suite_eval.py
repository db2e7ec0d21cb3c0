"""Accept length on the field's prompt suites (:mod:`eaglenest.speculative.suites`): per suite, per category, per turn,
each with its per-position acceptance.

Multi-turn suites (MT-Bench) are asked in order: every conversation's first turn for the whole suite, then the second
turn after the target's own answer to the first, and so on. The answers come from the speculative decoder, whose
output is the target's own (greedy: token for token; sampled: the target's distribution), so no second pass of the
target is needed. A prompt that, with its answer and draft, would not fit the target's context is skipped and counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from eaglenest.config import SpecConfig
from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.evaluate import prompt_ids, summarize

Record = dict[str, Any]
Messages = list[dict[str, Any]]


def _row(results: Sequence[Any], depth: int) -> dict[str, Any]:
    """One line of the table: pooled accept length and per-position acceptance over ``results``."""
    s = summarize(results, ["all"] * len(results), depth)
    keys = ("accept_length", "requests", "verify_steps", "accepted_tokens", "completion_tokens", "per_position")
    return {k: s[k] for k in keys}


Answer = Callable[[list[Messages], list[Record], int], list[Any]]


def run_turns(records: Sequence[Record], answer: Answer, *,
              fits: Callable[[Messages, Record], bool] = lambda m, r: True) -> list[tuple[Record, int, Any]]:
    """Ask every record's turns in order: turn 1 of all records, then each follow-up after the previous answer.

    ``answer(conversations, records, turn)`` returns one result per conversation (with ``.text``); ``fits`` says
    whether a conversation may be asked. Returns (record, turn, result) per asked turn; a turn that does not fit, or
    whose answer is None (failed), is returned with result None and ends its conversation."""
    out: list[tuple[Record, int, Any]] = []
    active = [(r, list(r["messages"])) for r in records]
    turn = 1
    while active:
        ok = [fits(m, r) for r, m in active]
        asked = [a for a, f in zip(active, ok, strict=True) if f]
        out += [(r, turn, None) for (r, _), f in zip(active, ok, strict=True) if not f]
        results = answer([m for _, m in asked], [r for r, _ in asked], turn) if asked else []
        nxt = []
        for (r, m), res in zip(asked, results, strict=True):
            out.append((r, turn, res))
            if res is None:  # the answer failed (``answer`` may return None): its conversation ends there
                continue
            follow = r.get("followups") or []
            if turn - 1 < len(follow):
                nxt.append((r, m + [{"role": "assistant", "content": res.text},
                                    {"role": "user", "content": str(follow[turn - 1])}]))
        active, turn = nxt, turn + 1
    return out


def breakdown(done: Sequence[tuple[Record, int, Any]], records: Sequence[Record],
              row: Callable[[list[Any]], dict[str, Any]], *, empty_categories: bool = True) -> dict[str, Any]:
    """One suite's report from its answered turns ``done`` ((record, turn, result)): ``row`` of all of them, then
    per category (in the records' order; ``empty_categories=False`` leaves out a category nothing was answered in)
    and, for multi-turn suites, per turn. Shared by the reference decoder's table and the served one."""
    report = row([res for _, _, res in done])
    per_category = {c: [res for r, _, res in done if r["domain"] == c]
                    for c in dict.fromkeys(r["domain"] for r in records)}
    report["per_category"] = {c: row(got) for c, got in per_category.items() if got or empty_categories}
    turns = sorted({t for _, t, _ in done})
    if len(turns) > 1:
        report["per_turn"] = {f"turn {t}": row([res for _, tt, res in done if tt == t]) for t in turns}
    return report


def evaluate_suite(engine: Any, drafter: Any, records: Sequence[Record], spec: SpecConfig, *,
                   sampling: SamplingParams, mode: str | None = None, batch_size: int = 1,
                   progress: bool = False) -> dict[str, Any]:
    """Accept length of ``drafter`` on one suite's records with the reference decoder on an ``HFEngine``."""
    from eaglenest.speculative.decoder import SpecDecoder

    dec = SpecDecoder.from_engine(engine, drafter, spec, mode=mode)
    tok = engine.tokenizer
    room = engine.info.max_position_embeddings - sampling.max_new_tokens - spec.num_draft_tokens

    def ids_of(m: Messages, r: Record) -> list[int]:
        return prompt_ids(tok, {"messages": m, "tools": r.get("tools")})

    def answer(convs: list[Messages], recs: list[Record], turn: int) -> list[Any]:
        ids = [ids_of(m, r) for m, r in zip(convs, recs, strict=True)]
        chunks = range(0, len(ids), batch_size)
        if progress:
            from tqdm import tqdm

            chunks = tqdm(chunks, desc=f"{recs[0].get('suite', 'suite')} turn {turn}", unit="batch")
        results: list[Any] = []
        for i in chunks:
            results += dec.generate(ids[i:i + batch_size], sampling)
        return results

    asked = run_turns(records, answer, fits=lambda m, r: len(ids_of(m, r)) <= room)
    done = [(r, t, res) for r, t, res in asked if res is not None]
    report = breakdown(done, records, lambda results: _row(results, spec.num_steps))
    skipped = Counter(r["domain"] for r, _, res in asked if res is None)
    report["skipped_too_long"] = dict(skipped)
    report["mode"] = dec.mode
    return report


def evaluate_suites(engine: Any, drafter: Any, suites: dict[str, tuple[list[Record], dict[str, Any]]],
                    spec: SpecConfig, *, sampling: SamplingParams, mode: str | None = None, batch_size: int = 1,
                    progress: bool = False) -> dict[str, Any]:
    """The per-suite table: ``{"suites": {name: report + source}, "spec": ..., "sampling": ...}``."""
    doc: dict[str, Any] = {"spec": spec.model_dump(), "sampling": {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens,
        "seed": sampling.seed}, "suites": {}}
    for name, (records, source) in suites.items():
        report = evaluate_suite(engine, drafter, records, spec, sampling=sampling, mode=mode,
                                batch_size=batch_size, progress=progress)
        doc["suites"][name] = {**report, "source": source, "prompts": len(records)}
    return doc


def conversation_prompts(records: Sequence[Record], generate: Callable[[list[list[int]]], list[str]] | None,
                         ids_of: Callable[[Messages, Record], list[int]]) -> list[list[int]]:
    """Every turn of ``records`` as a token-id prompt (the bench's prompt list): turn k follows the target's own
    answers to turns 1..k-1, which ``generate`` (token-id prompts -> texts) produces; without it, first turns only."""
    if generate is None:
        return [ids_of(list(r["messages"]), r) for r in records]

    class _Answer:
        def __init__(self, text: str) -> None:
            self.text = text

    prompts: list[list[int]] = []

    def answer(convs: list[Messages], recs: list[Record], turn: int) -> list[Any]:
        ids = [ids_of(m, r) for m, r in zip(convs, recs, strict=True)]
        prompts.extend(ids)
        more = [i for i, r in enumerate(recs) if turn - 1 < len(r.get("followups") or [])]
        texts = dict(zip(more, generate([ids[i] for i in more]), strict=True)) if more else {}
        return [_Answer(texts.get(i, "")) for i in range(len(ids))]

    run_turns(records, answer)
    return prompts
