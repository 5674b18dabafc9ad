"""Request validation answers 400, never 500 (in process, Quart's test client, tiny model): integer
literals too large for their field, bodies and schemas nested past the depth cap, lone surrogates,
wrong types in messages and tools. Clamps the contract defines still clamp. No error body names a
Python exception class, and the app keeps serving afterwards."""

from __future__ import annotations

import re

import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp

CHAT = "/v1/chat/completions"
PY_CLASS = re.compile(r"\b\w*(Error|Exception)\b(?!_)|Traceback|KeyError|StopIteration")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("val") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 4096})
    server = InProcessApp([(str(path), "tiny")], max_concurrent=4, max_sessions=4)
    yield server
    server.close()


def raw_post(app, path: str, data: str | bytes) -> tuple[int, dict]:
    async def go():
        r = await app.client.post(path, data=data, headers={"Content-Type": "application/json"})
        return r.status_code, await r.get_json()

    return app.run(go())



def chat(content="hi", **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 4, **kw}


def chat_json(extra: str = "", messages: str = '[{"role": "user", "content": "hi"}]') -> str:
    return '{"model": "tiny", "temperature": 0, "max_tokens": 4, "messages": %s%s}' % (messages, extra)


def assert_400(status: int, body: dict, field: str | None = None) -> None:
    assert status == 400, body
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["code"] is None and isinstance(body["error"]["message"], str)
    assert not PY_CLASS.search(body["error"]["message"]), body
    if field is not None:
        assert field in body["error"]["message"], body


def nested(depth: int, leaf: str = "{}") -> str:
    return '{"a": ' * depth + leaf + "}" * depth


# ---- numbers too large for their field -------------------------------------------------------------------
BIG = "1" + "0" * 400  # 10**400: no float holds it

REFUSED = [  # (raw JSON fragment, field the message must name)
    (f', "seed": 1e309', "seed"),
    (f', "max_tokens": 1e309', "max_tokens"),
    (f', "n": 1e309', "n"),
    (f', "top_k": -1e309', "top_k"),
    (f', "top_logprobs": 1e309, "logprobs": true', "top_logprobs"),
    (f', "reasoning_budget": 1e309', "reasoning_budget"),
    (f', "temperature": 1e309', "temperature"),
    (f', "presence_penalty": -1e309', "presence_penalty"),
]


@pytest.mark.parametrize("fragment,field", REFUSED)
def test_an_infinite_number_is_refused_naming_its_field(app, fragment, field):
    assert_400(*raw_post(app, CHAT, chat_json(fragment)), field)


CLAMPED = [  # a huge integer the contract clamps is clamped: the request is served
    f', "max_tokens": {BIG}',
    f', "max_completion_tokens": {BIG}',
    f', "n": {BIG}',
    f', "top_k": {BIG}',
    f', "top_k": -{BIG}',
    f', "top_p": {BIG}',
    f', "temperature": {BIG}',
    f', "presence_penalty": {BIG}, "frequency_penalty": -{BIG}',
    f', "top_logprobs": {BIG}, "logprobs": true',
    f', "logit_bias": {{"1": {BIG}, "2": -{BIG}, "{BIG}": 5, "-{BIG}": 5, "3": 1e309}}',
    f', "seed": {BIG}',
    f', "seed": -{BIG}',
    f', "reasoning_budget": {BIG}',
    f', "max_reasoning_tokens": -{BIG}',
]


@pytest.mark.parametrize("fragment", CLAMPED)
def test_a_huge_integer_is_clamped_or_refused_never_a_500(app, fragment):
    status, body = raw_post(app, CHAT, chat_json(fragment))
    assert status in (200, 400), body
    if status == 400:
        assert_400(status, body)
    else:
        assert body["choices"]


def test_n_past_the_cap_is_capped_not_refused(app):
    status, body = raw_post(app, CHAT, chat_json(f', "n": {BIG}, "max_tokens": 1'))
    assert status == 200, body
    assert len(body["choices"]) == 8 and body["n_status"] == "capped_to_8"


