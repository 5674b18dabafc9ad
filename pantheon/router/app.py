"""`pantheon router`: the Quart app serve instances register with, which aggregates their models and
dispatches client requests to them (`hypercorn pantheon.router:app`, `pantheon router`).

Registry routes: POST /registry/register, /registry/heartbeat, /registry/deregister, and
/registry/drain (an instance about to stop: its idle sessions move to another replica). Client
routes: GET /v1/models (the router's shape: `live`, summed `free_slots`, minimum
`context_window`), POST /v1/chat/completions (streamed or not), the /session/* routes, GET /.

Dispatch: a request naming a session goes to the instance holding it; otherwise to the live
instance with the most free slots for its model. A 429 or 503 from an instance is retried once on
another live replica before it reaches the client; any other answer passes through as the
instance gave it (status, the contract's error body, Retry-After). Streams are relayed chunk by
chunk as they arrive (httpx, no buffering), and a client that goes away closes the upstream
stream, so the instance cancels the generation."""

from __future__ import annotations

import json
import logging

import httpx
from quart import Quart, Response, request

from pantheon.config import admin_token, router_ttl_s
from pantheon.router.registry import Instance, Registry, ReportError
from pantheon.web.errors import answer_unknown_routes, error_response

log = logging.getLogger("pantheon.router")
HEARTBEAT_S = 2.0
RETRYABLE = (429, 503)
FORWARD_HEADERS = ("content-type", "accept", "authorization", "x-session-id")
RETURN_HEADERS = ("content-type", "retry-after", "cache-control")


def create_app(ttl_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
               admin_token: str | None = None) -> Quart:
    """admin_token: what the router sends to the instances' /admin/session/export when it moves a
    draining instance's sessions (PANTHEON_ADMIN_TOKEN, shared by the cluster), if they need one."""
    app = Quart("pantheon-router")
    router = Dispatch(Registry(ttl_s), transport, admin_token)
    app.registry = router.registry

    @app.after_serving
    async def close_client():
        await router.close()

    @app.after_request
    async def headers(response: Response) -> Response:
        response.headers["Access-Control-Allow-Origin"] = "*"
        return response

    @app.errorhandler(ReportError)
    async def bad_report(e: ReportError):
        return error_response(400, "invalid_request_error", str(e))

    _registry_routes(app, router)
    _client_routes(app, router)
    _session_routes(app, router)
    answer_unknown_routes(app)
    return app


class Dispatch:
    """Where requests go (`pick`), how they get there (`relay`, one retry on another replica), and
    moving a draining instance's sessions; one httpx client, built on the serving loop."""

    def __init__(self, registry: Registry, transport: httpx.AsyncBaseTransport | None, admin_token: str | None):
        self.registry, self.transport, self.admin_token = registry, transport, admin_token
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # built on the serving loop (not at import)
            self._client = httpx.AsyncClient(transport=self.transport, timeout=httpx.Timeout(600.0, connect=5.0))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @staticmethod
    def no_instances() -> Response:
        return error_response(503, "no_models_loaded", "no live serve instance is registered with this router",
                              {"Retry-After": "5"})

    def pick(self, model, sid) -> list[Instance] | Response:
        """Where a request for `model` goes, best first; an error response when nowhere."""
        if model is not None and not isinstance(model, str):
            return error_response(400, "invalid_request_error", "'model' must be a string")
        live = self.registry.live()
        if not live:
            return self.no_instances()
        served = {m for i in live for m in i.models}
        if model not in served:
            if model and len(served) != 1:
                return error_response(404, "model_not_found", f"model {model!r} is not served by any live instance")
            model = next(iter(served)) if len(served) == 1 else None  # as a serve: its only model answers
        return self.registry.candidates(model, sid)

    async def relay(self, targets: list[Instance], method: str, path: str, body: bytes | None, sid: str | None,
                    stream: bool = False, retry_on: tuple[int, ...] = RETRYABLE):
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        tries = targets[:2] if retry_on == RETRYABLE else targets
        for n, inst in enumerate(tries):
            last = n == len(tries) - 1
            req = self.client().build_request(method, inst.url + path, content=body, headers=headers)
            inst.inflight += 1
            try:
                resp = await self.client().send(req, stream=True)
            except httpx.HTTPError as e:
                inst.inflight -= 1
                log.warning("instance %s (%s) unreachable: %s", inst.id, inst.url, e)
                if last:
                    return error_response(503, "server_unavailable", f"the serve instance did not answer ({type(e).__name__})",
                                          {"Retry-After": "1"})
                continue
            if resp.status_code in retry_on and not last:
                await resp.aclose()
                inst.inflight -= 1
                continue
            self.registry.sent(sid, inst)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() in RETURN_HEADERS}
            if not stream or resp.status_code != 200:
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                    inst.inflight -= 1
                return Response(content, status=resp.status_code, headers=out_headers)
            return _streamed(resp, inst, out_headers)
        return self.no_instances()

    async def move_session(self, src: Instance, sid: str, model: str) -> str | None:
        """Export `sid` from a draining instance and restore it on a live replica: the replica's id."""
        targets = self.registry.candidates(model)
        if not targets:
            return None
        auth = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        try:
            r = await self.client().post(src.url + "/admin/session/export", json={"session_id": sid, "name": model},
                                         headers=auth)
            if r.status_code != 200:
                log.warning("export of session %s from %s: %s %s", sid, src.url, r.status_code, r.text[:200])
                return None
            out = r.json()
            for dst in targets:
                r = await self.client().post(dst.url + "/session/restore", json={
                    "session_id": sid, "name": model, "blob": out["blob_b64"], "tokens": out["tokens"]})
                if r.status_code == 200:
                    self.registry.sent(sid, dst)
                    dst.sessions.add(sid)
                    return dst.id
                log.warning("restore of session %s on %s: %s %s", sid, dst.url, r.status_code, r.text[:200])
        except (httpx.HTTPError, KeyError, ValueError) as e:
            log.warning("moving session %s failed: %s", sid, e)
        return None


