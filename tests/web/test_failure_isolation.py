"""A failure stays inside the request that caused it (in process, Quart's test client, tiny model):
a failed device step answers its own request with server_error and the next one is served; a
hostile sampling value beside a normal request leaves the normal one byte-identical to its solo run."""

from __future__ import annotations

import asyncio

import pytest

from pantheon.faults import FAULTS
from tests.web.inprocess import tiny_app

CHAT = "/v1/chat/completions"
NO_END = {"0": -100, "2": -100}  # the tiny vocabulary's end-of-generation ids


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "iso", max_concurrent=4, max_sessions=4)
    yield server
    server.close()


def body(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 12, "logit_bias": NO_END, "logprobs": True, **kw}


def test_a_failed_step_answers_500_server_error_and_the_next_request_is_served(app):
    FAULTS.set("step", 1)
    status, err, _ = app.post(CHAT, body("fail me"))
    assert status == 500 and err["error"]["type"] == "server_error"
    status, ok, _ = app.post(CHAT, body("serve me"))
    assert status == 200 and ok["choices"][0]["finish_reason"] == "length"


def test_a_failed_step_in_a_stream_ends_it_with_an_error_event(app):
    FAULTS.set("step", 1)
    status, events = app.stream(CHAT, body("fail my stream"))
    assert status == 200 and events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["type"] == "server_error"
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                if c.get("finish_reason")]
    assert finishes == ["stop"]
    assert app.post(CHAT, body("after"))[0] == 200


def test_a_session_outside_the_failed_step_resumes_from_its_cache(app):
    msgs = [{"role": "user", "content": "remember me"}]
    status, first, _ = app.post(CHAT, {**body(""), "messages": msgs, "session_id": "s1"})
    assert status == 200
    FAULTS.set("step", 1)
    assert app.post(CHAT, body("collateral"))[0] == 500
    reply = first["choices"][0]["message"]["content"]
    turn2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    status, second, _ = app.post(CHAT, {**body(""), "messages": turn2, "session_id": "s1"})
    assert status == 200
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


@pytest.mark.parametrize("hostile", [{"top_k": 2147483648}, {"top_k": -5, "top_p": 40.0},
                                     {"temperature": 1e300, "presence_penalty": 1e30},
                                     {"top_logprobs": 10**9, "seed": 2**70}])
def test_a_hostile_neighbour_leaves_a_normal_request_byte_identical(app, hostile):
    # The normal request keeps one session, so its slot is its own (an anonymous neighbour never takes
    # it) and every run after the first reuses its cached prompt. Without it, which slot and how much
    # cached prefix it gets depended on which request was admitted first (the hostile one may take the
    # slot that shares the chat template's tokens), and a prompt prefilled in other chunks computes
    # its first token's logits in another summation order (~1e-3 apart in its logprob).
    normal = body("a normal request", max_tokens=24, temperature=0.8, seed=7, top_k=40,
                  session_id=f"iso-{sorted(hostile)}")
    assert app.post(CHAT, normal)[0] == 200  # the session's first turn: its prompt is cached after
    status, alone, _ = app.post(CHAT, normal)
    assert status == 200 and alone["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    async def side_by_side():
        hostile_req = app.client.post(CHAT, json=body("hostile", max_tokens=40, **{"temperature": 1.0, **hostile}))
        normal_req = app.client.post(CHAT, json=normal)
        results = await asyncio.gather(hostile_req, normal_req)
        return [(r.status_code, await r.get_json()) for r in results]

    (h_status, h_body), (n_status, together) = app.run(side_by_side())
    assert h_status == 200, h_body
    assert n_status == 200
    assert together["usage"] == alone["usage"]  # the same cached prefix
    assert together["choices"][0]["message"] == alone["choices"][0]["message"]
    assert together["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