def test_max_tokens_past_the_cap_is_clamped(app):
    from pantheon.web.chat_request import MAX_TOKENS_CAP, parse_chat_request

    req = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**400,
                              "presence_penalty": 10**400, "top_logprobs": 10**400, "logit_bias": {"5": -10**400}})
    assert req.max_tokens == MAX_TOKENS_CAP and req.presence_penalty == 2.0 and req.top_logprobs == 20
    assert req.logit_bias == ((5, -100.0),)


def test_estimate_with_an_infinite_or_huge_token_count_is_refused(app):
    for q in ("tokens=1e309", "tokens=inf", "tokens=nan", f"tokens={BIG}", "tokens=10&blob_bytes=1e309",
              "tokens=10&upload_bps=1e309"):
        status, body = app.get(f"/session/estimate?{q}")
        assert_400(status, body)
    assert_400(*app.get("/session/estimate?tokens=1e309"), "tokens")


def test_admin_load_with_a_huge_integer_is_refused(app):
    status, body = raw_post(app, "/admin/models/load", '{"path": "/nope.gguf", "ctx_cap": %s}' % BIG)
    assert_400(status, body, "ctx_cap")


# ---- nesting -----------------------------------------------------------------------------------------
def test_a_number_literal_past_the_digit_limit_is_refused(app):
    assert_400(*raw_post(app, CHAT, chat_json(', "seed": ' + "9" * 5000)))


def test_a_body_nested_ten_thousand_deep_is_refused(app):
    assert_400(*raw_post(app, CHAT, "[" * 10000 + "]" * 10000))
    assert_400(*raw_post(app, CHAT, nested(10000)))
    assert_400(*raw_post(app, "/session/release", nested(10000)))


def test_a_json_schema_nested_300_deep_is_refused(app):
    schema = '{"type": "object", "properties": {"a": ' * 300 + '{"type": "string"}' + "}}" * 300
    rf = ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}' % schema
    assert_400(*raw_post(app, CHAT, chat_json(rf)), "deep")


def test_a_tool_schema_nested_300_deep_is_refused(app):
    schema = '{"type": "object", "properties": {"a": ' * 300 + '{"type": "string"}' + "}}" * 300
    tools = ', "tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]' % schema
    assert_400(*raw_post(app, CHAT, chat_json(tools)), "deep")


def test_modest_nesting_is_served(app):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    status, body, _ = app.post(CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                               "schema": schema}}))
    assert status == 200, body


# ---- strings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages,field", [
    ('[{"role": "user", "content": "a\\ud800b"}]', "content"),
    ('[{"role": "us\\ud800er", "content": "hi"}]', "role"),
    ('[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]', "messages"),
])
def test_a_lone_surrogate_is_refused(app, messages, field):
    assert_400(*raw_post(app, CHAT, chat_json(messages=messages)), field)


def test_a_lone_surrogate_elsewhere_is_refused(app):
    assert_400(*raw_post(app, CHAT, chat_json(', "stop": ["\\ud800"]')), "stop")
    tools = ', "tools": [{"type": "function", "function": {"name": "f\\udc00"}}]'
    assert_400(*raw_post(app, CHAT, chat_json(tools)), "tools")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_not_json(app, literal):
    """Python's json reads NaN and Infinity; JSON (and llama-server's parser) has no such literals."""
    status, body = raw_post(app, CHAT, chat_json(f', "temperature": {literal}'))
    assert_400(status, body, literal)
    assert "not a JSON value" in body["error"]["message"]


def test_a_responses_echo_holds_no_infinity(app):
    """The Responses API echoes the client's `reasoning`, `text`, `metadata`, ...: a number past
    f64's range there (1e309 reads as infinity) comes back null, so the reply stays JSON."""
    import json

    def strict(constant):
        raise AssertionError(f"non-JSON constant {constant}")

    async def go():
        r = await app.client.post("/v1/responses", data='{"model": "tiny", "input": "hello", "max_output_tokens": 2, '
                                  '"reasoning": {"a": 1e309}, "metadata": {"k": [-1e309, 1]}}',
                                  headers={"Content-Type": "application/json"})
        return r.status_code, await r.get_data(as_text=True)

    status, text = app.run(go())
    assert status == 200, text[:500]
    body = json.loads(text, parse_constant=strict)
    assert body["reasoning"] == {"a": None} and body["metadata"] == {"k": [None, 1]}


