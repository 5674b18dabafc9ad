"""Continuous batching and sessions through a real server: batch invariance, queueing, prefix cache,
session capacity, export/restore, watch and idle reaping."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import BackgroundStream, ServerProcess, watching
from tests.web.test_http_errors import check_error

CHAT = "/v1/chat/completions"
NO_END = {"0": -100, "2": -100, "4": -100}
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 2 + 2?", "Say hello in Spanish.", "Who wrote Hamlet?", "What is water made of?",
           "Tell me a joke."]


@pytest.fixture(scope="module")
def batch_server(smollm2_path):
    server = ServerProcess(["--model", str(smollm2_path), "--name", "smol", "--max-concurrent", "8",
                            "--max-sessions", "8", "--ctx-cap", "512"])
    yield server
    server.stop()


def ask(url, content, **kw):
    body = {"model": "smol", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 24, "logprobs": True, **kw}
    r = httpx.post(url + CHAT, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(resp) -> list[str]:
    return [t["token"] for t in resp["choices"][0]["logprobs"]["content"]]


def test_eight_concurrent_greedy_requests_equal_eight_sequential_runs(batch_server):
    alone = [tokens_of(ask(batch_server.url, p)) for p in PROMPTS]
    together: list = [None] * 8
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        together[i] = tokens_of(ask(batch_server.url, PROMPTS[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone
    row = httpx.get(batch_server.url + "/v1/models").json()["data"][0]
    assert row["max_concurrent"] == 8
    g = httpx.get(batch_server.url + "/admin/models").json()["data"][0]["graphs"]
    assert g["live"] >= 2 and g["failed"] == 0  # decode executables for more than one batch bucket


def test_second_turn_reuses_the_first_turn_from_the_prefix_cache(batch_server):
    msgs = [{"role": "user", "content": "Hi there"}]
    first = ask(batch_server.url, "", messages=msgs, session_id="conv-1", max_tokens=40)
    assert first["choices"][0]["finish_reason"] == "stop"  # a natural end: the whole turn is in KV
    msgs2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "What is the capital of France?"}]
    warm = ask(batch_server.url, "", messages=msgs2, session_id="conv-1")
    u1, u2 = first["usage"], warm["usage"]
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"]
    assert u2["kv_used"] == u2["prompt_tokens"] + u2["completion_tokens"]
    cold = ask(batch_server.url, "", messages=msgs2)  # no session id
    assert tokens_of(cold) == tokens_of(warm)


def test_prompt_cache_key_alias_and_header_select_the_session(batch_server):
    msgs = [{"role": "user", "content": "Say hello in Spanish."}]
    a = ask(batch_server.url, "", messages=msgs, prompt_cache_key="alias-1", max_tokens=4)
    b = httpx.post(batch_server.url + CHAT, headers={"X-Session-Id": "alias-1"}, timeout=120,
                   json={"model": "smol", "messages": msgs, "temperature": 0, "max_tokens": 4}).json()
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens"] - 1


def test_export_release_restore_continues_exactly(batch_server):
    url = batch_server.url
    msgs = [{"role": "user", "content": "Name three colors."}]
    turn1 = ask(url, "", messages=msgs, session_id="exp-1", max_tokens=40)
    exported = httpx.post(url + "/admin/session/export", json={"session_id": "exp-1"}).json()
    assert exported["session_id"] == "exp-1" and exported["n_tok"] == len(exported["tokens"]) > 0
    assert exported["blob_bytes"] == len(base64.b64decode(exported["blob_b64"]))
    assert isinstance(exported["weights_version"], int)
    assert httpx.post(url + "/session/release", json={"session_id": "exp-1"}).json()["released"]
    check_error(httpx.post(url + "/admin/session/export", json={"session_id": "exp-1"}), 404, "session_not_found")
    restored = httpx.post(url + "/session/restore", json={"session_id": "exp-1", "blob": exported["blob_b64"],
                                                          "tokens": exported["tokens"]})
    assert restored.json() == {"restored": True, "session_id": "exp-1", "n_tok": exported["n_tok"]}
    msgs2 = msgs + [{"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And three animals?"}]
    resumed = ask(url, "", messages=msgs2, session_id="exp-1")
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == exported["n_tok"]
    assert tokens_of(resumed) == tokens_of(ask(url, "", messages=msgs2))


def test_restore_rejects_tampered_blobs_and_bad_tokens(batch_server):
    url = batch_server.url
    ask(url, "", messages=[{"role": "user", "content": "Who wrote Hamlet?"}], session_id="tamper", max_tokens=3)
    exported = httpx.post(url + "/admin/session/export", json={"session_id": "tamper"}).json()
    raw = bytearray(base64.b64decode(exported["blob_b64"]))
    raw[100] ^= 0xFF
    tampered = base64.b64encode(bytes(raw)).decode()
    body = {"session_id": "t2", "tokens": exported["tokens"]}
    check_error(httpx.post(url + "/session/restore", json={**body, "blob": tampered}), 400, "bad_session_blob")
    check_error(httpx.post(url + "/session/restore", json={**body, "blob": "%%%not base64"}), 400, "bad_session_blob")
    check_error(httpx.post(url + "/session/restore", json={**body, "blob": exported["blob_b64"],
                                                           "tokens": exported["tokens"][:-1]}),
                400, "bad_session_blob")


def test_export_of_a_session_with_a_turn_in_flight_is_429_session_busy(batch_server):
    url = batch_server.url
    ask(url, "", messages=[{"role": "user", "content": "Hi"}], session_id="busy-1", max_tokens=2)
    turn = BackgroundStream(url, {"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                                  "session_id": "busy-1", "max_tokens": 60, "logit_bias": NO_END})
    assert turn.started.wait(60)
    check_error(httpx.post(url + "/admin/session/export", json={"session_id": "busy-1"}), 429, "session_busy")
    turn.join()


# ---- a small server: two sessions, a queue of one, short TTL and watch grace ----------------------------
@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return write_tiny_llama(d / "a.gguf", seed=1), write_tiny_llama(d / "b.gguf", seed=2)


@pytest.fixture(scope="module")
def small_server(tiny_paths, smollm2_path):
    a, b = tiny_paths
    server = ServerProcess(["--model", str(a), "--name", "tinyA", "--model", str(b), "--name", "tinyB",
                            "--model", str(smollm2_path), "--name", "smolq",  # slow enough to queue behind
                            "--max-sessions", "2", "--max-concurrent", "1", "--ctx-cap", "128"],
                           env={"BS_QUEUE_DEPTH": "1", "PN_SESSION_IDLE_TTL_MS": "1500",
                                "PN_SESSION_WATCH_GRACE_MS": "1000"}, wait_models=3)
    yield server
    server.stop()


def tiny(url, model, session=None, max_tokens=4, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": max_tokens,
            "temperature": 0, "logit_bias": {"0": -100, "2": -100}, **kw}
    if session:
        body["session_id"] = session
    return httpx.post(url + CHAT, json=body, timeout=120)


def test_queue_overflow_is_429_server_busy_with_retry_after(small_server):
    url, done = small_server.url, []
    running = BackgroundStream(url, {"model": "smolq", "messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": 90, "logit_bias": NO_END})
    assert running.started.wait(60)
    queued = threading.Thread(target=lambda: done.append(tiny(url, "smolq").status_code))
    queued.start()  # waits in the queue of depth 1
    time.sleep(0.3)
    r = tiny(url, "smolq")
    check_error(r, 429, "server_busy")
    assert r.headers["retry-after"] == "1"
    running.join()
    queued.join(120)
    assert 200 in done  # the queued request ran once the slot freed


def test_new_session_over_max_sessions_is_429_while_the_sessions_are_watched(small_server):
    # Idle sessions no longer lock a model out (a client that opens an id per run and never
    # releases it used to get this 429 for the 12 h TTL): the least recently used idle one moves to
    # the host tier and the new id is served (tests/web/test_sessions_tiers.py). The 429 stays for
    # sessions that cannot move: busy, or held by /session/watch.
    url = small_server.url
    # compile tinyB's programs first, so that cap-1 cannot idle past the 1.5 s TTL while cap-2's
    # request compiles (on a loaded machine)
    assert tiny(url, "tinyB").status_code == 200
    assert tiny(url, "tinyB", "cap-1").status_code == 200
    assert tiny(url, "tinyB", "cap-2").status_code == 200
    with watching(url, "cap-1", "tinyB"), watching(url, "cap-2", "tinyB"):
        r = tiny(url, "tinyB", "cap-3")
        err = check_error(r, 429, "model_at_session_capacity")
        assert r.headers["retry-after"] == "30" and "re-prefill" in err["message"]
        assert tiny(url, "tinyB", "cap-1").status_code == 200  # an existing id still works
    assert tiny(url, "tinyB", "cap-3").status_code == 200  # unwatched (or reaped): no lock-out
    for sid in ("cap-1", "cap-2", "cap-3"):
        httpx.post(url + "/session/release", json={"name": "tinyB", "session_id": sid})


def test_restore_of_a_blob_from_other_weights_is_409(small_server):
    url = small_server.url
    assert tiny(url, "tinyA", "w-1").status_code == 200
    exported = httpx.post(url + "/admin/session/export", json={"name": "tinyA", "session_id": "w-1"}).json()
    r = httpx.post(url + "/session/restore", json={"name": "tinyB", "session_id": "w-1",
                                                   "blob": exported["blob_b64"], "tokens": exported["tokens"]})
    check_error(r, 409, "weights_version_mismatch")
    httpx.post(url + "/session/release", json={"name": "tinyA", "session_id": "w-1"})


def test_idle_session_is_reaped_after_the_ttl_unless_watched(small_server):
    url = small_server.url
    export = lambda sid: httpx.post(url + "/admin/session/export", json={"name": "tinyA", "session_id": sid})
    assert tiny(url, "tinyA", "idle-1").status_code == 200
    assert tiny(url, "tinyA", "watched-1").status_code == 200
    with httpx.stream("GET", url + "/session/watch", params={"session_id": "watched-1", "name": "tinyA"},
                      timeout=30) as watch:
        assert watch.status_code == 200 and watch.headers["content-type"].startswith("text/event-stream")
        lines = watch.iter_lines()  # keep the iterator: dropping it closes the connection
        assert next(lines) == ": watch established"
        time.sleep(3.0)  # past the 1.5 s TTL
        check_error(export("idle-1"), 404, "session_not_found")
        assert export("watched-1").status_code == 200  # held by the watch
    time.sleep(0.3)
    assert export("watched-1").status_code == 200  # within the 1 s grace
    time.sleep(2.5)
    check_error(export("watched-1"), 404, "session_not_found")


def test_watch_errors(small_server):
    check_error(httpx.get(small_server.url + "/session/watch"), 400, "invalid_request_error")
    check_error(httpx.get(small_server.url + "/session/watch", params={"session_id": "s", "name": "nope"}),
                404, "model_not_found")


# ---- the single-user path ---------------------------------------------------------------------------------
def test_single_user_path_answers_429_at_once_and_advertises_1(smollm2_path):
    # SmolLM2, not a tiny model: its 100 tokens take ~1 s, so the turn is surely still in flight when
    # the second request comes (a tiny model could finish them first, and then rightly answer 200)
    server = ServerProcess(["--model", str(smollm2_path), "--name", "solo", "--ctx-cap", "256"],
                           env={"QWEN35_BATCH_SLOTS": "0"})
    try:
        url = server.url
        models = httpx.get(url + "/v1/models").json()["data"][0]
        admin = httpx.get(url + "/admin/models").json()["data"][0]
        assert models["max_concurrent"] == 1 and admin["max_concurrent_configured"] == 4

        running = BackgroundStream(url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
                                         "logit_bias": {"0": -100, "2": -100}})
        assert running.started.wait(60)
        check_error(tiny(url, "solo"), 429, "server_busy")
        running.join()
        assert tiny(url, "solo").status_code == 200
    finally:
        server.stop()
