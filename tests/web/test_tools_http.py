"""Tool calling and constrained decoding through a real server with the official openai client.

The tiny models have random weights: left alone they emit noise, so every valid call here is the
grammar's doing. Tool schemas bound their strings (maxLength) so a model that never closes a string
by itself is moved on to the next parameter, as the grammar honours the schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.tiny_models import CHATML, write_tiny_llama
from tests.web.server import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a place.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                                     "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
# A template that renders bos_token: a llama-arch model with it gets MiniCPM's dialect.
BOS_CHATML = "{{ bos_token }}" + CHATML


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    meta = {"llama.context_length": 2048}
    plain = write_tiny_llama(d / "plain.gguf", seed=21, extra_metadata=meta)
    bos = write_tiny_llama(d / "bos.gguf", seed=22, extra_metadata=meta, chat_template=BOS_CHATML)
    server = ServerProcess(["--model", str(plain), "--name", "qwenish", "--model", str(plain), "--name", "ornith-tiny",
                            "--model", str(bos), "--name", "minicpmish", "--ctx-cap", "2048"], wait_models=3)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def check_call(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.id and call.type == "function"
    return args


@pytest.mark.parametrize("model", ["qwenish", "ornith-tiny", "minicpmish"])
@pytest.mark.parametrize("seed", [1, 2])
def test_required_call_from_noise_is_one_valid_typed_call(client, model, seed):
    r = client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=seed, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("model", ["qwenish", "ornith-tiny", "minicpmish"])
def test_required_call_streams_opening_then_arguments(client, model):
    body = dict(model=model, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
                max_tokens=200)
    full = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].id and calls[0].function.name and calls[0].function.arguments == ""
    assert all(tc.index == 0 for tc in calls)
    assert "".join(tc.function.arguments or "" for tc in calls) == full.function.arguments
    assert not any(d.content for d in deltas)  # no call text leaks into content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the call streams as it is generated: the opening comes in its own chunk, ahead of the
    # arguments, which come as several pieces (one per argument, then "}")
    at = [i for i, d in enumerate(deltas) for tc in (d.tool_calls or [])]
    opening = next(i for i, d in enumerate(deltas) for tc in (d.tool_calls or []) if tc.id)
    last_args = max(i for i, d in enumerate(deltas) for tc in (d.tool_calls or []) if tc.function.arguments)
    assert opening == at[0] and opening < last_args
    assert sum(1 for tc in calls if tc.function.arguments) >= 2
    assert "".join(tc.function.arguments or "" for tc in calls).endswith("}")
    with client.chat.completions.stream(**body) as stream:  # openai-python's stream helper assembles it
        final = stream.get_final_completion()
    check_call(final.choices[0].message.tool_calls[0])


def test_tool_choice_none_renders_no_tools(client):
    with_tools = client.chat.completions.create(model="qwenish", messages=MSG, tools=TOOLS, max_tokens=1)
    without = client.chat.completions.create(model="qwenish", messages=MSG, tools=TOOLS, tool_choice="none",
                                             max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_tool_history_renders_back_in_the_dialect(client):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"location": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="qwenish", messages=history, tools=TOOLS, max_tokens=2)
    assert r.usage.prompt_tokens > client.chat.completions.create(
        model="qwenish", messages=MSG, tools=TOOLS, max_tokens=2).usage.prompt_tokens


def test_models_advertise_required_with_thinking_per_dialect(tools_server):
    rows = {m["id"]: m for m in httpx.get(tools_server.url + "/v1/models").json()["data"]}
    assert rows["qwenish"]["tool_choice_required_with_thinking"] is True
    assert rows["ornith-tiny"]["tool_choice_required_with_thinking"] is True
    assert rows["minicpmish"]["tool_choice_required_with_thinking"] is False


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_is_enforced_on_noise(tools_server, seed):
    r = httpx.post(tools_server.url + "/v1/chat/completions", timeout=300, json={
        "model": "qwenish", "messages": [{"role": "user", "content": "a person"}], "temperature": 1.0, "seed": seed,
        "max_tokens": 300, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    body = r.json()
    assert body["response_format_status"] == "applied", body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


def test_json_object_and_status_values(tools_server):
    url = tools_server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "json please"}]
    r = httpx.post(url, timeout=300, json={"model": "qwenish", "messages": msgs, "temperature": 0.7, "seed": 4,
                                           "max_tokens": 300, "response_format": {"type": "json_object"}}).json()
    if r["response_format_status"] == "applied":
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    else:  # noise that never closed within max_tokens is reported, not passed off as JSON
        assert r["response_format_status"] == "not_enforced" and r["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url, json={"model": "qwenish", "messages": msgs, "max_tokens": 1,
                              "response_format": {"type": "yaml"}}).json()
    assert r["response_format_status"] == "ignored_unknown_type"
    r = httpx.post(url, json={"model": "qwenish", "messages": msgs, "max_tokens": 1, "tools": TOOLS,
                              "response_format": {"type": "json_object"}}).json()
    assert r["response_format_status"] == "ignored_tools_present"


def test_invalid_tools_are_400(tools_server):
    r = httpx.post(tools_server.url + "/v1/chat/completions", json={
        "model": "qwenish", "messages": MSG, "tools": [{"type": "function", "function": {"description": "no name"}}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_required_with_n_2_constrains_every_choice(client):
    r = client.chat.completions.create(model="qwenish", messages=MSG, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=11, max_tokens=200, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_required_call_on_the_single_user_path(tmp_path):
    path = write_tiny_llama(tmp_path / "solo.gguf", seed=21, extra_metadata={"llama.context_length": 2048})
    server = ServerProcess(["--model", str(path), "--name", "solo", "--ctx-cap", "2048"],
                           env={"QWEN35_BATCH_SLOTS": "0"})
    try:
        solo = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = solo.chat.completions.create(model="solo", messages=MSG, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=3, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(r.choices[0].message.tool_calls[0])
    finally:
        server.stop()


def test_required_call_cut_by_a_stop_string_is_not_returned_half_made(client):
    """A stop string inside the call ends it after its opening streamed: the non-streaming answer
    holds no half-made call, only the error naming the announced call's index."""
    body = dict(model="qwenish", messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
                max_tokens=200, stop=["</parameter>"])
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert not choice.message.tool_calls
    err = choice.model_extra["tool_call_error"]
    assert err["code"] == "unfinished_call" and err["index"] == 0
    chunks = list(client.chat.completions.create(stream=True, **body))
    opened = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
    assert len(opened) == 1  # streamed before the cut, and flagged by the error's index
