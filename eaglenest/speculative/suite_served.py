"""Accept length on the field's prompt suites through a served endpoint (``eaglenest serve``'s OpenAI API).

The same table as :func:`eaglenest.speculative.suite_eval.evaluate_suites` (per suite, category and turn), measured
where it matters: the deployed engine (SGLang on a GPU) with its drafter, each request's ``usage.spec`` giving its
accept length. MT-Bench's later turns follow the served answers, which are the target's own (speculative decoding is
lossless). The API reports no per-position acceptance, so the rows carry none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from eaglenest.contracts.metrics import accept_length
from eaglenest.speculative.suite_eval import Messages, Record, breakdown, run_turns


@dataclass(frozen=True)
class ServedAnswer:
    """One served reply: its text (the next turn's context) and its speculative counts."""

    text: str
    completion_tokens: int
    verify_steps: int


Ask = Callable[[Messages, Record], ServedAnswer]
"""(conversation, its suite record) -> the served reply"""


def openai_ask(client: Any, *, model: str = "eaglenest", max_tokens: int = 128, temperature: float = 0.0) -> Ask:
    """An :data:`Ask` over the official ``openai`` client: chat completions with the record's tools, verify steps
    from ``usage.spec.accept_length`` (completion tokens per verify forward)."""

    def ask(messages: Messages, record: Record) -> ServedAnswer:
        kw: dict[str, Any] = {"tools": record["tools"]} if record.get("tools") else {}
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=temperature, **kw)
        usage = reply.usage.model_dump()
        spec = usage.get("spec") or {}
        tokens = int(usage["completion_tokens"])
        acc = float(spec.get("accept_length") or 0.0)
        if acc <= 0:
            raise ValueError("the reply carries no usage.spec accept length: the endpoint does not speculate "
                             "(serve it with a drafter) or is not eaglenest serve")
        return ServedAnswer(reply.choices[0].message.content or "", tokens, max(1, round(tokens / acc)))

    return ask


def _row(answers: Sequence[ServedAnswer]) -> dict[str, Any]:
    tokens = sum(a.completion_tokens for a in answers)
    steps = sum(a.verify_steps for a in answers)
    return {"accept_length": accept_length(steps, tokens - steps) if answers else None,  # None: nothing answered
            "requests": len(answers), "verify_steps": steps,
            "accepted_tokens": tokens - steps, "completion_tokens": tokens, "per_position": None}


def evaluate_suite_served(ask: Ask, records: Sequence[Record], *, concurrency: int = 8) -> dict[str, Any]:
    """One suite's report through ``ask``: every turn of a round asked ``concurrency`` at a time."""
    errors: Counter[str] = Counter()

    def answer(convs: list[Messages], recs: list[Record], turn: int) -> list[Any]:
        def one(pair: tuple[Messages, Record]) -> ServedAnswer | None:
            try:
                return ask(*pair)
            except Exception as e:  # noqa: BLE001 - counted per category: one refused prompt must not end the table
                errors[f"{pair[1]['domain']}: {type(e).__name__}: {e}"[:300]] += 1
                return None

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            return list(pool.map(one, zip(convs, recs, strict=True)))

    asked = [(r, t, a) for r, t, a in run_turns(records, answer) if a is not None]
    # a category whose every request failed shows in the failures only
    report = breakdown(asked, records, _row, empty_categories=False)
    report["failed_requests"] = dict(errors)
    return report


def evaluate_suites_served(ask: Ask, suites: dict[str, tuple[list[Record], dict[str, Any]]], *,
                           concurrency: int = 8, endpoint: str | None = None) -> dict[str, Any]:
    """The per-suite table through a served endpoint: ``{"suites": {name: report + source}, "served": ...}``."""
    doc: dict[str, Any] = {"served": {"endpoint": endpoint, "concurrency": concurrency}, "suites": {}}
    for name, (records, source) in suites.items():
        doc["suites"][name] = {**evaluate_suite_served(ask, records, concurrency=concurrency), "source": source,
                               "prompts": len(records)}
    return doc
