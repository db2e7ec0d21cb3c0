"""Structured output: OpenAI's ``response_format`` (chat) as the constraint the engine decodes under.

``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` constrains the answer to JSON
valid under the schema (``strict`` or not: the schema is always enforced, as vLLM and SGLang do), ``{"type":
"json_object"}`` to a JSON object, ``{"type": "text"}`` (or none) leaves it free. The Responses API's ``text.format``
is read here too (``flat``: its fields sit beside ``type``). A schema the grammar compiler cannot use is a 400 that
says why, before the request is admitted.

When the request separates reasoning and the target's reasoning markers are single tokens, the answer may open with
its reasoning block, free but for end tokens (the answer must follow), and the schema applies to what follows (the hf
backend; an SGLang engine does the same when launched with a reasoning parser,
``target.sglang.extra_args.reasoning_parser``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eaglenest.config import TargetConfig
from eaglenest.engines.base import OutputConstraint
from eaglenest.serve.openai_protocol import APIError
from eaglenest.speculative.guide import canonical_schema, schema_error

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
"""``json_object``: any JSON object"""


def requested_schema(response_format: dict[str, Any] | None, *, param: str = "response_format",
                     flat: bool = False) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks for (None: free text); a 400 naming the field otherwise.
    ``flat``: the Responses API's ``text.format``, whose ``json_schema`` fields sit beside ``type``."""
    if not response_format:
        return None
    if not isinstance(response_format, dict):
        raise APIError(400, f"{param} must be an object such as {{\"type\": \"json_schema\", ...}}", param=param)
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise APIError(400, f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param=f"{param}.type")
    spec, where = (response_format, param) if flat else (response_format.get("json_schema"), f"{param}.json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, f"{where} must be an object with the schema under 'schema'", param=where)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.schema must be a JSON Schema object, got {type(schema).__name__}",
                       param=f"{where}.schema")
    error = schema_error(schema)
    if error:
        raise APIError(400, f"{where}.schema cannot constrain an answer: {error}", param=f"{where}.schema")
    return schema


def output_constraint(schema: dict[str, Any] | None = None, *, lark: str | None = None,
                      reasoning: tuple[int, int] | None = None, in_reasoning: bool = False) -> OutputConstraint | None:
    """The engine's constraint for ``schema`` or a Lark grammar (None: free text); ``reasoning``: the start and end
    token ids of a reasoning block the answer may open with (None: the grammar applies from the first token)."""
    if schema is None and lark is None:
        return None
    return OutputConstraint(canonical_schema(schema) if schema is not None else None, lark=lark, reasoning=reasoning,
                            in_reasoning=in_reasoning and reasoning is not None)


def marker_ids(vocab: Mapping[str, int], markers: tuple[str, str] | None) -> tuple[int, int] | None:
    """The token ids of a (start, end) marker pair when both are single tokens of ``vocab`` (else None)."""
    if markers is None:
        return None
    ids = [vocab.get(m) for m in markers]
    if any(i is None for i in ids):
        return None
    return int(ids[0]), int(ids[1])  # type: ignore[arg-type]


def check_engine_constrains(target: TargetConfig, *, lark: bool = False, param: str = "response_format") -> None:
    """A 400 (naming ``param``) with the fix where the engine cannot constrain an answer: SGLang launched without a
    grammar backend (the bundle's default) would answer free text, and only its llguidance backend reads a Lark
    grammar (a forced tool call, or tools beside a ``response_format``). The hf engine always can (llguidance)."""
    if target.engine != "sglang":
        return
    backend = target.sglang.extra_args.get("grammar_backend", target.sglang.grammar_backend)
    if lark and backend != "llguidance":
        raise APIError(400, "a forced tool call (tool_choice 'required' or a named function), or tools beside "
                            "response_format, is constrained by a Lark grammar, which SGLang reads with its llguidance "
                            f"grammar backend only (this server's engine runs {backend!r}); set "
                            "target.sglang.grammar_backend: llguidance", param=param)
    if backend in (None, "none"):
        raise APIError(400, "response_format needs a grammar backend in SGLang, and this server's engine runs "
                            "without one; set target.sglang.grammar_backend (xgrammar or llguidance) or send no "
                            "response_format", param="response_format")
