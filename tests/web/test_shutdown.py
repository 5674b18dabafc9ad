"""SIGTERM drains: the generation in flight finishes, new requests get 503 server_shutting_down."""

from __future__ import annotations

import signal

import httpx

from tests.web.server import BackgroundStream, ServerProcess
from tests.web.test_http_errors import check_error

MSG = [{"role": "user", "content": "Hello"}]


def test_sigterm_refuses_new_work_with_503_and_finishes_the_stream_in_flight(smollm2_path):
    server = ServerProcess(["--model", str(smollm2_path), "--ctx-cap", "512"])
    try:
        turn = BackgroundStream(server.url, {"messages": MSG, "max_tokens": 60,
                                             "logit_bias": {"0": -100, "2": -100, "4": -100}})
        assert turn.started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        r = None
        for _ in range(50):
            try:
                r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG}, timeout=10)
                break
            except httpx.HTTPError:
                continue
        err = check_error(r, 503, "server_shutting_down")
        assert r.headers["retry-after"] == "1" and err["message"]
        turn.join()
        assert [ln for ln in turn.lines if ln][-1] == "data: [DONE]"  # the stream in flight completed
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
