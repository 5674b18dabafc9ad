"""The newer APIs through the real SDKs against a real server (the default model, greedy, exact
numerics): OpenAI Responses (`responses.create`, streamed, a required function tool,
previous_response_id chains, retrieve/delete), Anthropic Messages (`messages.create`, `.stream`,
`count_tokens`, tool use and results), legacy `completions.create`, `embeddings.create`, and
llama-server's /tokenize and /detokenize."""

from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # SmolLM2 greedy under exact numerics (test_chat_openai_client)
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"]}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(smol_server):
    return anthropic.Anthropic(base_url=smol_server.url, api_key="none", max_retries=0, timeout=120)


# ---- OpenAI Responses ------------------------------------------------------------------------------
def test_responses_create_answers_like_chat(oai):
    r = oai.responses.create(model="smol", input=QUESTION, max_output_tokens=24, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == ANSWER
    (item,) = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert r.usage.input_tokens == 37 and r.usage.output_tokens == 7 and r.usage.total_tokens == 44


def test_input_tokens_count_what_a_create_prefills(oai, smol_server):
    """OpenAI's responses.input_tokens.count, and llama-server's chat twin, count the prompt a
    create with the same body prefills (37 tokens for QUESTION under SmolLM2's template)."""
    counted = oai.responses.input_tokens.count(model="smol", input=QUESTION)
    assert counted.object == "response.input_tokens" and counted.input_tokens == 37
    with_tool = oai.responses.input_tokens.count(model="smol", input=QUESTION, tools=[WEATHER_TOOL],
                                                 instructions="Be brief.")
    assert with_tool.input_tokens > 37  # the tool's schema and the instructions are rendered
    chat = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}]}
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        r = httpx.post(smol_server.url + path, json=chat, timeout=60)
        assert r.status_code == 200 and r.json() == {"object": "response.input_tokens", "input_tokens": 37}, r.text
    r = httpx.post(smol_server.url + "/v1/chat/completions/input_tokens", json={"model": "smol", "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_responses_max_output_tokens_is_incomplete(oai):
    r = oai.responses.create(model="smol", input=QUESTION, max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_responses_stream_event_sequence(oai):
    events = list(oai.responses.create(model="smol", input=QUESTION, max_output_tokens=24, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ANSWER == events[-1].response.output_text
    assert events[0].response.id == events[-1].response.id


def test_responses_required_function_tool(oai):
    r = oai.responses.create(model="smol", input="What is the weather in Paris? Use the tool.", tools=[WEATHER_TOOL],
                             tool_choice="required", max_output_tokens=64, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert calls[0].call_id and calls[0].id.startswith("fc_") and r.status == "completed"
    with oai.responses.stream(model="smol", input="What is the weather in Paris? Use the tool.",
                              tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=64, **GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert streamed.arguments == calls[0].arguments and streamed.name == "get_weather"


def test_responses_previous_response_id_reuses_the_prefix(oai):
    first = oai.responses.create(model="smol", input=QUESTION, max_output_tokens=24, **GREEDY)
    second = oai.responses.create(model="smol", input="And of Germany?", previous_response_id=first.id,
                                  max_output_tokens=24, **GREEDY)
    assert "Berlin" in second.output_text
    third = oai.responses.create(model="smol", input="And of Italy?", previous_response_id=second.id,
                                 max_output_tokens=24, **GREEDY)
    assert "Rome" in third.output_text
    # the chain is bound to a session: the third turn prefills only what follows the second
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens + second.usage.output_tokens - 1
    assert oai.responses.retrieve(third.id).output_text == third.output_text
    oai.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="smol", input="x", previous_response_id=third.id)


def test_responses_function_call_output_round_trip(oai):
    r = oai.responses.create(model="smol", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "WEATHER-7f3a: sunny"}],
        tools=[WEATHER_TOOL], max_output_tokens=32, **GREEDY)
    assert r.status in ("completed", "incomplete") and "WEATHER-7f3a" in r.output_text


def test_responses_bad_input_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smol", input=[{"type": "input_image_call"}])
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="smol", input=[{"role": "user", "content": [{"type": "input_image",
                                                                                 "image_url": "x"}]}])


# ---- Anthropic Messages ----------------------------------------------------------------------------
def test_messages_create_answers_like_chat(claude):
    m = claude.messages.create(model="smol", max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ANSWER
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == 37 and m.usage.output_tokens == 7


def test_messages_stop_reasons(claude):
    m = claude.messages.create(model="smol", max_tokens=3, messages=[{"role": "user", "content": QUESTION}],
                               extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    m = claude.messages.create(model="smol", max_tokens=24, stop_sequences=["Paris"],
                               messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert m.content[0].text == "The capital of France is "


def test_messages_stream(claude):
    with claude.messages.stream(model="smol", max_tokens=24, system="You are a helpful assistant.",
                                messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn" and final.usage.output_tokens == 7


def test_count_tokens_matches_what_a_request_prefills(claude):
    messages = [{"role": "user", "content": QUESTION}]
    n = claude.messages.count_tokens(model="smol", system="Be brief.", messages=messages).input_tokens
    m = claude.messages.create(model="smol", max_tokens=2, system="Be brief.", messages=messages, extra_body=GREEDY)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_messages_tool_use_then_result_reuses_the_prefix(claude):
    tools = [{"name": "get_weather", "description": "Current weather for a city.",
              "input_schema": WEATHER_TOOL["parameters"]}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model="smol", max_tokens=64, tools=tools, tool_choice={"type": "any"}, messages=ask,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "WEATHER-7f3a: sunny"}]}]
    m2 = claude.messages.create(model="smol", max_tokens=32, tools=tools, messages=follow, extra_body=GREEDY)
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.content and m2.content[0].type == "text"


def test_messages_errors_are_in_anthropics_shape(claude, smol_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smol", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "'max_tokens' is required: a positive integer"}}
    r = httpx.post(smol_server.url + "/v1/messages?beta=true", json={"model": "smol", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]},
        headers={"anthropic-version": "2023-06-01", "x-api-key": "anything"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "text only" in r.json()["error"]["message"]


# ---- legacy completions ----------------------------------------------------------------------------
def test_completions_create(oai):
    r = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=4, logprobs=2, **GREEDY)
    (c,) = r.choices
    assert r.object == "text_completion" and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) == lp.token_logprobs[i] for i, t in enumerate(lp.top_logprobs))
    echoed = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=4, echo=True,
                                    **GREEDY)
    assert echoed.choices[0].text == "The capital of France is" + c.text
    # the prompt scored, as lm-evaluation-harness asks for a log-likelihood: echo, logprobs, max_tokens 0
    scored = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=0, echo=True,
                                    logprobs=1, **GREEDY).choices[0]
    assert scored.text == "The capital of France is" and scored.finish_reason == "length"
    slp = scored.logprobs
    assert slp.token_logprobs[0] is None and len(slp.tokens) == len(slp.token_logprobs) == 5
    assert all(v <= 0 for v in slp.token_logprobs[1:]) and all(len(t) == 1 for t in slp.top_logprobs[1:])
    streamed = oai.completions.create(model="smol", prompt="The capital of France is", max_tokens=4, stream=True,
                                      **GREEDY)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text


def test_completions_several_prompts_and_token_ids(oai, smol_server):
    ids = httpx.post(smol_server.url + "/tokenize", json={"content": "The capital of France is", "model": "smol"}).json()["tokens"]
    r = oai.completions.create(model="smol", prompt=["The capital of France is", ids], max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # the same prompt, greedy: the same text four times
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="smol", prompt="x", suffix="y", max_tokens=2)  # no FIM tokens in SmolLM2


# ---- embeddings and tokenize -----------------------------------------------------------------------
def test_embeddings_create(oai):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue grew by 8 percent."]
    r = oai.embeddings.create(model="smol", input=texts, encoding_format="float")
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, 576) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]  # the two sentences about a cat are closest
    assert r.usage.prompt_tokens == r.usage.total_tokens > 3
    b64 = oai.embeddings.create(model="smol", input=texts[0])  # the SDK asks for base64 by default
    assert np.abs(np.array(b64.data[0].embedding) - v[0]).max() < 1e-6
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="smol", input="x", dimensions=8)


def test_tokenize_and_detokenize(smol_server):
    url = smol_server.url
    r = httpx.post(url + "/tokenize", json={"content": "Hello world é", "with_pieces": True, "model": "smol"}).json()
    assert [t["piece"] for t in r["tokens"]] == ["Hello", " world", " é"]
    ids = [t["id"] for t in r["tokens"]]
    assert httpx.post(url + "/tokenize", json={"content": "Hello world é", "model": "smol"}).json() == {"tokens": ids}
    assert httpx.post(url + "/detokenize", json={"tokens": ids, "model": "smol"}).json() == {"content": "Hello world é"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9], "model": "smol"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
