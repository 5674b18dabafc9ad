"""Chat templates: the SmolLM2 GGUF template against the reference prompts, and the HF-compatible
environment details (tojson, raise_exception, tool-call arguments, generation tag, sandbox)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from pantheon.text.chat_template import ChatTemplate, ChatTemplateError
from tests.text.conftest import load_cases, reference_case_ids

GREEDY = "smollm2/greedy.json"


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf, smollm2_tokenizer):
    return ChatTemplate.from_gguf(smollm2_gguf, smollm2_tokenizer)


@pytest.fixture(scope="module")
def greedy_cases(reference_dir):
    return load_cases(reference_dir, GREEDY)


@pytest.mark.parametrize("case_id", reference_case_ids(GREEDY))
def test_rendered_prompt_is_byte_exact_and_tokenizes_to_reference_ids(smollm2_template, smollm2_tokenizer,
                                                                      greedy_cases, case_id):
    c = greedy_cases[case_id]
    rendered = smollm2_template.render(c["messages"], add_generation_prompt=True)
    assert rendered.encode("utf-8") == c["rendered_prompt"].encode("utf-8")
    assert smollm2_tokenizer.encode(rendered) == c["prompt_ids"]


def test_gguf_template_gets_bos_eos_unk_pad_text(smollm2_template, reference_dir):
    meta = json.loads((reference_dir / "smollm2" / "meta.json").read_text())
    hf = meta["hf_render_special_tokens"]
    assert (smollm2_template.bos_token, smollm2_template.eos_token) == (hf["bos_token"], hf["eos_token"])
    assert smollm2_template.extra_tokens == {"unk_token": hf["unk_token"], "pad_token": hf["pad_token"]}
    assert smollm2_template.source == meta["chat_template"]


def test_tojson_is_not_html_escaped_and_keeps_unicode():
    t = ChatTemplate("{{ messages[0].content | tojson }}|{{ tools | tojson(indent=2) }}")
    out = t.render([{"role": "user", "content": "<a & 'b'> é 日本"}], tools=[{"x": 1}])
    assert out == '"<a & \'b\'> é 日本"|[\n  {\n    "x": 1\n  }\n]'


def test_raise_exception_surfaces_as_chat_template_error():
    t = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}"
                     "{% endif %}ok")
    with pytest.raises(ChatTemplateError, match="first message must be system"):
        t.render([{"role": "user", "content": "hi"}])
    assert t.render([{"role": "system", "content": "s"}]) == "ok"


def test_tool_call_arguments_json_string_is_parsed_to_dict_before_rendering():
    t = ChatTemplate("{% for m in messages %}{% for tc in m.tool_calls or [] %}{{ tc.function.name }}:"
                     "{% for k, v in tc.function.arguments | items %}{{ k }}={{ v }};{% endfor %}"
                     "{% endfor %}{% endfor %}")
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"location": "Paris", "days": 2}'}}]}]
    assert t.render(msgs) == "get_weather:location=Paris;days=2;"
    assert isinstance(msgs[0]["tool_calls"][0]["function"]["arguments"], str)  # caller's copy untouched


def test_invalid_json_arguments_are_left_as_the_string():
    t = ChatTemplate("{{ messages[0].tool_calls[0].function.arguments }}")
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]
    assert t.render(msgs) == "{not json"


def test_reasoning_content_and_extra_kwargs_reach_the_template():
    t = ChatTemplate("{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}{{ enable_thinking }}")
    out = t.render([{"role": "assistant", "content": "a", "reasoning_content": "because"}], enable_thinking=False)
    assert out == "[because]False"


def test_generation_tag_loopcontrols_namespace_and_strftime_now():
    t = ChatTemplate("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
                     "{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}<{{ m.content }}>{% endgeneration %}"
                     "{% endfor %}{{ ns.n }} {{ strftime_now('%Y') }}")
    out = t.render([{"role": "user", "content": c} for c in "abc"])
    assert out == f"<a><b>2 {datetime.now().strftime('%Y')}"


def test_trim_and_lstrip_blocks_like_hf():
    t = ChatTemplate("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]) == "    x\n    y\n"


def test_syntax_error_is_chat_template_error_with_line():
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% if %}")


def test_runtime_type_error_and_sandbox_violation_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set l = [] %}{{ l.append(1) }}").render([])  # immutable sandbox


def test_missing_template_in_gguf_is_chat_template_error(smollm2_tokenizer):
    class Fake:
        metadata = {}

    with pytest.raises(ChatTemplateError, match="no tokenizer.chat_template"):
        ChatTemplate.from_gguf(Fake(), smollm2_tokenizer)
