"""Dialect choice, tool prompts, and history rendering that parses back to the same calls."""

from __future__ import annotations

import json

import pytest

from pantheon.text.chat_template import ChatTemplate
from pantheon.text.tools import (JSON_CALLS, MINICPM_XML, QWEN_XML, ToolSpecError, apply_dialect, dialect_for,
                                 get_dialect, normalize_tools, parse_complete)
from tests.text.tools.helpers import SEARCH, TOOLS, WEATHER

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("name,arch,bos,expected", [
    ("ornith-7b", "qwen2", False, JSON_CALLS),
    ("Ornith", "llama", True, JSON_CALLS),
    ("minicpm5-2b", "llama", True, MINICPM_XML),
    ("SmolLM2-135M-Instruct", "llama", False, QWEN_XML),
    ("qwen3-coder", "qwen3moe", False, QWEN_XML),
    ("some-model", "qwen35moe", True, QWEN_XML),
    ("", "", False, QWEN_XML),
])
def test_dialect_for(name, arch, bos, expected):
    assert dialect_for(name, arch, bos) is expected


def test_normalize_tools():
    specs = normalize_tools([WEATHER, {"type": "code_interpreter"}, {"name": "bare", "description": "d"}, WEATHER])
    assert [s.name for s in specs] == ["get_weather", "bare"]
    assert specs[0].required == ["location", "days"]
    assert specs[1].parameters == {"type": "object", "properties": {}}
    with pytest.raises(ToolSpecError, match=r"'tools\[0\].function.name' must be a non-empty string"):
        normalize_tools([{"type": "function", "function": {"description": "no name"}}])


@pytest.mark.parametrize("tools,words", [
    ([WEATHER, None], "'tools[1]' must be an object such as {\"type\": \"function\", \"function\": {\"name\": ...}}, got null"),
    (["x"], "'tools[0]' must be an object such as {\"type\": \"function\", \"function\": {\"name\": ...}}, got a string"),
    ([{"type": "function", "function": [1]}], "'tools[0].function' must be an object, got an array"),
])
def test_malformed_tools_are_refused_in_json_words_naming_the_entry(tools, words):
    with pytest.raises(ToolSpecError) as info:
        normalize_tools(tools)
    assert str(info.value) == words and "NoneType" not in str(info.value)


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml", "json"])
def test_tools_system_prompt(dialect):
    d = get_dialect(dialect)
    text = d.render_tools_system(TOOLS, None)
    assert text.startswith("# Tools")
    for t in TOOLS:  # every schema is in it, one JSON line each
        line = next(x for x in text.splitlines() if f'"name": "{t["function"]["name"]}"' in x)
        assert json.loads(line)["function"]["parameters"] == t["function"]["parameters"]
    syntax = {"qwen_xml": "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>",
              "minicpm_xml": '<function name="FUNCTION_NAME"><param name="PARAMETER_NAME">value</param></function>',
              "json": '{"name": "FUNCTION_NAME", "arguments": {"PARAMETER_NAME": value}}'}[dialect]
    assert syntax in text
    merged = d.render_tools_system(TOOLS, "You are a helpful assistant.\n")
    assert merged.startswith("You are a helpful assistant.\n\n# Tools")
    placed = d.render_tools_system(TOOLS, "Before.\n<tool_def_sep>\nAfter.")
    assert placed.startswith("Before.\n# Tools") and placed.endswith("\nAfter.")


HISTORY_CALLS = [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps({"location": "Zürich", "days": 2})}},
    {"id": "call_2", "type": "function",
     "function": {"name": "search", "arguments": {"query": "a < b && c\nline two", "limit": 3,
                                                    "tags": ["x"], "filters": {"lang": "de"}}}},
]


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml", "json"])
def test_rendered_calls_parse_back(dialect):
    d = get_dialect(dialect)
    text = d.render_assistant_tool_calls(HISTORY_CALLS)
    content, calls, errors = parse_complete(text, dialect, TOOLS)
    assert errors == [] and content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"location": "Zürich", "days": 2}),
        ("search", {"query": "a < b && c\nline two", "limit": 3, "tags": ["x"], "filters": {"lang": "de"}})]


def test_exact_call_syntax():
    calls = [{"function": {"name": "f", "arguments": {"k": "v", "n": 2}}}]
    assert QWEN_XML.render_assistant_tool_calls(calls) == (
        "<tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n<parameter=n>\n2\n</parameter>\n"
        "</function>\n</tool_call>")
    assert MINICPM_XML.render_assistant_tool_calls(calls) == (
        '<function name="f"><param name="k">v</param><param name="n">2</param></function>')
    assert JSON_CALLS.render_assistant_tool_calls(calls) == '{"name": "f", "arguments": {"k": "v", "n": 2}}'
    assert MINICPM_XML.render_tool_result({"role": "tool", "content": "18 C"}) == \
        "<tool_response>\n18 C\n</tool_response>"


@pytest.mark.parametrize("dialect", ["qwen_xml", "minicpm_xml", "json"])
def test_apply_dialect_conversation(dialect):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich, and search something."},
        {"role": "assistant", "content": "On it.", "tool_calls": HISTORY_CALLS, "reasoning_content": "r"},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C, rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no results"},
        {"role": "assistant", "content": "It rains."},
    ]
    out = apply_dialect(dialect, messages, [WEATHER, SEARCH])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[2]["reasoning_content"] == "r" and "tool_calls" not in out[2]
    content, calls, errors = parse_complete(out[2]["content"], dialect, TOOLS)
    assert content == "On it." and len(calls) == 2 and errors == []
    assert out[3]["content"] == "<tool_response>\n3 C, rain\n</tool_response>\n<tool_response>\nno results\n</tool_response>"
    assert messages[2]["tool_calls"] is HISTORY_CALLS  # input untouched
    prompt = ChatTemplate(CHATML).render(out, add_generation_prompt=True)
    assert prompt.count("<|im_start|>") == 6 and prompt.endswith("<|im_start|>assistant\n")


def test_apply_dialect_adds_system_when_absent():
    out = apply_dialect("qwen_xml", [{"role": "user", "content": "hi"}], [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    assert apply_dialect("qwen_xml", [{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]
