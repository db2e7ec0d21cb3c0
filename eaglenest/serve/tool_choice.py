"""``tool_choice: "required"`` and a named function: the answer must be tool calls, in the target's own syntax.

OpenAI's meaning: ``"required"`` makes the model call one or more of the offered tools; ``{"type": "function",
"function": {"name": N}}`` makes it call ``N``. A server of open models cannot ask the model nicely: the answer is
constrained (the machinery of structured output, :mod:`eaglenest.speculative.guide`) to a Lark grammar of the
target's own tool-call markers around bodies whose name is an offered function and whose arguments are valid under
that function's ``parameters`` schema, so the chat parser then reads them back as ``tool_calls`` like any call:

- Hermes / Qwen / the tiny target: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``, one or more;
- Kimi-K2/K2.5: ``<|tool_calls_section_begin|>`` then ``<|tool_call_begin|>functions.N:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>``, one or more, then ``<|tool_calls_section_end|>``.

``parallel_tool_calls: false`` (or a named function) allows exactly one call. With ``tool_choice: auto``, tools and a
``response_format``, the answer is either calls (as ``required``) or JSON under the format's schema: the model may
still call a tool first and answer in the format after (an Agents SDK agent with tools and an ``output_type``); a
forced call (``required`` / named) leaves no text for the format to shape, so the calls' grammar alone applies.
Bodies are written with the separators chat templates' ``tojson`` uses (``", "`` and ``": "``), the form the target
saw its calls in. The markers must be single tokens of the vocabulary (they are, for every known template); otherwise
the request is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from eaglenest.serve.chat_parsing import KIMI_ARGUMENT_MARKER, KIMI_TOOL_CALL
from eaglenest.serve.openai_protocol import APIError
from eaglenest.speculative.guide import grammar_error

KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
BODY_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""how a body's JSON is written: ``json.dumps``' (and Jinja's ``tojson``) separators, no other whitespace"""
ANSWER_FORMAT = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
"""how a ``response_format`` answer is written (compact, as :func:`eaglenest.speculative.guide.compile_schema`)"""


def forced_functions(tools: Sequence[Mapping[str, Any]] | None, choice: Any) -> list[str] | None:
    """The functions ``choice`` forces a call to (None: it forces none: ``auto`` / ``none`` / absent); a 400 naming
    ``tool_choice`` for a choice that cannot be honoured."""
    if choice in (None, "auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools or ()]
    if not names:
        raise APIError(400, "tool_choice requires tools: send the functions the model may call", param="tool_choice")
    if choice == "required":
        return names
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not among tools ({', '.join(names)})",
                           param="tool_choice.function.name")
        return [name]
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", param="tool_choice")


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], names: Sequence[str], *, markers: tuple[str, str],
                      vocab: Mapping[str, int], parallel: bool, answer: Mapping[str, Any] | None = None) -> str:
    """The Lark grammar of an answer that is only calls of ``names`` (one, or one or more when ``parallel``), or,
    with ``answer`` (a JSON Schema: ``response_format`` beside ``tool_choice: auto``), either such calls or JSON
    valid under ``answer`` (written compactly, as ``serve.structured`` writes it)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    param = "tool_choice" if answer is None else "response_format"

    def token(marker: str) -> str:
        if marker not in vocab:
            raise APIError(400, f"cannot constrain tool calls on this target: its tool-call marker {marker!r} is not "
                                f"one token of its vocabulary; send {param} without tools or tool_choice 'auto'",
                           param=param)
        return f"<[{vocab[marker]}]>"

    def json_rule(s: Mapping[str, Any], form: Mapping[str, Any] = BODY_FORMAT) -> str:
        return "%json " + json.dumps({**s, "x-guidance": form})

    repeat = "+" if parallel else ""
    if tuple(markers) == KIMI_TOOL_CALL:
        bodies = " | ".join(f'"functions.{n}:" INDEX {token(KIMI_ARGUMENT_MARKER)} {json_rule(params[n])}'
                            for n in names)
        rules = (f"calls: {token(KIMI_SECTION[0])} call{repeat} {token(KIMI_SECTION[1])}\n"
                 f"call: {token(markers[0])} ({bodies}) {token(markers[1])}\n"
                 "INDEX: /[0-9]+/\n")
    else:
        one_of = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                   "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        body = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
        rules = f"calls: call{repeat}\ncall: {token(markers[0])} {json_rule(body)} {token(markers[1])}\n"
    start = "start: calls\n" if answer is None else f"start: calls | {json_rule(answer, ANSWER_FORMAT)}\n"
    grammar = start + rules
    error = grammar_error(grammar)
    if error:  # the answer's schema was checked before: what fails here is a tool's parameters
        raise APIError(400, f"a function's parameters cannot constrain its calls: {error.splitlines()[0]}",
                       param="tools")
    return grammar
