"""Argument typing and jsonschema validation (arguments.py), alone and through the parser."""

from __future__ import annotations

import pytest

from pantheon.text.tools import ToolSpec, parse_complete, schema_problem
from pantheon.text.tools.arguments import ArgumentChecker, ArgumentError

BOOK = ToolSpec("book", "", {
    "type": "object",
    "properties": {
        "room": {"type": "string", "enum": ["red", "blue"]},
        "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "title": {"type": "string", "maxLength": 8},
        "guests": {"type": "array", "items": {"$ref": "#/$defs/guest"}, "maxItems": 3},
    },
    "required": ["room", "people"],
    "additionalProperties": False,
    "$defs": {"guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
})


def _qwen(**params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=book>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("params,code,parameter,words", [
    ({"room": "green", "people": "2"}, "invalid_argument", "room", "is not one of"),
    ({"room": "red", "people": "0"}, "invalid_argument", "people", "less than the minimum"),
    ({"room": "red", "people": "2", "title": "a long meeting"}, "invalid_argument", "title", "is too long"),
    ({"room": "red", "people": "2", "guests": '[{"name": "Ada"}, {"nom": "Bob"}]'}, "invalid_argument", "guests",
     "guests[1]"),
    ({"room": "red", "people": "2", "guests": "[{}, {}, {}, {}]"}, "invalid_argument", "guests", "too long"),
    ({"room": "red"}, "missing_argument", "people", "people"),
    ({"room": "red", "people": "2", "floor": "3"}, "unknown_argument", "floor", "floor"),
])
def test_values_are_validated_by_the_whole_schema(params, code, parameter, words):
    content, calls, errors = parse_complete(_qwen(**params), "qwen_xml", [BOOK])
    assert calls == [] and len(errors) == 1
    e = errors[0]
    assert (e.code, e.function, e.parameter) == (code, "book", parameter)
    assert words in e.message


def test_valid_values_are_typed_then_accepted():
    _, calls, errors = parse_complete(_qwen(room="blue", people="3", guests='[{"name": "Ada"}]'), "qwen_xml", [BOOK])
    assert errors == [] and calls[0].arguments == {"room": "blue", "people": 3, "guests": [{"name": "Ada"}]}


def test_streamed_arguments_are_checked_one_by_one_and_the_call_whole_at_its_end():
    check = ArgumentChecker(BOOK)
    assert check.typed("people", "4", is_text=True) == 4
    assert check.typed("guests", [{"name": "x"}], is_text=False) == [{"name": "x"}]
    with pytest.raises(ArgumentError) as e:
        check.typed("people", 40, is_text=False)
    assert e.value.code == "invalid_argument"
    with pytest.raises(ArgumentError) as e:
        check.check({"people": 4})
    assert (e.value.code, e.value.parameter) == ("missing_argument", "room")
    check.check({"room": "red", "people": 4})


def test_a_schema_jsonschema_cannot_evaluate_validates_nothing_rather_than_crashing():
    spec = ToolSpec("f", "", {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/x.json"}}})
    _, calls, errors = parse_complete('<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n'
                                      '</tool_call>', "qwen_xml", [spec])
    assert errors == [] and calls[0].arguments == {"a": "1"}  # untyped: the text as given


@pytest.mark.parametrize("schema,ok", [
    ({"type": "object", "properties": {"a": {"type": "string"}}}, True),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "array", "items": [{"type": "string"}]}}}, True),  # draft-07 tuple form
    ({"type": "object", "properties": {"a": {"type": "str"}}}, False),
    ({"type": "object", "required": "a"}, False),
    ({"type": "object", "properties": {"a": {"minLength": "3"}}}, False),
    (True, True),
])
def test_schema_problem_uses_the_meta_schema(schema, ok):
    problem = schema_problem(schema, "parameters")
    assert (problem is None) == ok, problem
    if not ok:
        assert problem.startswith("'parameters")