async def _report() -> dict:
    body = await request.get_json(force=True, silent=True)
    if body is None:
        raise ReportError("body must be JSON")
    return body


def _registry_routes(app: Quart, router: Dispatch) -> None:
    """What serve instances call: register, heartbeat, deregister, drain."""
    registry = router.registry

    @app.route("/registry/register", methods=["POST"])
    async def register():
        inst = registry.register(await _report())
        log.info("instance %s registered at %s serving %s", inst.id, inst.url, sorted(inst.models))
        return {"instance_id": inst.id, "heartbeat_s": HEARTBEAT_S, "ttl_s": registry.ttl_s}

    @app.route("/registry/heartbeat", methods=["POST"])
    async def heartbeat():
        inst = registry.heartbeat(await _report())
        if inst is None:
            return error_response(404, "not_found", "unknown instance: register again")
        return {"instance_id": inst.id}

    @app.route("/registry/deregister", methods=["POST"])
    async def deregister():
        body = await request.get_json(force=True, silent=True) or {}
        iid = body.get("instance_id") if isinstance(body, dict) else None
        if not registry.deregister(iid):
            return error_response(404, "not_found", "unknown instance")
        log.info("instance %s deregistered", iid)
        return {"instance_id": iid, "deregistered": True}

    @app.route("/registry/drain", methods=["POST"])
    async def drain():
        """An instance about to stop (POST /admin/drain, SIGTERM): no new work goes there, and its
        idle sessions move to another live replica of their model (export there, restore here), so
        their next turns stay warm. Body: {"instance_id", "sessions": [{"id", "model"}]}."""
        body = await request.get_json(force=True, silent=True) or {}
        inst = registry.get(body.get("instance_id") if isinstance(body, dict) else None)
        if inst is None:
            return error_response(404, "not_found", "unknown instance")
        inst.draining = True
        sessions = body.get("sessions") if isinstance(body.get("sessions"), list) else []
        moved, failed = [], []
        for item in sessions:
            sid, model = (item.get("id"), item.get("model")) if isinstance(item, dict) else (None, None)
            if not isinstance(sid, str) or not isinstance(model, str):
                continue
            where = await router.move_session(inst, sid, model)
            (moved if where else failed).append({"id": sid, "to": where} if where else {"id": sid})
        log.info("instance %s draining: moved %d sessions, %d could not move", inst.id, len(moved), len(failed))
        return {"instance_id": inst.id, "moved": moved, "failed": failed}


