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
        # /health is llama-server's readiness: 503 "Loading model" until a model is ready (GET / stays 200)
        status, body = app.get("/health")
        assert status == 503 and body["error"]["type"] == "unavailable_error"
        assert body["error"]["message"] == "Loading model"
        app.state.fetching.clear()
        assert app.get("/health")[0] == 200

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


# ---- issue 26: a model still loading is never answered by another; failed loads are told -------------
def test_a_request_for_a_model_still_loading_is_503_not_another_models_answer(tmp_path):
    from tests.fixtures.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "a.gguf")
    app = InProcessApp([(str(path), "a")])
    try:
        app.state.starting.append("b")  # `serve --model a --name a --model b --name b`: b not loaded yet
        status, body, headers = app.post("/v1/chat/completions", {**CHAT, "model": "b", "max_tokens": 1})
        assert status == 503 and body["error"]["type"] == "model_loading", body
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "5"
        assert _health(app)["loading"] == ["b"]
        assert app.get("/health") == (200, _health(app))  # a is ready: the server serves
        status, body, _ = app.post("/v1/chat/completions", {**CHAT, "model": "a", "max_tokens": 1})
        assert status == 200 and body["model"] == "a"
        app.state.starting.clear()
        app.state.load_errors.append({"model": "b", "path": "/models/b.gguf", "error": "b.gguf: bad magic"})
        status, body, _ = app.post("/v1/chat/completions", {**CHAT, "model": "b", "max_tokens": 1})
        assert status == 404 and body["error"]["type"] == "model_not_found" and "bad magic" in body["error"]["message"]
        assert _health(app)["status"] == "ok"  # a is loaded
    finally:
        app.close()


def test_health_and_models_say_which_load_failed_and_why():
    app = InProcessApp([])
    try:
        app.state.load_errors.append({"model": "x", "path": "/nope/x.gguf", "error": "/nope/x.gguf: file not found"})
        health = _health(app)
        assert health["status"] == "failed" and health["load_errors"][0]["error"].endswith("file not found")

        async def models():
            r = await app.client.get("/v1/models")
            return await r.get_json()

        body = app.run(models())
        assert body["data"] == [] and body["load_errors"][0]["model"] == "x"
    finally:
        app.close()


def test_the_models_row_says_compiling_during_the_warm_up(tmp_path):
    from tests.fixtures.tiny_models import write_tiny_llama

    app = InProcessApp([(str(write_tiny_llama(tmp_path / "a.gguf")), "a")])
    try:
        async def row():
            r = await app.client.get("/v1/models")
            return (await r.get_json())["data"][0]

        assert app.run(row())["status"] == "ready"
        app.engine("a").compiling = True
        assert app.run(row())["status"] == "compiling" and _health(app)["compiling"] == ["a"]
    finally:
        app.close()
