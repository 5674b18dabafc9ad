"""Every default, clamp and alias of the chat request table, parsed in one place."""

from __future__ import annotations

import pytest

from pantheon.web.chat_request import parse_chat_request
from pantheon.web.errors import ApiError

M = [{"role": "user", "content": "hi"}]


def test_defaults():
    r = parse_chat_request({"messages": M})
    assert (r.temperature, r.top_p, r.top_k, r.max_tokens, r.n, r.stream) == (0.7, 0.95, 40, 1024, 1, False)
    assert r.stop == [] and r.seed is None and r.logit_bias == () and r.top_logprobs == 0
    assert r.enable_thinking is None and r.reasoning_budget is None and r.session_id is None


@pytest.mark.parametrize("value,expected", [(0, 512), (-5, 512), (7, 7), (10**9, 1048576)])
def test_max_tokens_nonpositive_is_512_and_clamped(value, expected):
    assert parse_chat_request({"messages": M, "max_tokens": value}).max_tokens == expected


def test_max_completion_tokens_alias_and_max_tokens_wins():
    assert parse_chat_request({"messages": M, "max_completion_tokens": 9}).max_tokens == 9
    assert parse_chat_request({"messages": M, "max_completion_tokens": 9, "max_tokens": 3}).max_tokens == 3


def test_penalties_bias_and_top_logprobs_are_clamped():
    r = parse_chat_request({"messages": M, "presence_penalty": 5, "frequency_penalty": -9, "top_logprobs": 99,
                            "logit_bias": {"5": 500, "6": -500, "x": 1, "7": "y", " 8 ": 1.5}})
    assert r.presence_penalty == 2.0 and r.frequency_penalty == -2.0 and r.top_logprobs == 20
    assert r.logit_bias == ((5, 100.0), (6, -100.0), (8, 1.5))


def test_n_is_capped_to_8_with_status():
    r = parse_chat_request({"messages": M, "n": 20})
    assert r.n == 8 and r.n_status == "capped_to_8"
    assert parse_chat_request({"messages": M, "n": 0}).n == 1


def test_stop_string_or_list():
    assert parse_chat_request({"messages": M, "stop": "x"}).stop == ["x"]
    assert parse_chat_request({"messages": M, "stop": ["a", "", "b"]}).stop == ["a", "b"]
    with pytest.raises(ApiError):
        parse_chat_request({"messages": M, "stop": 3})


def test_reasoning_format_llama_servers_names():
    assert parse_chat_request({"messages": M}).reasoning_format == "auto"
    for name in ("auto", "deepseek", "none"):
        assert parse_chat_request({"messages": M, "reasoning_format": name}).reasoning_format == name


def test_reasoning_budget_alias_and_precedence():
    assert parse_chat_request({"messages": M, "max_reasoning_tokens": 5}).reasoning_budget == 5
    assert parse_chat_request({"messages": M, "max_reasoning_tokens": 5, "reasoning_budget": 2}).reasoning_budget == 2


def test_session_id_resolution_order():
    body = {"messages": M, "session_id": "a", "prompt_cache_key": "b", "promptCacheKey": "c"}
    assert parse_chat_request(body, "d").session_id == "a"
    del body["session_id"]
    assert parse_chat_request(body, "d").session_id == "b"
    del body["prompt_cache_key"]
    assert parse_chat_request(body, "d").session_id == "c"
    del body["promptCacheKey"]
    assert parse_chat_request(body, "d").session_id == "d"


def test_messages_missing_role_is_user_and_content_parts_are_joined():
    # Departure from the contract (which reads an array as empty), deliberate and additive: the
    # text parts of an array are joined in order, as llama-server does (issue 12).
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    r = parse_chat_request({"messages": [{"content": "x"}, {"role": "user", "content": parts}]})
    assert r.messages[0]["role"] == "user" and r.messages[1]["content"] == "ab"
    with pytest.raises(ApiError) as e:  # a text part without text is malformed
        parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert e.value.status == 400 and "messages[0].content[0].text" in e.value.message


@pytest.mark.parametrize("body", [None, [], "x", {}, {"messages": []}, {"messages": [3]},
                                  {"messages": M, "temperature": "x"}, {"messages": M, "top_k": True},
                                  {"messages": M, "enable_thinking": "yes"},
                                  {"messages": M, "reasoning_format": "deepseek-legacy"},
                                  {"messages": M, "reasoning_format": 1}])
def test_invalid_bodies_raise_400(body):
    with pytest.raises(ApiError) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
