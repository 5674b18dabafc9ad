"""A server whose only model failed to load: `pantheon serve` exits (tests/test_cli.py); plain
`hypercorn pantheon.web:app` stays up, answers chat 503 no_models_loaded, and says in `GET /` and
`/v1/models` which load failed and why (never `status: ok` with nothing to serve)."""

from __future__ import annotations

import httpx

from tests.web.server import HypercornProcess
from tests.web.test_http_errors import check_error


def test_no_models_loaded_is_503_and_health_says_which_load_failed():
    server = HypercornProcess([], env={"PANTHEON_MODEL": "/nonexistent/model.gguf,m"}, wait_models=0)
    try:
        for _ in range(100):  # the failed load happens in the background
            health = httpx.get(server.url + "/").json()
            if health.get("load_errors"):
                break
        assert health["status"] == "failed" and health["loading"] == []
        assert health["load_errors"][0]["model"] == "m"
        assert "not found" in health["load_errors"][0]["error"]
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       timeout=30)
        check_error(r, 503, "no_models_loaded")
        models = httpx.get(server.url + "/v1/models").json()
        assert models["data"] == [] and models["load_errors"] == health["load_errors"]
        assert httpx.get(server.url + "/admin/models").json()["data"] == []
    finally:
        server.stop()
