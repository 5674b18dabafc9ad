"""ToolCallParser / parse_complete on hand-written model outputs, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from pantheon.text.tools import (ContentDelta, ToolCallArgs, ToolCallParser, ToolCallStart, coerce_text,
                                 coerce_value, parse_complete)
from tests.text.tools.helpers import TOOLS

QWEN_TWO_CALLS = (
    "I'll check the forecast and save a note.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis, France\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_file>\n<parameter=path>\nnotes/todo.py\n</parameter>\n"
    "<parameter=content>\ndef main():\n    if a < b and c > d:\n        print(\"<ok>\")\n\n</parameter>\n"
    "<parameter=overwrite>\ntrue\n</parameter>\n</function>\n</tool_call>"
)
QWEN_TWO_CALLS_ARGS = [
    ("get_weather", {"location": "Paris, France", "unit": "celsius", "days": 3}),
    ("write_file", {"path": "notes/todo.py",
                    "content": "def main():\n    if a < b and c > d:\n        print(\"<ok>\")\n",
                    "overwrite": True}),
]

MINICPM_TWO_CALLS = (
    "Let me look that up.\n"
    '<function name="get_weather"><param name="location">Paris, France</param>'
    '<param name="days">3</param></function>'
    '<function name="write_file"><param name="path">notes/todo.py</param>'
    '<param name="content"><![CDATA[def main():\n    if a < b and c > d:\n        print("<ok>")\n]]></param>'
    '<param name="overwrite">true</param></function>'
)
MINICPM_TWO_CALLS_ARGS = [
    ("get_weather", {"location": "Paris, France", "days": 3}),
    ("write_file", {"path": "notes/todo.py",
                    "content": "def main():\n    if a < b and c > d:\n        print(\"<ok>\")\n",
                    "overwrite": True}),
]

JSON_TWO_CALLS = (
    "Let me look that up.\n"
    '{"name": "get_weather", "arguments": {"location": "Paris, France", "days": 3}}\n'
    '{"name": "search", "arguments": {"query": "louvre opening hours", "limit": 5, '
    '"tags": ["museum", "paris"], "filters": {"lang": "fr"}}}\n'
)
JSON_TWO_CALLS_ARGS = [
    ("get_weather", {"location": "Paris, France", "days": 3}),
    ("search", {"query": "louvre opening hours", "limit": 5, "tags": ["museum", "paris"],
                "filters": {"lang": "fr"}}),
]

CASES = {
    "qwen_xml": (QWEN_TWO_CALLS, "I'll check the forecast and save a note.", QWEN_TWO_CALLS_ARGS),
    "minicpm_xml": (MINICPM_TWO_CALLS, "Let me look that up.", MINICPM_TWO_CALLS_ARGS),
    "json": (JSON_TWO_CALLS, "Let me look that up.", JSON_TWO_CALLS_ARGS),
}


def _names_args(calls):
    return [(c.name, c.arguments) for c in calls]


def _stream(dialect, text, pieces, **kw):
    """Feed pieces; return (content, calls, errors, events) and check the streaming invariants."""
    p = ToolCallParser(dialect, TOOLS, **kw)
    events = []
    for piece in pieces:
        events += p.push(piece).events
    tail, errors = p.finish()
    events += tail.events
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    args: dict[int, str] = {}
    starts = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in starts
            starts[e.index] = e
            args[e.index] = ""
        elif isinstance(e, ToolCallArgs):
            assert e.index in starts, "arguments before the call opened"
            args[e.index] += e.fragment
    for c in p.calls:
        assert starts[c.index].name == c.name and starts[c.index].id == c.id
        assert json.loads(args[c.index]) == c.arguments
    return content, p.calls, errors, events


def _chunkings(text, seed):
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("dialect", sorted(CASES))
def test_complete_output(dialect):
    text, content, expected = CASES[dialect]
    got_content, calls, errors = parse_complete(text, dialect, TOOLS)
    assert errors == []
    assert got_content == content
    assert _names_args(calls) == expected
    assert [c.index for c in calls] == [0, 1]
    for c in calls:
        assert c.id.startswith("call_") and len(c.id) == 29
        d = c.to_dict()
        assert d["type"] == "function" and json.loads(d["function"]["arguments"]) == c.arguments


@pytest.mark.parametrize("dialect", sorted(CASES))
@pytest.mark.parametrize("chunking", ["chars", "random0", "random1", "random2"])
def test_streamed_output_matches_complete(dialect, chunking):
    text, content, expected = CASES[dialect]
    pieces = list(text) if chunking == "chars" else _chunkings(text, int(chunking[-1]))
    got, calls, errors, events = _stream(dialect, text, pieces)
    assert errors == [] and got == content
    assert _names_args(calls) == expected
    for e in events:  # no call syntax ever leaks into content
        if isinstance(e, ContentDelta):
            assert "<" not in e.text and "{" not in e.text


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml"])
def test_incremental_mode_streams_each_argument(dialect):
    text, content, expected = CASES[dialect]
    got, calls, errors, events = _stream(dialect, text, list(text), incremental=True)
    assert errors == [] and got == content and _names_args(calls) == expected
    frags = [e.fragment for e in events if isinstance(e, ToolCallArgs) and e.index == 0]
    assert "".join(frags) == calls[0].arguments_json
    # non-string values come whole; a string value comes as it grows, a character at a time here
    for key, value in expected[0][1].items():
        piece = '"' + key + '": ' + json.dumps(value)
        assert any(f.endswith(piece) for f in frags) != isinstance(value, str), (key, frags)
    # the call opens before its first argument is complete
    first_start = next(i for i, e in enumerate(events) if isinstance(e, ToolCallStart))
    first_args = next(i for i, e in enumerate(events) if isinstance(e, ToolCallArgs))
    assert first_start < first_args


QWEN_JSON_BODY = ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "days": 3}}'
                  '\n</tool_call>')


@pytest.mark.parametrize("dialect,text", [
    ("qwen_xml", CASES["qwen_xml"][0]), ("minicpm_xml", CASES["minicpm_xml"][0]), ("json", CASES["json"][0]),
    ("qwen_xml", QWEN_JSON_BODY),
    ("json", '<tool_call>\n{"function": {"name": "search", "arguments": {"query": "x", "limit": 7}}}\n</tool_call>'),
])
def test_incremental_call_streams_char_by_char(dialect, text):
    """Fed one character at a time: the call opens as soon as its name is complete, each argument
    follows before the call closes, and the fragments concatenate to the final arguments JSON."""
    p = ToolCallParser(dialect, TOOLS, incremental=True)
    seen: list[tuple[int, object]] = []  # (characters fed so far, event)
    for i, ch in enumerate(text, 1):
        seen += [(i, e) for e in p.push(ch).tool_events]
    tail, errors = p.finish()
    seen += [(len(text) + 1, e) for e in tail.tool_events]
    assert errors == [] and p.calls
    call = p.calls[0]
    first = [(i, e) for i, e in seen if e.index == 0]
    at, start = first[0]
    assert isinstance(start, ToolCallStart) and start.name == call.name and start.id == call.id
    name_end = text.index(call.name) + len(call.name)
    assert at <= name_end + 2  # right after the name (a closing quote / ">" at most)
    frags = [(i, e) for i, e in first[1:] if isinstance(e, ToolCallArgs)]
    assert json.loads("".join(e.fragment for _, e in frags)) == call.arguments
    assert call.arguments_json == "".join(e.fragment for _, e in frags)
    # other values come whole (one fragment each, then "}"); strings stream as they grow
    strings = sum(isinstance(v, str) for v in call.arguments.values())
    assert strings and len(frags) > len(call.arguments) + 1 + strings
    # every argument is out before the call's text ends (only the closing "}" may wait for it)
    close = "</function>" if "</function>" in text else "}}"
    call_end = text.index(close) + len(close)
    assert all(i <= call_end for i, _ in frags[:-1])
    assert frags[-2][0] < frags[-1][0] or len(frags) == 1


def test_incremental_json_number_waits_for_its_end():
    p = ToolCallParser("json", TOOLS, incremental=True)
    ev = p.push('{"name": "search", "arguments": {"query": "a", "limit": 1')
    assert [type(e) for e in ev.tool_events] == [ToolCallStart, ToolCallArgs]
    assert ev.tool_events[1].fragment == '{"query": "a"'
    assert p.push("2").tool_events == []
    assert [e.fragment for e in p.push("}").tool_events] == [', "limit": 12']
    rest = p.push("}").tool_events + p.finish()[0].tool_events
    assert [e.fragment for e in rest] == ["}"] and p.calls[0].arguments == {"query": "a", "limit": 12}


def test_incremental_json_unknown_function_is_not_announced():
    p = ToolCallParser("json", TOOLS, incremental=True)
    ev = p.push('{"name": "nope", "arguments": {"a": 1')
    assert ev.tool_events == []
    p.push("}}")
    _, errors = p.finish()
    assert p.calls == [] and [e.code for e in errors] == ["unknown_function"]


def test_partial_opener_is_held_back():
    p = ToolCallParser("qwen_xml", TOOLS)
    assert p.push("Hello <tool").content == "Hello"
    assert p.push("box> is a tag").content == " <toolbox> is a tag"
    ev, errors = p.finish()
    assert ev.content == "" and errors == []


def test_plain_answer_is_untouched():
    text = "Sure! Here is an example:\n\n```python\nx = {'a': 1}\n```\n\nThat's all.\n"
    for dialect in CASES:
        content, calls, errors = parse_complete(text, dialect, TOOLS)
        assert (content, calls, errors) == (text, [], [])


def test_pure_call_has_null_content():
    text = "\n<tool_call>\n<function=search>\n<parameter=query>\nweather\n</parameter>\n</function>\n</tool_call>\n"
    content, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert content is None and _names_args(calls) == [("search", {"query": "weather"})]


@pytest.mark.parametrize("dialect", sorted(CASES))
def test_think_block_before_calls(dialect):
    text, content, expected = CASES[dialect]
    drafted = {"qwen_xml": "<tool_call>\n<function=nope>", "minicpm_xml": '<function name="nope">',
               "json": '\n{"name": "nope", "arguments": {}}\n'}[dialect]
    think = f"<think>\nThe user wants two things. Maybe {drafted} first?\n</think>\n\n"
    got, calls, errors = parse_complete(think + text, dialect, TOOLS)
    assert errors == [] and _names_args(calls) == expected
    assert got.startswith("<think>") and got.endswith(content)
    # the prompt already opened the block
    got, calls, errors = parse_complete(think[len("<think>"):] + text, dialect, TOOLS, start_in_reasoning=True)
    assert errors == [] and _names_args(calls) == expected


def test_unfinished_call_is_dropped_and_reported():
    text = QWEN_TWO_CALLS[: QWEN_TWO_CALLS.index("def main")] + "def main():\n    pa"
    content, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert _names_args(calls) == QWEN_TWO_CALLS_ARGS[:1]
    assert [e.to_dict() for e in errors] == [{
        "code": "unfinished_call", "function": "write_file", "parameter": "content",
        "message": "the output ended inside the value of 'content'"}]
    # cut right after the opener
    content, calls, errors = parse_complete("Checking.\n<tool_call>\n<funct", "qwen_xml", TOOLS)
    assert content == "Checking." and calls == [] and [e.code for e in errors] == ["unfinished_call"]


@pytest.mark.parametrize("dialect,text", [
    ("minicpm_xml", '<function name="get_weather"><param name="location">Paris</param><param name="da'),
    ("json", '{"name": "get_weather", "arguments": {"location": "Par'),
])
def test_unfinished_other_dialects(dialect, text):
    content, calls, errors = parse_complete(text, dialect, TOOLS)
    assert content is None and calls == [] and [e.code for e in errors] == ["unfinished_call"]
    assert errors[0].function in ("get_weather", None)


def test_malformed_call_then_good_call():
    text = ("<tool_call>\n<function=get_weather>\nlocation: Paris\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=search>\n<parameter=query>\nparis\n</parameter>\n</function>\n</tool_call>")
    content, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert _names_args(calls) == [("search", {"query": "paris"})]
    assert calls[0].index == 0
    assert [(e.code, e.function) for e in errors] == [("malformed_call", "get_weather")]


@pytest.mark.parametrize("dialect,text", [
    ("qwen_xml", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"),
    ("minicpm_xml", '<function name="function-name"><param name="param-name">param-value</param></function>'),
    ("json", '{"name": "get_time", "arguments": {"tz": "UTC"}}'),
])
def test_unknown_function_is_an_error_not_a_call(dialect, text):
    content, calls, errors = parse_complete(text, dialect, TOOLS)
    assert content is None and calls == []
    assert [e.code for e in errors] == ["unknown_function"]


def _qwen(fn, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={fn}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("params,expected", [
    ({"location": "Oslo", "days": "3.0"}, {"location": "Oslo", "days": 3}),
    ({"location": " Oslo ", "days": " 7 "}, {"location": " Oslo ", "days": 7}),
    ({"location": "42", "days": "2"}, {"location": "42", "days": 2}),
])
def test_xml_values_are_typed(params, expected):
    content, calls, errors = parse_complete(_qwen("get_weather", **params), "qwen_xml", TOOLS)
    assert errors == [] and calls[0].arguments == expected


def test_xml_values_all_types():
    text = _qwen("search", query="cheap flights\nto Oslo", limit="10", score="-1.5e2", tags='["a", "b"]',
                 filters="{'lang': 'en', 'since': 2020}")
    _, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert errors == []
    assert calls[0].arguments == {"query": "cheap flights\nto Oslo", "limit": 10, "score": -150.0,
                                  "tags": ["a", "b"], "filters": {"lang": "en", "since": 2020}}
    _, calls, errors = parse_complete(_qwen("write_file", path="a", content="", overwrite="False", mode="null"),
                                      "qwen_xml", TOOLS)
    assert errors == [] and calls[0].arguments == {"path": "a", "content": "", "overwrite": False, "mode": None}


@pytest.mark.parametrize("text,code,param", [
    (_qwen("get_weather", location="Oslo", days="tomorrow"), "invalid_argument", "days"),
    (_qwen("get_weather", location="Oslo"), "missing_argument", "days"),
    (_qwen("write_file", path="a", content="b", owner="me"), "unknown_argument", "owner"),
    (_qwen("search", query="x", tags="a, b"), "invalid_argument", "tags"),
    (_qwen("write_file", path="a", content="b", overwrite="yes"), "invalid_argument", "overwrite"),
])
def test_argument_errors(text, code, param):
    content, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert calls == [] and content is None
    assert [(e.code, e.parameter) for e in errors] == [(code, param)]
    assert errors[0].message


def test_incremental_reports_index_of_announced_call():
    p = ToolCallParser("qwen_xml", TOOLS, incremental=True)
    ev = p.push(_qwen("get_weather", location="Oslo", days="tomorrow"))
    starts = [e for e in ev.events if isinstance(e, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather"]
    _, errors = p.finish()
    assert p.calls == [] and [(e.code, e.index) for e in errors] == [("invalid_argument", 0)]
    # an unknown function is never announced
    p = ToolCallParser("qwen_xml", TOOLS, incremental=True)
    ev = p.push(_qwen("nope", a="1"))
    assert ev.tool_events == []
    assert [e.code for e in p.finish()[1]] == ["unknown_function"]


def test_qwen_lenient_forms():
    # bare <function=...> without the wrapper, a missing </parameter>, several functions in one wrapper
    text = ("<function=search>\n<parameter=query>\nfoo\n</function>\n"
            "<tool_call>\n<function=search>\n<parameter=query>\nbar\n</parameter>\n</function>\n"
            "<function=search>\n<parameter=query>\nbaz\n</parameter>\n</function>\n</tool_call>")
    content, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert errors == [] and content is None
    assert [c.arguments["query"] for c in calls] == ["foo", "bar", "baz"]


def test_qwen_json_body_inside_tool_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Rome", "days": 2}}\n</tool_call>'
    _, calls, errors = parse_complete(text, "qwen_xml", TOOLS)
    assert errors == [] and _names_args(calls) == [("get_weather", {"location": "Rome", "days": 2})]


def test_minicpm_variants():
    text = ('<function name="write_file">\n<param name="path">a&amp;b.txt</param>\n'
            '<param name="content"><![CDATA[x ]]]]><![CDATA[> y]]></param></function>\n'
            '<function name="search"><parameter name="query">q</parameter></function>')
    content, calls, errors = parse_complete(text, "minicpm_xml", TOOLS)
    assert errors == [] and content is None
    assert _names_args(calls) == [("write_file", {"path": "a&b.txt", "content": "x ]]> y"}),
                                  ("search", {"query": "q"})]


@pytest.mark.parametrize("text,expected", [
    ('```json\n{"name": "get_weather", "arguments": {"location": "Rome", "days": 2}}\n```',
     [("get_weather", {"location": "Rome", "days": 2})]),
    ('```\n[{"name": "search", "arguments": {"query": "a"}}, {"name": "search", "arguments": {"query": "b"}}]\n```',
     [("search", {"query": "a"}), ("search", {"query": "b"})]),
    ('<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"c\\"}"}\n</tool_call>', [("search", {"query": "c"})]),
    ('{"function": "search", "parameters": {"query": "d", "limit": "3"}}', [("search", {"query": "d", "limit": 3})]),
    ('{"function": {"name": "search", "arguments": {"query": "e"}}}', [("search", {"query": "e"})]),
    ('  {"name": "get_weather", "arguments": {"location": "Rome", "days": 2.0}}',
     [("get_weather", {"location": "Rome", "days": 2})]),
])
def test_json_forms(text, expected):
    content, calls, errors = parse_complete(text, "json", TOOLS)
    assert errors == [] and content is None and _names_args(calls) == expected
    # the same, streamed char by char
    _, calls2, errors2, _ = _stream("json", text, list(text))
    assert errors2 == [] and _names_args(calls2) == expected


@pytest.mark.parametrize("text", [
    '{"name": "Ada Lovelace", "born": 1815}',
    'The payload is {"name": "get_weather", "arguments": {}} inline.',
    '```json\n{"name": "Ada", "tags": ["x"]}\n```\nDone.',
    '```json\n{"results": [1, 2]}\n```',
])
def test_json_content_is_not_a_call(text):
    content, calls, errors = parse_complete(text, "json", TOOLS)
    assert (content, calls, errors) == (text, [], [])
    got, calls, errors, _ = _stream("json", text, list(text))
    assert (got, calls, errors) == (text, [], [])


def test_json_malformed_call():
    content, calls, errors = parse_complete('{"name": "search", "arguments": {"query": "x",}}\nok', "json", TOOLS)
    assert calls == [] and [e.code for e in errors] == ["malformed_call"] and content == "ok"


def test_coercion_helpers():
    assert coerce_text("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 5
    assert coerce_text("null", {"type": ["string", "null"]}) is None
    assert coerce_text("abc", {"type": ["integer", "string"]}) == "abc"
    assert coerce_text('{"a": 1}', {}) == {"a": 1}
    assert coerce_text("x", {"$ref": "#/$defs/k"}, {"$defs": {"k": {"type": "string", "enum": ["x"]}}}) == "x"
    with pytest.raises(ValueError):
        coerce_text("1.5", {"type": "integer"})
    assert coerce_value("12", {"type": "integer"}) == 12
    assert coerce_value(12, {"type": "string"}) == "12"
    assert coerce_value(2.0, {"type": "integer"}) == 2
    assert coerce_value(True, {"type": "boolean"}) is True
    with pytest.raises(ValueError):
        coerce_value(True, {"type": "integer"})
    with pytest.raises(ValueError):
        coerce_value({"a": 1}, {"type": "string"})


STREAMED_CONTENT = 'x = "a </pa b"\\\n\tline2\n'  # a false start of a close tag, escapes, a trailing newline


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml", "json"])
def test_a_string_value_streams_as_it_is_written(dialect):
    from pantheon.text.tools import get_dialect
    text = get_dialect(dialect).render_call("write_file", {"path": "a.py", "content": STREAMED_CONTENT})
    # where the whole value has been written: only what may still be stripped is held back (Qwen
    # strips the newline that ends a value; MiniCPM's CDATA keeps it)
    if dialect == "qwen_xml":
        value_end, shown = text.index(STREAMED_CONTENT) + len(STREAMED_CONTENT), json.dumps(STREAMED_CONTENT)[:-3]
    elif dialect == "minicpm_xml":
        value_end, shown = text.index("]]>"), json.dumps(STREAMED_CONTENT)[:-1]
    else:  # JSON: the string's text is re-escaped as it is decoded
        value_end = text.index(json.dumps(STREAMED_CONTENT, ensure_ascii=False)[:-1]) + len(json.dumps(STREAMED_CONTENT)) - 1
        shown = json.dumps(STREAMED_CONTENT)[:-1]
    checked = False
    p = ToolCallParser(dialect, TOOLS, incremental=True)
    sent = ""
    for i, ch in enumerate(text, 1):
        sent += "".join(e.fragment for e in p.push(ch).tool_events if isinstance(e, ToolCallArgs))
        if i == value_end:  # the value is out before its close tag
            assert sent == '{"path": "a.py", "content": ' + shown
            checked = True
    assert checked
    sent += "".join(e.fragment for e in p.finish()[0].tool_events if isinstance(e, ToolCallArgs))
    assert p.errors == [] and p.calls[0].arguments == {"path": "a.py", "content": STREAMED_CONTENT}
    assert sent == p.calls[0].arguments_json


def test_a_streamed_string_that_breaks_its_schema_fails_its_announced_call():
    tools = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 5}}, "required": ["text"]}}}]
    p = ToolCallParser("qwen_xml", tools, incremental=True)
    ev = p.push("<tool_call>\n<function=note>\n<parameter=text>\nmuch too long")
    assert [e.fragment for e in ev.tool_events if isinstance(e, ToolCallArgs)] == ['{"text": "', "much too long"]
    p.push("\n</parameter>\n</function>\n</tool_call>")
    _, errors = p.finish()
    assert p.calls == [] and [(e.code, e.index) for e in errors] == [("invalid_argument", 0)]


def test_partial_json_strings_hold_back_what_is_not_complete():
    from pantheon.text.tools.scanning import partial_json_string
    assert partial_json_string('ab\\') == "ab"            # a lone backslash starts an escape
    assert partial_json_string('ab\\\\') == "ab\\"   # an escaped backslash is complete
    assert partial_json_string('ab\\u00e') == "ab"
    assert partial_json_string('ab\\u00e9') == "ab\u00e9"
    assert partial_json_string('a\\ud83d') == "a"        # waits for the low surrogate
    assert partial_json_string('a\\ud83d\\ude00') == "a\U0001F600"
    assert partial_json_string('a\\x' + "b" * 20) is None