def test_a_paired_surrogate_is_a_character(app):
    status, body = raw_post(app, CHAT, chat_json(messages='[{"role": "user", "content": "\\ud83d\\ude00"}]'))
    assert status == 200, body


# ---- wrong types -------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages,field", [
    ([{"role": 123, "content": "hi"}], "role"),
    ([{"role": ["user"], "content": "hi"}], "role"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "hi"}, 5], "messages[1]"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": 5}], "tool_calls"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [5]}], "tool_calls"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": {"a": 1}}], "tool_calls"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": 7}]}], "tool_calls"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 7, "arguments": 3}}]}], "tool_calls"),
])
def test_a_message_of_the_wrong_shape_is_refused(app, messages, field):
    assert_400(*app.post(CHAT, {"model": "tiny", "messages": messages, "max_tokens": 4})[:2], field)


def test_contract_leniencies_are_kept(app):
    # missing role -> user; content other than a string reads as empty
    for messages in ([{"content": "hi"}], [{"role": "user", "content": 5}], [{"role": "user", "content": None}]):
        status, body, _ = app.post(CHAT, {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0})
        assert status == 200, body


MALFORMED_TOOLS = [
    [{"type": "function", "function": {"name": "f", "parameters": 5}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 5}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                   "properties": {"a": {"type": 5}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "type": "string"}}, "required": "a"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "enum": 5}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "type": "array", "items": 5}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "anyOf": 5}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": 5}}}],
    # not a type JSON schema knows (jsonschema's meta-schema check)
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "type": "str"}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
        "type": "string", "maxLength": -1}}}}}],
    [{"type": "function", "function": 5}],
    [{"type": "function", "function": {"name": 5}}],
    [5],
    5,
    {"name": "f"},
]


@pytest.mark.parametrize("tools", MALFORMED_TOOLS)
def test_malformed_tools_are_refused(app, tools):
    for choice in ("auto", "required"):
        assert_400(*app.post(CHAT, chat(tools=tools, tool_choice=choice))[:2], "tool")


def test_well_formed_tool_schemas_are_served(app):
    params = {"type": "object", "properties": {"a": {"type": ["string", "null"], "enum": ["x", None]},
                                               "b": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                                               "c": {"anyOf": [{"type": "integer"}, True]}},
              "required": ["a"], "additionalProperties": False, "$defs": {"n": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for choice in ("auto", "required"):
        status, body, _ = app.post(CHAT, chat(tools=tools, tool_choice=choice))
        assert status == 200, body


@pytest.mark.parametrize("rf", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": 5}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "items": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
    {"type": 5},
])
def test_a_malformed_response_format_is_refused_or_served_never_a_500(app, rf):
    status, body, _ = app.post(CHAT, chat(response_format=rf))
    assert status in (200, 400), body
    if status == 400:
        assert_400(status, body, "response_format")


# ---- 500 bodies, and the app afterwards --------------------------------------------------------------------
def test_a_500_says_what_failed_in_words_with_a_request_id(app, caplog):
    from pantheon.faults import FAULTS

    FAULTS.set("step", 1)
    with caplog.at_level("ERROR"):
        status, body, _ = app.post(CHAT, chat("fail me", logit_bias={"0": -100, "2": -100}, max_tokens=8))
    assert status == 500 and body["error"]["type"] == "server_error", body
    message = body["error"]["message"]
    assert not PY_CLASS.search(message), message
    rid = re.search(r"request id (\w+)", message)
    assert rid, message
    assert any(rid.group(1) in r.getMessage() for r in caplog.records)


def test_the_app_still_serves_afterwards(app):
    status, body = app.get("/")
    assert status == 200 and body["status"] == "ok"
    status, body, _ = app.post(CHAT, chat("still here"))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
