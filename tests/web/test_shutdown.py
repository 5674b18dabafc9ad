"""SIGTERM drains — under `pantheon serve` and under plain `hypercorn pantheon.web:app` alike: new
requests get 503 server_shutting_down (Retry-After: 1), the turn in flight finishes, the process
exits 0 within the drain window."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from pantheon.web.serve import DRAIN_S
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import BackgroundStream, HypercornProcess, ServerProcess
from tests.web.test_http_errors import check_error

MSG = [{"role": "user", "content": "Hello"}]
# ~2000 tokens at a few ms each on CPU: seconds in flight. The penalties keep the random tiny model
# out of repetition loops, so the turn runs to max_tokens.
LONG_TURN = {"messages": MSG, "max_tokens": 2000, "temperature": 1.0, "seed": 5, "presence_penalty": 2.0,
             "frequency_penalty": 2.0, "logit_bias": {"0": -100, "1": -100, "2": -100}}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("shutdown") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 4096})


def start_pantheon_serve(path):
    return ServerProcess(["--model", str(path), "--name", "tiny"])


def start_plain_hypercorn(path):
    return HypercornProcess([], env={"PANTHEON_MODEL": f"{path},tiny"})


def check_sigterm_drains(server) -> None:
    """Start a long streaming turn, SIGTERM the server, and check the drain from the outside."""
    turn = BackgroundStream(server.url, LONG_TURN)
    assert turn.started.wait(60)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    r = None
    while time.monotonic() - t0 < 10:  # until the worker sees the signal (hypercorn polls at 0.1 s)
        try:
            r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, timeout=10)
        except httpx.HTTPError as e:  # refused/reset: allowed only once the drain is over
            assert not turn.thread.is_alive(), f"connection failed while a turn was in flight: {e!r}"
            break
        if r.status_code == 503:
            break
        assert r.status_code == 200, r.text  # served before the worker saw the signal
    in_flight = turn.thread.is_alive()
    err = check_error(r, 503, "server_shutting_down")
    assert r.headers["retry-after"] == "1" and err["message"]
    assert in_flight, "the turn ended before the drain could be observed; lengthen LONG_TURN"
    assert server.proc.wait(timeout=DRAIN_S + 15) == 0
    turn.join()
    data = [ln for ln in turn.lines if ln.startswith("data: ")]
    assert turn.status == 200 and data[-1] == "data: [DONE]"  # the stream in flight completed
    finishes = [c["finish_reason"] for ln in data[:-1] for c in json.loads(ln[6:])["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert time.monotonic() - t0 < DRAIN_S + 10


@pytest.mark.parametrize("start", [start_pantheon_serve, start_plain_hypercorn], ids=["pantheon-serve", "hypercorn"])
def test_sigterm_refuses_new_work_with_503_and_finishes_the_stream_in_flight(tiny_path, start):
    server = start(tiny_path)
    try:
        check_sigterm_drains(server)
    finally:
        server.stop()


def test_pantheon_web_app_is_a_module_level_asgi_app_built_on_first_event():
    """hypercorn evaluates `app` in the module's namespace: it must be a real attribute, and
    importing (or loading) it must not read the environment or build the app."""
    from hypercorn.utils import load_application

    import pantheon.web

    assert "app" in vars(pantheon.web)
    load_application("pantheon.web:app", 0)  # NoAppError before
    assert pantheon.web.app._app is None