def _client_routes(app: Quart, router: Dispatch) -> None:
    """Health, the aggregated model list, and every generating (or model-reading) route: each goes
    to an instance serving the body's model, the session's instance first. Kept Responses live on
    the instance that made them: a chain through the router stays on one instance when it carries
    a prompt_cache_key (its session)."""
    registry = router.registry

    @app.route("/", methods=["GET"])
    @app.route("/health", methods=["GET"])
    async def health():
        live = registry.live()
        return {"service": "pantheon-router", "status": "ok", "live_instances": len(live),
                "instances": [{"id": i.id, "url": i.url, "models": sorted(i.models), "sessions": len(i.sessions)}
                              for i in live]}

    @app.route("/v1/models", methods=["GET"])
    @app.route("/models", methods=["GET"])
    async def models():
        return {"object": "list", "data": registry.models()}

    @app.route("/props", methods=["GET"])
    async def props():  # an instance serving `?model=` (any one: they load the same files)
        targets = router.pick(request.args.get("model"), None)
        if isinstance(targets, Response):
            return targets
        path = request.full_path if request.query_string else request.path
        return await router.relay(targets, "GET", path, None, None)

    @app.route("/v1/chat/completions", methods=["POST"])
    @app.route("/chat/completions", methods=["POST"])
    @app.route("/v1/completions", methods=["POST"])
    @app.route("/completions", methods=["POST"])
    @app.route("/v1/messages", methods=["POST"])
    @app.route("/v1/messages/count_tokens", methods=["POST"])
    @app.route("/v1/chat/completions/input_tokens", methods=["POST"])
    @app.route("/chat/completions/input_tokens", methods=["POST"])
    @app.route("/v1/responses", methods=["POST"])
    @app.route("/responses", methods=["POST"])
    @app.route("/v1/responses/input_tokens", methods=["POST"])
    @app.route("/responses/input_tokens", methods=["POST"])
    @app.route("/v1/embeddings", methods=["POST"])
    @app.route("/embeddings", methods=["POST"])
    @app.route("/embedding", methods=["POST"])
    @app.route("/completion", methods=["POST"])
    @app.route("/tokenize", methods=["POST"])
    @app.route("/detokenize", methods=["POST"])
    @app.route("/apply-template", methods=["POST"])
    @app.route("/infill", methods=["POST"])
    async def chat():
        raw = await request.get_data()
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(400, "invalid_request_error", "request body is not valid JSON")
        body = body if isinstance(body, dict) else {}
        sid = request.headers.get("X-Session-Id") or next(
            (body[k] for k in ("session_id", "prompt_cache_key") if isinstance(body.get(k), str) and body[k]), None)
        targets = router.pick(body.get("model"), sid)
        if isinstance(targets, Response):
            return targets
        return await router.relay(targets, "POST", request.path, raw, sid, stream=body.get("stream") is True)


def _session_routes(app: Quart, router: Dispatch) -> None:
    """The /session/* routes, to the instance holding the session (else any that can take it)."""
    registry = router.registry

    @app.route("/session/restore", methods=["POST"])
    async def session_restore():
        raw = await request.get_data()
        body = _json(raw)
        targets = router.pick(body.get("name"), body.get("session_id") if isinstance(body.get("session_id"), str) else None)
        if isinstance(targets, Response):
            return targets
        return await router.relay(targets, "POST", request.path, raw, body.get("session_id"))

    @app.route("/session/release", methods=["POST"])
    async def session_release():
        raw = await request.get_data()
        body = _json(raw)
        sid = body.get("session_id") if isinstance(body.get("session_id"), str) else request.headers.get("X-Session-Id")
        holder = registry.holder(sid) if sid else None
        targets = [holder] if holder else registry.candidates(None)
        if not targets:
            return router.no_instances()
        return await router.relay(targets, "POST", request.path, raw, sid, retry_on=(404,) + RETRYABLE)

    @app.route("/session/estimate", methods=["GET"])
    @app.route("/session/watch", methods=["GET"])
    async def session_get():
        sid = request.args.get("session_id") or request.headers.get("X-Session-Id")
        holder = registry.holder(sid) if sid else None
        targets = [holder] if holder else registry.candidates(request.args.get("name"))
        if not targets:
            return router.no_instances()
        path = request.full_path if request.query_string else request.path
        return await router.relay(targets, "GET", path, None, sid, stream=request.path.endswith("watch"))


def _streamed(resp: httpx.Response, inst: Instance, headers: dict) -> Response:
    async def chunks():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:  # the end, an error, or the client gone: close upstream (the instance cancels)
            await resp.aclose()
            inst.inflight -= 1

    out = Response(chunks(), status=resp.status_code, headers=headers)
    out.timeout = None
    return out


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class EnvApp:
    """`hypercorn pantheon.router:app`: built from the environment (PANTHEON_ROUTER_TTL) on first use."""

    def __init__(self):
        self._app: Quart | None = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            self._app = create_app(router_ttl_s(), admin_token=admin_token())
        await self._app(scope, receive, send)


app = EnvApp()
