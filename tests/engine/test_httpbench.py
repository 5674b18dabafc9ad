"""`pantheon bench --concurrency ... --against URL`: the comparison logic against two small fake
OpenAI-compatible streaming servers (the real servers are benchmarks, not tests)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pantheon.engine import httpbench


def fake_server(delay_s: float, usage: bool):
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body["received"] = time.perf_counter()
            seen.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            send = lambda ev: self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())  # noqa: E731
            send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for _ in range(body["max_tokens"]):
                time.sleep(delay_s)
                send({"choices": [{"index": 0, "delta": {"content": "x"}}]})
            if usage:
                words = len(body["messages"][0]["content"].split())
                send({"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": words}})
            self.wfile.write(b"data: [DONE]\n\n")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


@pytest.fixture
def servers():
    fast, fast_url, fast_seen = fake_server(0.002, usage=True)
    slow, slow_url, slow_seen = fake_server(0.008, usage=False)  # no usage: content chunks are counted
    yield (fast_url, fast_seen), (slow_url, slow_seen)
    fast.shutdown()
    slow.shutdown()


def test_compare_alternates_servers_with_distinct_prompts_and_reports_ratios(servers):
    (fast_url, fast_seen), (slow_url, slow_seen) = servers
    bias = {"2": -100}
    both = httpbench.compare({"pantheon": fast_url, "other": slow_url}, [1, 2], 10, bias, runs=3)
    ours, theirs = both["pantheon"], both["other"]
    assert [r.concurrency for r in ours] == [1, 2] == [r.concurrency for r in theirs]
    for r in ours + theirs:
        assert r.completion_tokens == 10 * r.concurrency  # every request decoded exactly max_tokens
    assert all(a.aggregate_tok_s > b.aggregate_tok_s for a, b in zip(ours, theirs))
    # per level: a warm-up, then 3 runs each; both servers got the same prompts, all distinct per run
    assert len(fast_seen) == len(slow_seen) == (1 + 3) * 1 + (1 + 3) * 2
    measured = [b["messages"][0]["content"] for b in fast_seen if b["max_tokens"] == 10]
    assert len(set(measured)) == len(measured) == 3 * 1 + 3 * 2
    assert sorted(measured) == sorted(b["messages"][0]["content"] for b in slow_seen if b["max_tokens"] == 10)
    assert all(b["logit_bias"] == bias and b["stream"] for b in fast_seen + slow_seen)
    text = httpbench.comparison_table(ours, theirs, "llama-server")
    assert "llama-server tok/s" in text and "stream ratio" in text and len(text.splitlines()) == 3
    ratios = json.loads(httpbench.as_json(ours, theirs))["ratios"]
    assert [round(r["aggregate"], 6) for r in ratios] == [round(a.aggregate_tok_s / b.aggregate_tok_s, 6)
                                                           for a, b in zip(ours, theirs)]
    assert [round(r["per_stream"], 6) for r in ratios] == [round(a.per_stream_tok_s / b.per_stream_tok_s, 6)
                                                            for a, b in zip(ours, theirs)]
    assert all(f"{r['per_stream']:.2f}" in line for r, line in zip(ratios, text.splitlines()[1:]))
    assert all(r["aggregate"] > 1 for r in ratios)
    # the runs alternate which server goes first (A B, B A, A B): drift within a level hits both
    for level in (1, 2):
        fast_t = [b["received"] for b in fast_seen if b["max_tokens"] == 10][3 * (level - 1):][:3 * level]
        slow_t = [b["received"] for b in slow_seen if b["max_tokens"] == 10][3 * (level - 1):][:3 * level]
        firsts = [min(fast_t[i * level:(i + 1) * level]) < min(slow_t[i * level:(i + 1) * level]) for i in range(3)]
        assert firsts == [True, False, True]
    assert httpbench.run_order({"a": "x", "b": "y"}, 1) == [("b", "y"), ("a", "x")]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_request_fails_the_level():
    """A refused connection fails the level with one line naming it, not a client thread's traceback."""
    with pytest.raises(httpbench.BenchError, match=r"2 request\(s\) failed \(first: ConnectError"):
        httpbench.run_level("http://127.0.0.1:9", 2, 4, {})
    with pytest.raises(httpbench.BenchError, match=r"the long prompt failed \(ConnectError"):
        httpbench.long_prompt_ttft("http://127.0.0.1:9", 10, {})


def test_long_prompt_ttft_and_each_local_servers_memory(servers):
    (fast_url, fast_seen), (slow_url, slow_seen) = servers
    names = {"pantheon": fast_url, "other": slow_url}
    long = httpbench.long_prompts(names, 60, {"2": -100}, runs=3)
    prompts = [b["messages"][0]["content"] for b in fast_seen + slow_seen]
    assert len(prompts) == 6 and len(set(prompts)) == 6  # distinct: no prefix cache answers one
    # ... from their first words on, and as long as each other: each server prefills as many tokens
    assert len({p.split(":")[0] for p in prompts}) == 6 and len({p.split(":", 1)[1] for p in prompts}) == 1
    assert all(len(p.split()) > 60 for p in prompts) and all(b["stream"] for b in fast_seen)
    assert long["pantheon"].prompt_tokens > 60 and long["other"].prompt_tokens == 0  # the slow one sends no usage
    assert all(r.ttft_ms > 0 for r in long.values())
    # both fake servers listen in this process: found by their ports
    assert httpbench.local_pid(fast_url) == httpbench.local_pid(slow_url) == os.getpid()
    assert httpbench.local_pid("http://127.0.0.1:9") is None and httpbench.local_pid("http://example.com:80") is None
    mem = httpbench.memory_of(os.getpid())
    assert 0 < mem["rss_mib"] <= mem["peak_rss_mib"]
    assert httpbench.memory_of(None) == {}
    text = httpbench.server_table(list(names), long, {"pantheon": mem, "other": {}}, {"pantheon": mem, "other": mem})
    lines = text.splitlines()
    assert len(lines) == 4 and lines[-1].split()[0] == "ratio"
    assert lines[-1].split()[3] == "1.00"  # RSS at the end: the same process's


def test_memory_read_bandwidth_probe():
    """The bench's bandwidth reading: one thread per usable core, a positive finite rate."""
    import math
    import os

    got = httpbench.memory_read_gbs(mib=16, passes=2)
    assert got["threads"] == len(os.sched_getaffinity(0))
    assert math.isfinite(got["gb_per_s"]) and got["gb_per_s"] > 0
