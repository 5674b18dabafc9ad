"""Chat completions through the official `openai` client against a real hypercorn server."""

from __future__ import annotations

import httpx
import openai
import pytest

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy_text(client, max_tokens=24, **kw):
    r = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=max_tokens, **kw)
    return r


def test_non_streaming_greedy_answer_equals_the_offline_engine(client):
    r = greedy_text(client)
    assert r.object == "chat.completion"
    assert r.model == "smol"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    # The server's default (exact, batch-invariant) numerics: the same text `pantheon generate
    # --numerics exact --temperature 0` prints, ending at the model's end token.
    assert msg.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == 44
    extra = r.usage.model_extra
    assert extra["kv_cap"] == 4096 and extra["kv_used"] == 44
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_text_equals_non_streaming_text(client):
    full = greedy_text(client).choices[0].message.content
    stream = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_stop_string_is_never_emitted_even_across_tokens_and_chunks(client):
    full = greedy_text(client, max_tokens=16).choices[0].message.content
    stop = full[5:14]  # spans several tokens
    expected = full[:full.index(stop)]
    r = greedy_text(client, max_tokens=16, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=16,
                                            stream=True, stop=stop)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == expected
    assert all(stop not in p for p in pieces)


def test_seed_makes_sampling_reproducible_and_n_uses_seed_plus_i(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
              max_tokens=12)
    a = client.chat.completions.create(seed=123, n=2, **kw)
    b = client.chat.completions.create(seed=123, n=2, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    c1 = client.chat.completions.create(seed=124, **kw)  # choice 1 of seed 123 == choice 0 of seed 124
    assert c1.choices[0].message.content == a.choices[1].message.content


def test_n_above_8_is_capped_with_n_status(client):
    r = client.chat.completions.create(model="smol", messages=CAPITAL, max_tokens=1, n=9)
    assert len(r.choices) == 8
    assert r.model_extra["n_status"] == "capped_to_8"


def test_logprobs_have_token_logprob_bytes_and_top_alternatives(client):
    r = greedy_text(client, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_top_logprobs_is_clamped_to_20(smol_server):
    r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": CAPITAL, "max_tokens": 1, "logprobs": True, "top_logprobs": 50})
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_logit_bias_forces_a_token_and_skips_bad_entries(smol_server):
    body = {"model": "smol", "messages": CAPITAL, "max_tokens": 3, "temperature": 0,
            "logit_bias": {"19556": 100, "abc": 5, "12": "x"}}  # 19556 = "Hello"
    r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "HelloHelloHello"


def test_max_tokens_zero_means_512_and_alias_max_completion_tokens(smol_server):
    body = {"model": "smol", "messages": CAPITAL, "temperature": 0, "max_completion_tokens": 2}
    r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 2
    body = {"model": "smol", "messages": CAPITAL, "temperature": 0, "max_tokens": 3, "max_completion_tokens": 2}
    r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 3  # max_tokens wins


def test_missing_role_is_user_and_content_parts_read_as_their_text(smol_server):
    a = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smol", "temperature": 0, "max_tokens": 4, "messages": [{"content": "What is the capital of France?"}]})
    b = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smol", "temperature": 0, "max_tokens": 4, "messages": CAPITAL})
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    c = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    # Departure from the contract (an array read as empty): its text parts are joined (issue 12).
    d = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert c.status_code == 200
    assert c.json()["usage"]["prompt_tokens"] == d.json()["usage"]["prompt_tokens"]


def test_looping_decode_finishes_with_repetition_loop(client):
    r = client.chat.completions.create(model="smol", messages=CAPITAL, temperature=0, max_tokens=400,
                                       logit_bias={"19556": 100})  # "Hello" forever
    assert r.choices[0].finish_reason == "repetition_loop"
    assert r.usage.completion_tokens < 100
