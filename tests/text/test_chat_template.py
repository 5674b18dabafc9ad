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


# llama.cpp's tests/test-chat-template.cpp conversation and its expected output for each format
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"},
                {"role": "assistant", "content": "   I am an assistant   "},
                {"role": "user", "content": "Another question"}]
LLAMA_CPP_BUILTINS = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
              "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>"
              "assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
              "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
              "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant"
              "<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother "
              "question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
             "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
             "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
            "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question"
            "<|end|>\n<|assistant|>\n",
    "mistral-v1": " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    I am "
                  "an assistant   </s> [INST] Another question [/INST]",
}


class _Vocabulary:
    """What ChatTemplate reads of a tokenizer."""

    def __init__(self, add_bos: bool):
        self.add_bos, self.bos_id, self.eos_id, self.unk_id, self.pad_id = add_bos, 1, 2, None, None

    def token_text(self, tid: int) -> str:
        return {1: "<BOS>", 2: "<EOS>"}[tid]


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_BUILTINS))
def test_builtin_templates_render_as_llama_cpp_renders_them(name):
    from pantheon.text.chat_template import BUILTIN_TEMPLATES

    assert set(BUILTIN_TEMPLATES) == set(LLAMA_CPP_BUILTINS)
    # llama.cpp tokenizes its builtins' text with the vocabulary's BOS, where it adds one
    assert ChatTemplate.given(name, _Vocabulary(add_bos=False)).render(CONVERSATION) == LLAMA_CPP_BUILTINS[name]
    assert ChatTemplate.given(name.upper(), _Vocabulary(add_bos=True)).render(CONVERSATION) == \
        "<BOS>" + LLAMA_CPP_BUILTINS[name]
    ChatTemplate.given(name, _Vocabulary(add_bos=True)).probe()


def test_a_given_template_that_is_no_builtin_is_jinja_source():
    given = ChatTemplate.given("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
                               _Vocabulary(add_bos=False))
    assert given.render(CONVERSATION[:2]) == "<BOS>[system]You are a helpful assistant[user]Hello"
    with pytest.raises(ChatTemplateError):
        ChatTemplate.given("{% for m in messages %}", _Vocabulary(add_bos=False))


def test_system_turns_after_the_first_fold_into_a_user_turn_beside_them():
    from pantheon.text.chat_template import fold_system_turns

    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert fold_system_turns(plain) is plain  # nothing to fold
    # Claude Code's first request: a user turn, then a system turn
    assert fold_system_turns([{"role": "user", "content": "u"}, {"role": "system", "content": "agents"}]) == \
        [{"role": "user", "content": "u\n\nagents"}]
    turns = [{"role": "system", "content": "S"}, {"role": "system", "content": "T"}, {"role": "assistant", "content": "a"},
             {"role": "system", "content": "R"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "b"},
             {"role": "system", "content": "Z"}]
    assert fold_system_turns(turns) == [{"role": "system", "content": "S"}, {"role": "assistant", "content": "a"},
                                        {"role": "user", "content": "T\n\nR\n\nu"}, {"role": "assistant", "content": "b"},
                                        {"role": "user", "content": "Z"}]
    # every one, the first too (a template with no system role)
    assert fold_system_turns(plain, keep_first=False) == [{"role": "user", "content": "S\n\nu"}]


def test_todays_date_is_in_the_context_as_llama_cpp_puts_it():
    """Llama 3.x templates print `date_string` (else their fallback, "26 Jul 2024"): today's, as
    llama.cpp's extra context gives it, unless the request's kwargs give another."""
    import datetime

    from pantheon.text.chat_template import ChatTemplate

    t = ChatTemplate('{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}'
                     'Today Date: {{ date_string }} / {{ datetime }}')
    before = datetime.date.today()
    text = t.render([], False)
    assert text in {f"Today Date: {d.strftime('%d %b %Y')} / {d.strftime('%b %d %Y')}"
                    for d in (before, datetime.date.today())}  # a render at midnight takes either day
    assert t.render([], False, date_string="01 Jan 2000").startswith("Today Date: 01 Jan 2000 /")
