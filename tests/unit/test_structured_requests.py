"""``response_format`` / ``text.format`` as the engine's constraint: what each form asks for, the 400 that names a
field the server cannot use, and the engines that can constrain (SGLang only with a grammar backend)."""

from __future__ import annotations

import json

import pytest

from eaglenest.config import TargetConfig
from eaglenest.engines.base import OutputConstraint
from eaglenest.engines.sglang.args import sampling_params_dict
from eaglenest.serve.openai_protocol import APIError
from eaglenest.serve.structured import check_engine_constrains, output_constraint, requested_schema

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def test_each_form_asks_for_its_schema() -> None:
    assert requested_schema(None) is None and requested_schema({"type": "text"}) is None
    assert requested_schema({"type": "json_object"}) == {"type": "object"}
    assert requested_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}) \
        == SCHEMA
    assert requested_schema({"type": "json_schema", "name": "x", "schema": SCHEMA}, param="text.format",
                            flat=True) == SCHEMA


@pytest.mark.parametrize(("fmt", "flat", "param", "says"), [
    ({"type": "yaml"}, False, "response_format.type", "'yaml'"),
    ({"type": "json_schema"}, False, "response_format.json_schema", "schema"),
    ({"type": "json_schema", "json_schema": {"schema": "{}"}}, False, "response_format.json_schema.schema", "str"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}, False,
     "response_format.json_schema.schema", "strnig"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/nope"}}}, False,
     "response_format.json_schema.schema", "nope"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}, True,
     "text.format.schema", "minimum"),
    ({"type": "json_schema", "name": "x"}, True, "text.format.schema", "NoneType"),
])
def test_a_field_the_server_cannot_use_is_a_400_naming_it(fmt, flat, param, says) -> None:
    with pytest.raises(APIError) as e:
        requested_schema(fmt, param="text.format" if flat else "response_format", flat=flat)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message


def test_the_constraint_keeps_the_schemas_order_and_the_reasoning_markers() -> None:
    c = output_constraint(SCHEMA, reasoning=(7, 8), in_reasoning=True)
    assert c == OutputConstraint(json.dumps(SCHEMA, separators=(",", ":")), reasoning=(7, 8), in_reasoning=True)
    assert list(json.loads(c.schema)["properties"]) == ["b", "a"]  # properties are answered in this order
    assert output_constraint(SCHEMA, in_reasoning=True).in_reasoning is False  # no markers: nothing to be inside
    assert output_constraint(None) is None
    hash(c)  # sampling settings key the decoder's groups


def test_sglang_gets_the_schema_as_json_schema_and_a_grammar_as_ebnf() -> None:
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.sglang.args import request_kwargs

    c = output_constraint(SCHEMA)
    assert sampling_params_dict(SamplingParams(constraint=c))["json_schema"] == c.schema
    assert "json_schema" not in sampling_params_dict(SamplingParams())
    lark = 'start: "yes" | "no"'
    assert sampling_params_dict(SamplingParams(constraint=output_constraint(lark=lark)))["ebnf"] == lark
    opened = output_constraint(SCHEMA, reasoning=(7, 8), in_reasoning=True)
    assert request_kwargs(SamplingParams(constraint=opened)) == {"require_reasoning": True}
    assert request_kwargs(SamplingParams(constraint=c)) == {}


def test_only_an_engine_with_a_grammar_backend_takes_response_format() -> None:
    check_engine_constrains(TargetConfig(model="m"))  # hf: llguidance, always
    check_engine_constrains(TargetConfig(model="m", engine="sglang", sglang={"grammar_backend": "xgrammar"}))
    check_engine_constrains(TargetConfig(model="m", engine="sglang",
                                         sglang={"extra_args": {"grammar_backend": "llguidance"}}))
    with pytest.raises(APIError) as e:
        check_engine_constrains(TargetConfig(model="m", engine="sglang"))
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "target.sglang.grammar_backend" in e.value.message
    check_engine_constrains(TargetConfig(model="m", engine="sglang", sglang={"grammar_backend": "llguidance"}),
                            lark=True)
    with pytest.raises(APIError) as e:  # a forced tool call's Lark grammar: llguidance only
        check_engine_constrains(TargetConfig(model="m", engine="sglang", sglang={"grammar_backend": "xgrammar"}),
                                lark=True, param="tool_choice")
    assert e.value.param == "tool_choice" and "llguidance" in e.value.message
