"""The router's routes in process (Quart's test client), with the serve instances stood in for by
an httpx.MockTransport: registry routes, /v1/models, dispatch by session and free slots, one retry
of a 429/503 on another replica, error bodies passed through, streams relayed chunk by chunk, and
the contract's errors when nothing can answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pantheon.router import create_app


class Upstreams:
    """Fake serve instances: per host, a status (or a stream) to answer with; every request seen."""

    def __init__(self):
        self.status: dict[str, int] = {}
        self.seen: list[tuple[str, str, dict]] = []

    def handler(self, req: httpx.Request) -> httpx.Response:
        host = req.url.host
        body = json.loads(req.content) if req.content else {}
        self.seen.append((host, req.url.path, body))
        status = self.status.get(host, 200)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "busy", "type": "server_busy", "code": status}},
                                  headers={"Retry-After": "1"})
        if body.get("stream"):
            async def chunks():
                for i in range(3):
                    yield f"data: {json.dumps({'host': host, 'i': i})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"host": host, "path": req.url.path,
                                         "session": req.headers.get("x-session-id")})


@pytest.fixture
def env():
    ups = Upstreams()
    app = create_app(ttl_s=30.0, transport=httpx.MockTransport(ups.handler))
    client = app.test_client()
    loop = asyncio.new_event_loop()
    yield app, client, ups, loop.run_until_complete
    loop.close()


def register(run, client, host, free, window=None, sessions=()):
    model = {"id": "m", "max_concurrent": 4, "free_slots": free}
    if window:
        model["context_window"] = window
    r = run(client.post("/registry/register", json={"url": f"http://{host}:80", "models": [model],
                                                    "sessions": list(sessions)}))
    assert r.status_code == 200
    return run(r.get_json())["instance_id"]


def post(run, client, body, headers=None):
    async def go():
        r = await client.post("/v1/chat/completions", json=body, headers=headers or {})
        return r.status_code, json.loads(await r.get_data()), dict(r.headers)
    return run(go())


def test_models_dispatch_affinity_and_retry(env):
    app, client, ups, run = env
    assert post(run, client, {"model": "m"})[0] == 503  # nothing registered yet
    a = register(run, client, "a", free=1, window=4096, sessions=["s1"])
    register(run, client, "b", free=3, window=2048)
    models = run(run(client.get("/v1/models")).get_json())["data"]
    assert models == [{"id": "m", "object": "model", "created": 0, "owned_by": "pantheon", "live": 2, "free_slots": 4,
                       "max_concurrent": 8, "context_window": 2048}]
    assert post(run, client, {"model": "m", "messages": []})[1]["host"] == "b"  # most free slots
    status, body, _ = post(run, client, {"model": "m"}, {"X-Session-Id": "s1"})
    assert body["host"] == "a" and body["session"] == "s1"  # the session's holder, header passed on
    # a 429 from the chosen replica is retried once on the other
    ups.status["b"] = 429
    assert post(run, client, {"model": "m"})[1]["host"] == "a"
    # both busy: the client gets the instance's 429 with its body and Retry-After
    ups.status["a"] = 429
    status, body, headers = post(run, client, {"model": "m"})
    assert status == 429 and body["error"]["type"] == "server_busy" and headers["retry-after"] == "1"
    assert [h for h, _, _ in ups.seen[-2:]] == ["b", "a"]  # retried exactly once
    # a deregistered instance is gone at once
    assert run(client.post("/registry/deregister", json={"instance_id": a})).status_code == 200
    health = run(run(client.get("/")).get_json())
    assert health["live_instances"] == 1


def test_streams_are_relayed_and_errors_are_the_contracts(env):
    app, client, ups, run = env
    register(run, client, "a", free=2)

    async def stream():
        r = await client.post("/v1/chat/completions", json={"model": "m", "stream": True})
        return r.status_code, r.headers["content-type"], (await r.get_data()).decode()

    status, ctype, text = run(stream())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    for path, body in (("/registry/register", {"url": "nope"}), ("/registry/heartbeat", [])):
        r = run(client.post(path, json=body))
        assert r.status_code == 400 and run(r.get_json())["error"]["type"] == "invalid_request_error"
    r = run(client.post("/registry/heartbeat", json={"url": "http://a:80", "instance_id": "ghost"}))
    assert r.status_code == 404  # unknown: the instance registers again
    r = run(client.post("/v1/chat/completions", data=b"{not json"))
    assert r.status_code == 400
    r = run(client.get("/nowhere"))
    assert r.status_code == 404 and run(r.get_json())["error"]["type"] == "not_found"


def test_llama_server_introspection_is_forwarded(env):
    app, client, ups, run = env
    register(run, client, "a", free=2)
    for path in ("/apply-template", "/embedding", "/v1/chat/completions/input_tokens", "/v1/responses/input_tokens",
                 "/v1/messages/count_tokens"):
        r = run(client.post(path, json={"model": "m", "messages": []}))
        assert r.status_code == 200 and run(r.get_json())["path"] == path
    r = run(client.get("/props?model=m"))
    assert r.status_code == 200 and run(r.get_json())["path"] == "/props"
    assert ups.seen[-1][:2] == ("a", "/props")
    r = run(client.get("/props?model=other"))  # one model served: any name routes to it, as a serve's
    assert r.status_code == 200 and ups.seen[-1][:2] == ("a", "/props")
