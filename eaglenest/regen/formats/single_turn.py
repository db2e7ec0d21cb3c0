"""Single-exchange formats: instruction tuning (Alpaca), math problem/solution, xLAM tool calling."""

from __future__ import annotations

from eaglenest.regen.formats.fields import _field, _maybe_json, _msg, _text, _tool_call, _tools, split_reasoning
from eaglenest.regen.formats.reasons import WRONG_TYPE, BadRow
from eaglenest.regen.formats.schema import Conversation


def adapt_alpaca(row: dict) -> Conversation:
    """Instruction tuning ``instruction`` (+ ``input``) -> ``output`` / ``response`` (CodeAlpaca, Magicoder)."""
    instruction = _text(_field(row, "instruction"), "instruction")
    extra = row.get("input")
    if extra is not None and _text(extra, "input", allow_empty=True).strip():
        instruction = f"{instruction}\n\n{extra}"
    output = _text(_field(row, "output", "response"), "output", allow_empty=True)
    reasoning, answer = split_reasoning(output)
    return Conversation([_msg("user", instruction), _msg("assistant", answer, reasoning)])


def adapt_problem_solution(row: dict) -> Conversation:
    """Math ``problem`` -> ``solution`` (NuminaMath); ``question``/``answer`` (GSM8K-style) also accepted."""
    problem = _text(_field(row, "problem", "question"), "problem")
    solution = _text(_field(row, "solution", "answer"), "solution", allow_empty=True)
    reasoning, answer = split_reasoning(solution)
    return Conversation([_msg("user", problem), _msg("assistant", answer, reasoning)])


def adapt_tool_use(row: dict) -> Conversation:
    """xLAM function calling: ``query``, ``tools`` (JSON text), ``answers`` (JSON text: the calls)."""
    query = _text(_field(row, "query"), "query")
    tools = _tools(_field(row, "tools"), "tools")
    if not tools:
        raise BadRow(WRONG_TYPE, "tools is empty: a tool-use sample needs at least one tool")
    answers = _maybe_json(_field(row, "answers"), "answers")
    if not isinstance(answers, list):
        raise BadRow(WRONG_TYPE, f"answers must be a list of calls, got {type(answers).__name__}")
    calls = [_tool_call(a, f"answers[{k}]") for k, a in enumerate(answers)]
    return Conversation([_msg("user", query), _msg("assistant", "", None, calls)], tools)
