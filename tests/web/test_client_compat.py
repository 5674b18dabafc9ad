"""What real clients send (issue 12 section 1), in process with a tiny model. Each is a deliberate,
additive departure from the contract: content as an array of parts reads as its text parts joined
(not empty); /chat/completions, /models and /health answer like /v1/chat/completions, /v1/models
and /; a CORS preflight says which methods and headers are allowed; a prompt over the window gets
its 422 even when streamed, with kv_used/kv_cap as fields of the error object."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.web.inprocess import tiny_app

CHAT = "/v1/chat/completions"
KV_CAP = 256  # the tiny model's context length


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "compat", max_concurrent=2, max_sessions=2)
    yield server
    server.close()


def chat(messages, **kw) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0, **kw}


def prompt_tokens(app, messages) -> int:
    status, body, _ = app.post(CHAT, chat(messages))
    assert status == 200, body
    return body["usage"]["prompt_tokens"]


def text(*texts, kind="text"):
    return [{"type": kind, "text": t} for t in texts]


def assert_400(status, body, *words):
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    for w in words:
        assert w in body["error"]["message"], body


# --- content as an array of parts ---------------------------------------------------------------

def test_text_parts_are_joined_in_order_like_the_same_string(app):
    as_string = prompt_tokens(app, [{"role": "user", "content": "hello there, world"}])
    assert prompt_tokens(app, [{"role": "user", "content": text("hello ", "there, ", "world")}]) == as_string
    assert prompt_tokens(app, [{"role": "user", "content": text("hello there, ", "world", kind="input_text")}]) \
        == as_string


def test_history_of_every_role_reads_its_parts(app):
    strings = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"},
               {"role": "assistant", "content": "hello again"}, {"role": "user", "content": "and?"}]
    parts = [{**m, "content": text(m["content"])} if isinstance(m["content"], str) else m for m in strings]
    parts[4]["content"] = text("hello ", "again")
    assert prompt_tokens(app, parts) == prompt_tokens(app, strings)


def test_an_empty_array_and_null_content_read_as_empty(app):
    empty = prompt_tokens(app, [{"role": "user", "content": ""}])
    assert prompt_tokens(app, [{"role": "user", "content": []}]) == empty
    assert prompt_tokens(app, [{"role": "user", "content": None}]) == empty
    assert prompt_tokens(app, [{"role": "user"}]) == empty


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_a_part_that_is_not_text_is_400_text_only(app, part):
    msgs = [{"role": "user", "content": [*text("look:"), part]}]
    assert_400(*app.post(CHAT, chat(msgs))[:2], "messages[0].content[1]", "text only", part["type"])


@pytest.mark.parametrize("part, field", [("just a string", "messages[1].content[0]"),
                                         (7, "messages[1].content[0]"),
                                         ({"type": "text", "text": 5}, "messages[1].content[0].text"),
                                         ({"type": "text"}, "messages[1].content[0].text"),
                                         ({"type": 3, "text": "x"}, "messages[1].content[0].type"),
                                         ({"image": "x"}, "messages[1].content[0].type")])
def test_a_malformed_part_is_400_naming_the_field(app, part, field):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]}]
    assert_400(*app.post(CHAT, chat(msgs))[:2], field)


def test_the_official_openai_sdk_sends_parts_and_is_served(app):
    """The SDK's own serialization of content parts, through the /v1-less alias (base URL without
    /v1), in process over httpx's ASGI transport: no server process to start."""
    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://pantheon")
        async with openai.AsyncOpenAI(base_url="http://pantheon", api_key="none", http_client=http,
                                      max_retries=0) as client:
            r = await client.chat.completions.create(
                model="tiny", temperature=0, max_tokens=1,
                messages=[{"role": "user", "content": [{"type": "text", "text": "hello there, "},
                                                       {"type": "text", "text": "world"}]}])
            try:
                await client.chat.completions.create(
                    model="tiny", max_tokens=1,
                    messages=[{"role": "user", "content": [{"type": "image_url",
                                                            "image_url": {"url": "https://x/y.png"}}]}])
            except openai.BadRequestError as e:
                refused = e
            else:
                refused = None
            return r, refused

    r, refused = app.run(go())
    assert r.usage.prompt_tokens == prompt_tokens(app, [{"role": "user", "content": "hello there, world"}])
    assert refused is not None and refused.status_code == 400 and "text only" in str(refused)


