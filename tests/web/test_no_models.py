"""A server whose only model failed to load stays up and answers 503 no_models_loaded."""

from __future__ import annotations

import httpx

from tests.web.server import ServerProcess
from tests.web.test_http_errors import check_error


def test_no_models_loaded_is_503_and_health_still_answers():
    server = ServerProcess(["--model", "/nonexistent/model.gguf"], wait_models=0)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       timeout=30)
        for _ in range(100):  # the failed load happens in the background
            if r.json()["error"]["message"] == "no models loaded":
                break
            r = httpx.post(server.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
        check_error(r, 503, "no_models_loaded")
        assert httpx.get(server.url + "/").json()["status"] == "ok"
        assert httpx.get(server.url + "/v1/models").json()["data"] == []
        assert httpx.get(server.url + "/admin/models").json()["data"] == []
    finally:
        server.stop()
