"""Residency counters and the memory ladder, moved by injected faults (PANTHEON_TEST_HOOKS=1)."""

from __future__ import annotations

import time

import httpx
import pytest

from pantheon.engine.memory import CRITICAL, OK, PRESSURE, LadderConfig, MemoryLadder
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess
from tests.web.test_http_errors import check_error

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("res") / "t.gguf", extra_metadata={"llama.context_length": 2048})
    server = ServerProcess(["--model", str(path), "--name", "t", "--ctx-cap", "2048", "--max-concurrent", "4"],
                           env={"PANTHEON_TEST_HOOKS": "1"})
    yield server
    httpx.post(server.url + "/admin/test/faults", json={"compile": 0, "memory": ""})
    server.stop()


def ask(url, words: int, **kw):
    body = {"messages": [{"role": "user", "content": "hello " * words}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, **kw}
    r = httpx.post(url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def graphs(url):
    return httpx.get(url + "/admin/models").json()["data"][0]["graphs"]


def test_graph_counters_report_failed_compiles_heal_and_give_up(hooked):
    url = hooked.url
    ask(url, 2)
    g = graphs(url)
    assert g["failed"] == 0 and g["live"] == g["total"] > 0 and g["capture_failures"] == 0
    assert {"prefill", "segment"} <= set(g)  # per-class split for the exercised classes
    # decode ran as one full-step program (segment) per bucket, not as per-layer programs
    assert "batched_attn" not in g and g["segment"]["live"] == g["segment"]["total"] >= 1
    clean = ask(url, 150)  # a longer prompt: a new prefill chunk bucket (256), compiled cleanly
    # A failure: a new chunk bucket (its uncached suffix after the shared "hello" prefix: ~46
    # tokens, bucket 48) falls back to the program traced on the reference kernels, then heals on
    # the backoff. (Programs read the cache in place: a longer context alone compiles nothing new.)
    httpx.post(url + "/admin/test/faults", json={"compile": 1})
    faulty = ask(url, 190)
    assert graphs(url)["capture_failures"] == 1
    assert faulty["choices"][0]["finish_reason"] == "length"  # output still produced
    deadline = time.monotonic() + 20
    while graphs(url)["failed"] and time.monotonic() < deadline:
        time.sleep(0.5)
    g = graphs(url)
    assert g["failed"] == 0 and g["live"] == g["total"] and g.get("gave_up", 0) == 0
    # Failures without end: retried on the backoff until the budget is spent, then given up.
    httpx.post(url + "/admin/test/faults", json={"compile": 1000})
    again = ask(url, 150, max_tokens=4, n=2)  # n=2: a decode batch of two, a bucket not seen before
    deadline = time.monotonic() + 30
    while not graphs(url).get("gave_up") and time.monotonic() < deadline:
        time.sleep(0.5)
    httpx.post(url + "/admin/test/faults", json={"compile": 0})
    g = graphs(url)
    # the new bucket's full-step program failed, and so did the per-layer programs it fell back to
    assert g["gave_up"] >= 1 and g["failed"] >= g["gave_up"] and g["segment"]["failed"] >= 1
    assert g["batched_attn"]["failed"] >= 1
    # the fallback gave the same tokens the compiled path gives
    assert [t["token"] for t in again["choices"][0]["logprobs"]["content"]] == \
           [t["token"] for t in clean["choices"][0]["logprobs"]["content"]]


def test_memory_ladder_clamps_window_and_concurrency_and_refuses_under_critical(hooked):
    url = hooked.url
    models = lambda: httpx.get(url + "/v1/models").json()["data"][0]
    admin = lambda: httpx.get(url + "/admin/models").json()["data"][0]
    assert models()["context_window"] == 2048 and models()["max_concurrent"] == 4
    httpx.post(url + "/admin/test/faults", json={"memory": "pressure"})
    try:
        assert models()["context_window"] == 1024 and models()["max_concurrent"] == 2
        row = admin()
        assert row["context_window"] == 1024 and row["context_window_configured"] == 2048
        assert row["max_concurrent"] == 2 and row["max_concurrent_configured"] == 4
        assert ask(url, 2)["usage"]["kv_cap"] == 1024  # the next completion carries the new window
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "hello " * 1500}]}, timeout=60)
        check_error(r, 422, "context_over_budget")  # fits 2048, not the clamped 1024
        httpx.post(url + "/admin/test/faults", json={"memory": "critical"})
        check_error(httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}),
                    503, "server_memory_constrained")
    finally:
        httpx.post(url + "/admin/test/faults", json={"memory": ""})
    assert models()["context_window"] == 2048 and ask(url, 2)["usage"]["kv_cap"] == 2048


def test_fault_hook_is_hidden_without_the_env(smollm2_path):
    server = ServerProcess(["--model", str(smollm2_path), "--ctx-cap", "256", "--max-sessions", "1"])
    try:
        check_error(httpx.post(server.url + "/admin/test/faults", json={"compile": 1}), 404, "not_found")
    finally:
        server.stop()


def test_ladder_levels_from_thresholds():
    assert MemoryLadder(LadderConfig(pressure_pct=0.0, critical_pct=0.0)).level() == OK
    assert MemoryLadder(LadderConfig(pressure_pct=100.1, critical_pct=0.0)).level() == PRESSURE
    ladder = MemoryLadder(LadderConfig(pressure_pct=100.1, critical_pct=100.1))
    assert ladder.level() == CRITICAL and not ladder.admits()
    assert ladder.window(4096) == 1024 and ladder.window(300) == 256 and ladder.concurrency(8) == 1