# --- routes without /v1 ---------------------------------------------------------------------------


def test_routes_without_v1_answer_like_their_v1_twins(app):
    assert app.get("/models") == app.get("/v1/models")
    status, health = app.get("/health")
    assert status == 200 and health == app.get("/")[1]
    msgs = [{"role": "user", "content": "same either way"}]
    s1, a, _ = app.post("/chat/completions", chat(msgs, max_tokens=4))
    s2, b, _ = app.post(CHAT, chat(msgs, max_tokens=4))
    assert s1 == s2 == 200 and a["choices"] == b["choices"]
    for usage in (a["usage"], b["usage"]):
        usage.pop("prompt_tokens_details")  # the second turn reuses the first's prefix cache
    assert a["usage"] == b["usage"]
    status, events = app.stream("/chat/completions", chat(msgs, max_tokens=2))
    assert status == 200 and events[-1] == "[DONE]"


def test_each_streamed_choice_opens_with_a_role_only_delta(app):
    # The contract's first delta is {"role":"assistant"}: no empty "content" rides it (llama.cpp's
    # server tests reject a present-but-empty content delta), and no later delta repeats the role.
    msgs = [{"role": "user", "content": "count to three"}]
    status, events = app.stream(CHAT, chat(msgs, max_tokens=3, n=2))
    assert status == 200 and events[-1] == "[DONE]"
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant"}, deltas
        assert all("role" not in d for d in deltas[1:]), deltas
        assert all(d["content"] for d in deltas if "content" in d), deltas


@pytest.mark.parametrize("method, path", [("GET", "/v2/models"), ("GET", "/chat/completions"),
                                          ("POST", "/health"), ("POST", "/models"), ("GET", "/completions"),
                                          ("GET", "/v1/health")])
def test_every_other_path_keeps_the_contract_404(app, method, path):
    async def go():
        r = await app.client.open(path, method=method, json={} if method == "POST" else None)
        return r.status_code, await r.get_json()

    status, body = app.run(go())
    assert status == 404 and body["error"] == {"message": "unknown route", "type": "not_found", "code": None}


# --- CORS preflight -------------------------------------------------------------------------------

def preflight(app, path, headers=None):
    async def go():
        r = await app.client.options(path, headers=headers or {})
        return r.status_code, await r.get_json(), r.headers

    return app.run(go())


