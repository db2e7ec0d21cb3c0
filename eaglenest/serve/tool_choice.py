"""``tool_choice: "required"`` and a named function: the answer must be tool calls, in the target's own syntax.

OpenAI's meaning: ``"required"`` makes the model call one or more of the offered tools; ``{"type": "function",
"function": {"name": N}}`` makes it call ``N``. A server of open models cannot ask the model nicely: the answer is
constrained (the machinery of structured output, :mod:`eaglenest.speculative.guide`) to a Lark grammar of the
target's own tool-call markers around bodies whose name is an offered function and whose arguments are valid under
that function's ``parameters`` schema, so the chat parser then reads them back as ``tool_calls`` like any call:

- Hermes / Qwen / the tiny target: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``, one or more;
- Kimi-K2/K2.5: ``<|tool_calls_section_begin|>`` then ``<|tool_call_begin|>functions.N:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>``, one or more, then ``<|tool_calls_section_end|>``.

``parallel_tool_calls: false`` (or a named function) allows exactly one call. Bodies are written with the separators
chat templates' ``tojson`` uses (``", "`` and ``": "``), the form the target saw its calls in. The markers must be
single tokens of the vocabulary (they are, for every known template); otherwise the request is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from eaglenest.serve.chat_parsing import KIMI_ARGUMENT_MARKER, KIMI_TOOL_CALL
from eaglenest.serve.openai_protocol import APIError

KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
BODY_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""how a body's JSON is written: ``json.dumps``' (and Jinja's ``tojson``) separators, no other whitespace"""


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
                      vocab: Mapping[str, int], parallel: bool) -> str:
    """The Lark grammar of an answer that is only calls of ``names`` (one, or one or more when ``parallel``)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}

    def token(marker: str) -> str:
        if marker not in vocab:
            raise APIError(400, f"tool_choice cannot force a call on this target: its tool-call marker {marker!r} is "
                                "not one token of its vocabulary; send tool_choice 'auto'", param="tool_choice")
        return f"<[{vocab[marker]}]>"

    def schema(s: Mapping[str, Any]) -> str:
        return "%json " + json.dumps({**s, "x-guidance": BODY_FORMAT})

    repeat = "+" if parallel and len(names) > 0 else ""
    if tuple(markers) == KIMI_TOOL_CALL:
        bodies = " | ".join(f'"functions.{n}:" INDEX {token(KIMI_ARGUMENT_MARKER)} {schema(params[n])}'
                            for n in names)
        return (f"start: {token(KIMI_SECTION[0])} call{repeat} {token(KIMI_SECTION[1])}\n"
                f"call: {token(markers[0])} ({bodies}) {token(markers[1])}\n"
                "INDEX: /[0-9]+/\n")
    one_of = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
               "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    body = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
    return f"start: call{repeat}\ncall: {token(markers[0])} {schema(body)} {token(markers[1])}\n"
