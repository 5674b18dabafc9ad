"""The hybrid qwen35moe model served over HTTP: completions, sessions, export/restore, residency."""

from __future__ import annotations

import httpx
import pytest

from tests.web.server import ServerProcess

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hybrid_server(qwen35moe_f32_gguf):
    path = qwen35moe_f32_gguf
    server = ServerProcess(["--model", str(path), "--name", "q35", "--ctx-cap", "256", "--max-sessions", "2"])
    yield server
    server.stop()


def chat(url, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8,
            "logprobs": True, **kw}
    r = httpx.post(url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_hybrid_model_serves_stream_and_non_stream_identically(hybrid_server):
    full = chat(hybrid_server.url, "hello")
    r = httpx.post(hybrid_server.url + CHAT, timeout=120, json={
        "messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 8, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert full["usage"]["completion_tokens"] == 8


def test_hybrid_session_export_restore_round_trip(hybrid_server):
    url = hybrid_server.url
    first = chat(url, "hello", session_id="hy-1")
    exported = httpx.post(url + "/admin/session/export", json={"session_id": "hy-1"}).json()
    assert exported["n_tok"] == first["usage"]["kv_used"]  # prompt + fed tokens (the last sampled one is not)
    httpx.post(url + "/session/release", json={"session_id": "hy-1"})
    r = httpx.post(url + "/session/restore", json={"session_id": "hy-2", "blob": exported["blob_b64"],
                                                   "tokens": exported["tokens"]})
    assert r.json()["restored"] is True
    admin = httpx.get(url + "/admin/models").json()["data"][0]
    assert admin["attention"]["total"] == 1 and admin["attention"]["host"] == 0  # one attention layer of four
    assert admin["graphs"]["failed"] == 0