def test_a_preflight_echoes_the_requested_headers(app):
    status, body, h = preflight(app, "/v1/chat/completions",
                                {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, x-stainless-os, content-type"})
    assert status == 200 and body == {}
    assert h["Access-Control-Allow-Origin"] == "*"
    assert h["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert h["Access-Control-Allow-Headers"] == "authorization, x-stainless-os, content-type"
    assert h["Access-Control-Max-Age"] == "86400"


def test_a_preflight_without_requested_headers_allows_the_defaults(app):
    for path in ("/chat/completions", "/anything/at/all"):
        status, body, h = preflight(app, path)
        assert status == 200 and body == {}
        assert h["Access-Control-Allow-Headers"] == "authorization, content-type, x-session-id"
        assert h["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS" and h["Access-Control-Max-Age"] == "86400"


# --- errors known before the stream opens -----------------------------------------------------------

@pytest.mark.parametrize("words", [1000, 150])  # refused on length alone / by its token count
def test_an_over_long_streamed_prompt_is_422_with_kv_fields(app, words):
    msgs = [{"role": "user", "content": "hello world " * words}]
    status, body, headers = app.post(CHAT, chat(msgs, stream=True))
    assert status == 422 and {k.lower(): v for k, v in headers.items()}["content-type"] == "application/json", body
    err = body["error"]
    assert err["type"] == "context_over_budget" and err["code"] is None
    assert err["kv_cap"] == KV_CAP and err["kv_used"] >= KV_CAP
    assert f"kv_cap={KV_CAP}" in err["message"]  # the contract's message text, kept
    status, plain, _ = app.post(CHAT, chat(msgs))  # non-stream: the same body
    assert status == 422 and plain == body


@pytest.mark.parametrize("allowed, origin, expected", [
    ("*", "http://evil.example", "*"), ("*", None, "*"),
    ("localhost", "http://localhost:3000", "http://localhost:3000"), ("localhost", "http://[::1]", "http://[::1]"),
    ("localhost", "http://127.0.0.1", "http://127.0.0.1"), ("localhost", "http://localhost.evil.example", None),
    ("localhost", "http://evil.example", None), ("localhost", None, None), ("localhost", "http://[x", None),
    ("https://a.example, https://b.example", "https://b.example", "https://b.example"),
    ("https://a.example", "https://c.example", None),
])
def test_cors_origins_as_llama_server_takes_them(allowed, origin, expected):
    from pantheon.web import allowed_origin

    assert allowed_origin(allowed, origin) == expected


def test_cors_origins_restrict_the_allowed_origin_on_every_answer(tmp_path_factory):
    from tests.web.inprocess import tiny_app

    server = tiny_app(tmp_path_factory, "cors", cors_origins="localhost")
    try:
        for origin, expected in (("http://localhost:5173", "http://localhost:5173"), ("http://evil.example", None)):
            status, _, h = preflight(server, "/v1/chat/completions", {"Origin": origin,
                                                                      "Access-Control-Request-Method": "POST"})
            assert status == 200 and h.get("Access-Control-Allow-Origin") == expected
            status, _, h = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 1}, {"Origin": origin})
            h = {k.lower(): v for k, v in h.items()}
            assert status == 200 and h.get("access-control-allow-origin") == expected
            assert h.get("vary") == ("Origin" if expected else None)
    finally:
        server.close()


def test_llama_servers_comma_separated_aliases(tmp_path):
    """`-a tinyllama-2,fim,code` (llama-server's aliases): the id is the first name in sorted order
    (its std::set's), the model list names them all, and each routes to the model when several are
    loaded; the session routes take them too."""
    from pantheon.config import ServeConfig
    from tests.fixtures.tiny_models import write_tiny_llama
    from tests.web.inprocess import InProcessApp

    config = ServeConfig().model_config("/m/a.gguf", " tinyllama-2, fim,code ,fim")
    assert (config.name, config.aliases) == ("code", ("fim", "tinyllama-2"))
    assert ServeConfig().model_config("/m/a.gguf", None).aliases == ()
    a, b = write_tiny_llama(tmp_path / "a.gguf"), write_tiny_llama(tmp_path / "b.gguf", seed=9)
    app = InProcessApp([(str(a), "tinyllama-2,fim,code"), (str(b), "other")], tags=("chat", "small"))
    try:
        rows = {r["id"]: r for r in app.get("/v1/models")[1]["data"]}
        assert set(rows) == {"code", "other"} and rows["code"]["aliases"] == ["code", "fim", "tinyllama-2"]
        assert "aliases" not in rows["other"] and rows["other"]["tags"] == rows["code"]["tags"] == ["chat", "small"]
        for name, served in (("fim", "code"), ("tinyllama-2", "code"), ("code", "code"), ("other", "other")):
            status, body, _ = app.post("/v1/chat/completions", {"model": name, "max_tokens": 1,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and body["model"] == served
        assert app.post("/v1/chat/completions", {"model": "nope", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "hi"}]})[0] == 404
        assert app.state.pool.find("fim") is app.state.pool.find("code") is not app.state.pool.find("other")
        assert app.state.pool.find("nope") is None and app.state.pool.find(None) is not None
    finally:
        app.close()
