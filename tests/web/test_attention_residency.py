"""Attention residency: a layer whose device KV allocation fails attends on the host with the same
tokens, shows up as `host` with its reason, heals on the retry backoff, or gives up."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess

MSG = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def fallback_server(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("att") / "t.gguf", n_layer=3, seed=4)
    # The first model's three layers fail their allocation at load; the retry 1 s later succeeds.
    server = ServerProcess(["--model", str(path), "--name", "faulty", "--model", str(path), "--name", "clean",
                            "--ctx-cap", "128"],
                           env={"PANTHEON_FAULTS": "kv_alloc=3", "PN_KV_RETRY_BUDGET": "3",
                                "PANTHEON_TEST_HOOKS": "1"}, wait_models=2)
    server.path = path
    yield server
    server.stop()


def tokens(server, model):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": MSG, "temperature": 0, "max_tokens": 10, "logprobs": True,
        "logit_bias": {"0": -100, "2": -100}})
    assert r.status_code == 200, r.text
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def attention(server, model):
    rows = httpx.get(server.url + "/admin/models").json()["data"]
    return next(r for r in rows if r["id"] == model).get("attention")


def test_host_fallback_gives_the_same_tokens_and_heals(fallback_server):
    got, ref = tokens(fallback_server, "faulty"), tokens(fallback_server, "clean")
    assert got == ref
    a = attention(fallback_server, "faulty")
    if a["host"]:  # read before the retry moved them back
        assert a["ondie"] + a["host"] == a["total"] == 3 and a["reasons"] == {"ring_alloc_failed": a["host"]}
    public = [m for m in httpx.get(fallback_server.url + "/v1/models").json()["data"] if m["id"] == "faulty"][0]
    assert set(public["attention"]) <= {"ondie", "host", "total", "gave_up", "impossible"}
    deadline = time.monotonic() + 30
    while attention(fallback_server, "faulty")["host"] and time.monotonic() < deadline:
        time.sleep(0.5)
    a = attention(fallback_server, "faulty")
    assert a["host"] == 0 and a["ondie"] == 3 and "reasons" not in a
    assert a["host_engagements"] == 3 and a["ring_alloc_failures"] == 3 and a["gave_up"] == 0
    assert tokens(fallback_server, "faulty") == ref  # and on-die again, the same tokens
    assert attention(fallback_server, "clean") == {"ondie": 3, "host": 0, "total": 3, "gave_up": 0,
                                                   "impossible": 0, "host_engagements": 0,
                                                   "ring_alloc_failures": 0}


def test_allocation_that_keeps_failing_gives_up_and_still_serves(fallback_server):
    url = fallback_server.url
    httpx.post(url + "/admin/test/faults", json={"kv_alloc": 100})
    r = httpx.post(url + "/admin/models/load", timeout=120,
                   json={"path": str(fallback_server.path), "name": "stuck", "ctx_cap": 128})
    assert r.status_code == 200, r.text
    ref = tokens(fallback_server, "clean")
    assert tokens(fallback_server, "stuck") == ref
    deadline = time.monotonic() + 30
    while not attention(fallback_server, "stuck")["gave_up"] and time.monotonic() < deadline:
        time.sleep(0.5)
    httpx.post(url + "/admin/test/faults", json={"kv_alloc": 0})
    a = attention(fallback_server, "stuck")
    assert a["host"] == 3 and a["gave_up"] == 3 and a["reasons"] == {"ring_alloc_failed": 3}
    public = [m for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] == "stuck"][0]
    assert public["attention"]["host"] == 3 and public["attention"]["gave_up"] == 3
    assert tokens(fallback_server, "stuck") == ref
