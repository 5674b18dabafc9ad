"""While a model is fetched or loaded, chat answers 503 no_models_loaded with Retry-After and `GET /`
lists what is loading (in process, no model on the device)."""

from __future__ import annotations

from pantheon.config import ModelConfig
from pantheon.engine.pool import LOADING, ModelEntry
from tests.web.inprocess import InProcessApp

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def _chat(app: InProcessApp) -> tuple[int, dict, dict]:
    status, body, headers = app.post("/v1/chat/completions", CHAT)
    return status, body, {k.lower(): v for k, v in headers.items()}


def _health(app: InProcessApp) -> dict:
    async def go():
        r = await app.client.get("/")
        return await r.get_json()

    return app.run(go())


def test_chat_is_503_with_retry_after_while_a_model_loads():
    app = InProcessApp([])
    try:
        status, body, headers = _chat(app)
        assert status == 503 and body["error"]["type"] == "no_models_loaded"
        assert "retry-after" not in headers and _health(app)["loading"] == []

        app.state.fetching.append("SmolLM2-135M-Instruct")  # the first-run download of the default model
        status, body, headers = _chat(app)
        assert status == 503 and body["error"]["type"] == "no_models_loaded"
        assert "loading" in body["error"]["message"] and headers["retry-after"] == "5"
        assert _health(app)["loading"] == ["SmolLM2-135M-Instruct"]
        app.state.fetching.clear()

        entry = ModelEntry(ModelConfig(path="/models/a.gguf", name="a"))  # as pool.load leaves it mid-upload
        assert entry.state == LOADING
        app.state.pool._entries["a"] = entry
        status, body, headers = _chat(app)
        assert status == 503 and headers["retry-after"] == "5" and "still loading" in body["error"]["message"]
        health = _health(app)
        assert health["status"] == "ok" and health["loading"] == ["a"]
        del app.state.pool._entries["a"]
    finally:
        app.close()
