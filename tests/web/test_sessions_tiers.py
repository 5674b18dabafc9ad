"""Sessions keep what the contract promises, through a real server: several conversations under one
id each resume from cache; idle sessions move to the host tier instead of locking the model out or
losing their KV (a new id and an anonymous request are both served, the moved session stays
exportable and its next turn is cached); the host tier's bound drops the least recently used;
restore checks the tokens against the blob's digest."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess
from tests.web.test_batching_sessions import ask
from tests.web.test_http_errors import check_error

HI = [{"role": "user", "content": "Hi there"}]  # SmolLM2 answers in ~10 tokens and stops
TITLE = [{"role": "system", "content": "Generate a short title for the conversation."}, *HI]


@pytest.fixture(scope="module")
def server(smollm2_path):
    server = ServerProcess(["--model", str(smollm2_path), "--name", "smol", "--max-sessions", "4",
                            "--max-concurrent", "4", "--ctx-cap", "512"])
    yield server
    server.stop()


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def spent(resp) -> int:
    """Prompt + completion of a turn that stopped by itself: all of it is in the KV."""
    assert resp["choices"][0]["finish_reason"] == "stop"
    return resp["usage"]["prompt_tokens"] + resp["usage"]["completion_tokens"]


def follow_up(msgs, resp, content):
    return msgs + [{"role": "assistant", "content": resp["choices"][0]["message"]["content"]},
                   {"role": "user", "content": content}]


def sessions_row(url) -> dict:
    return httpx.get(url + "/admin/models").json()["data"][0]["sessions"]


def export(url, sid, name=None):
    return httpx.post(url + "/admin/session/export", json={"session_id": sid, **({"name": name} if name else {})})


def release(url, *sids, name=None):
    for sid in sids:
        httpx.post(url + "/session/release", json={"session_id": sid, **({"name": name} if name else {})})


def test_two_conversations_under_one_id_both_resume_from_cache(server):
    url = server.url
    a1 = ask(url, "", messages=HI, session_id="oc-1", max_tokens=40)
    b1 = ask(url, "", messages=TITLE, session_id="oc-1", max_tokens=40)  # opencode's title request
    a2 = ask(url, "", messages=follow_up(HI, a1, "What is 2 + 2?"), session_id="oc-1", max_tokens=8)
    b2 = ask(url, "", messages=follow_up(TITLE, b1, "Shorter, please."), session_id="oc-1", max_tokens=8)
    assert cached(a2) >= spent(a1) and cached(b2) >= spent(b1)
    assert not any("session_conflict" in r["usage"] for r in (a1, b1, a2, b2))
    row = sessions_row(url)
    assert row["live"] == 1 and row["on_device"] == 1  # one id, however many conversations
    release(url, "oc-1")


def test_a_fifth_session_with_four_idle_is_served_and_the_moved_one_resumes_in_full(server):
    url = server.url
    first = ask(url, "", messages=HI, session_id="cap-0", max_tokens=40)
    for i in range(1, 4):
        ask(url, f"Count to {i}.", session_id=f"cap-{i}", max_tokens=4)
    fifth = ask(url, "Count to 5.", session_id="cap-4", max_tokens=4)  # was 429 model_at_session_capacity
    assert fifth["usage"]["completion_tokens"] == 4
    row = sessions_row(url)
    assert row["on_device"] == 4 and row["on_host"] == 1 and row["host_bytes"] > 0
    exported = export(url, "cap-0")  # the least recently used went to the host: still exportable
    assert exported.status_code == 200 and exported.json()["n_tok"] == spent(first)
    resumed = ask(url, "", messages=follow_up(HI, first, "What is 2 + 2?"), session_id="cap-0", max_tokens=4)
    assert cached(resumed) >= spent(first)  # nothing lost, no re-prefill
    assert sessions_row(url)["fills"] >= 1
    release(url, *(f"cap-{i}" for i in range(5)))


def test_an_anonymous_request_at_capacity_leaves_every_session_exportable(server):
    url = server.url
    sids = [f"anon-{i}" for i in range(4)]
    prompts = [f"Name a color, {i}." for i in range(4)]
    firsts = [ask(url, p, session_id=sid, max_tokens=4) for p, sid in zip(prompts, sids)]
    ask(url, "Who wrote Hamlet?", max_tokens=4)  # no session id: every slot is held by a live session
    assert sessions_row(url)["on_host"] == 1
    for sid in sids:
        r = export(url, sid)
        assert r.status_code == 200 and r.json()["n_tok"] > 0
    for p, sid, first in zip(prompts, sids, firsts):  # the same prompt again: all of it but the last token
        again = ask(url, p, session_id=sid, max_tokens=2)
        assert cached(again) == first["usage"]["prompt_tokens"] - 1
    release(url, *sids)


def test_restore_refuses_tokens_the_blob_was_not_exported_with(server):
    url = server.url
    ask(url, "Who wrote Hamlet?", session_id="dig-1", max_tokens=3)
    exported = export(url, "dig-1").json()
    tokens = exported["tokens"]
    body = {"session_id": "dig-2", "blob": exported["blob_b64"]}
    altered = tokens[:-1] + [(tokens[-1] + 1) % 1000]  # same length, one id changed
    r = httpx.post(url + "/session/restore", json={**body, "tokens": altered})
    assert "exported with" in check_error(r, 400, "bad_session_blob")["message"]
    assert tokens[0] == 1  # <|im_start|>: `true` would pass for it if bool were accepted as int
    check_error(httpx.post(url + "/session/restore", json={**body, "tokens": [True] + tokens[1:]}),
                400, "bad_session_blob")
    check_error(httpx.post(url + "/session/restore", json={**body, "tokens": [1.0] + tokens[1:]}),
                400, "bad_session_blob")
    ok = httpx.post(url + "/session/restore", json={**body, "tokens": tokens})
    assert ok.json() == {"restored": True, "session_id": "dig-2", "n_tok": len(tokens)}
    blob = base64.b64decode(exported["blob_b64"])
    assert b'"tokens_sha256"' in blob[:4096]
    release(url, "dig-1", "dig-2")


# ---- the host tier's bound --------------------------------------------------------------------------
def test_the_host_tier_bound_drops_the_least_recently_used_session(tmp_path):
    # tiny llama: 2 layers x (k, v) x 2 heads x 16 x f32 = 512 B/token, 64 positions per parked
    # conversation = 32 KiB: the 80 000-byte tier holds two (an f32 cache, named: the CPU's default is f16).
    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)
    srv = ServerProcess(["--model", str(path), "--name", "tiny", "--max-sessions", "1", "--max-concurrent", "1",
                         "--ctx-cap", "128", "--kv-dtype", "f32"], env={"PN_SESSION_HOST_BYTES": "80000"})
    try:
        url = srv.url

        def turn(sid, content):
            return ask(url, content, model="tiny", session_id=sid, max_tokens=4, logprobs=False,
                       logit_bias={"0": -100, "2": -100})

        firsts = {sid: turn(sid, f"session {sid} says hello") for sid in ("h1", "h2", "h3", "h4")}
        row = sessions_row(url)
        per = row["host_bytes"] // 2
        assert row["host_bytes_limit"] == 80000 and 2 * per <= 80000 < 3 * per
        assert row["on_host"] == 2 and row["host_dropped"] == 1 and row["live"] == 4
        check_error(export(url, "h1"), 404, "session_not_found")  # dropped: nothing cached to export
        assert export(url, "h2").status_code == 200
        h3 = turn("h3", "session h3 says hello")  # on the host: resumes
        assert cached(h3) == firsts["h3"]["usage"]["prompt_tokens"] - 1
        h1 = turn("h1", "session h1 says hello")  # dropped: re-prefills (but for a shared template head)
        assert cached(h1) < firsts["h1"]["usage"]["prompt_tokens"] - 1
    finally:
        srv.stop()
