"""The Quart app: `hypercorn pantheon.web:app` serves it, configured from the environment.

Nothing here but HTTP: routes parse requests, ask the model pool and engines, and render the
contract's bodies. Models load in the background at start-up; health answers meanwhile.

`app` is a module-level ASGI callable that builds the Quart app (ServeConfig.from_env()) on its
first event — the lifespan start-up under hypercorn — so importing this module reads nothing."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from pantheon.config import ServeConfig, session_key
from pantheon.engine.backend import accelerator_in_use, build_id, compiled_backend, configure_jax
from pantheon.engine.events import failure_message
from pantheon.engine.memory import limit_thread_caches
from pantheon.engine.pool import ModelPool, PoolError
from pantheon.web.errors import ApiError, answer_unknown_routes, error_response, request_class, type_of
from pantheon.web.observe import note
from pantheon.web.response_store import ResponseStore

log = logging.getLogger("pantheon.web")
# First path segments behind PANTHEON_ADMIN_TOKEN when it is set: /admin/* and /metrics (which
# names the loaded models, their sessions and load failures).
OPERATOR_ROUTES = frozenset({"admin", "metrics"})
# Paths open even with an API key set: health, for load balancers and probes, and the model list
# (llama-server's public endpoints).
OPEN_PATHS = frozenset({"/", "/health", "/v1/models", "/models"})


class ServerState:
    def __init__(self, config: ServeConfig):
        self.config = config
        session_key()  # a malformed PANTHEON_SESSION_KEY stops the start, not the first restore
        self.pool = ModelPool()
        self.backend = compiled_backend()
        self.build = build_id()
        self.started = int(time.time())  # llama-server's Process-Start-Time-Unix on /metrics
        self.shutting_down = False
        self.load_errors: list[dict] = []  # start-up loads that failed: {"model", "path", "error"}
        self.admitting = 0  # chat requests past the shutdown check and not yet admitted by an engine
        self.fetching: list[str] = []  # served names whose file is still being fetched (the default model)
        self.starting: list[str] = []  # configured names whose start-up load has not ended yet
        self.registration = None  # with --router: web/registration.Registration
        self.drained: dict | None = None  # what the router moved when this instance drained
        self.on_all_failed = None  # `pantheon serve`: called when every start-up load failed (it exits)
        self.responses = ResponseStore()  # kept Responses-API responses (store: true)

    def loading(self) -> list[str]:
        """Served names being fetched or loaded: `GET /`'s `loading`; chat answers 503 + Retry-After meanwhile."""
        from pantheon.engine.pool import LOADING

        names = list(self.starting) + list(self.fetching) + [e.config.name for e in self.pool.entries()
                                                              if e.state == LOADING]
        return list(dict.fromkeys(names))

    def idle(self) -> bool:
        """No turn in flight: nothing being planned or admitted, no engine generating."""
        return self.admitting == 0 and not self.pool.any_busy()

    def resolve(self, model, session_id=None):
        """The engine for a request's `model`. A model named while it is still loading gets 503
        model_loading (never another model's answer); one whose start-up load failed, 404 with why."""
        if isinstance(model, str) and model not in self.pool.names():
            if model in self.loading():
                raise ApiError(503, "model_loading", f"model {model!r} is still loading; retry shortly",
                               {"Retry-After": "5"})
            failed = next((f for f in self.load_errors if f["model"] == model), None)
            if failed is not None:
                raise ApiError(404, "model_not_found", f"model {model!r} failed to load: {failed['error']}")
        try:
            return self.pool.resolve(model, session_id)
        except PoolError as e:
            if e.type == "no_models_loaded" and self.loading():
                raise ApiError(503, e.type, "no models loaded (a model is still loading; retry shortly)",
                               {"Retry-After": "5"}) from None
            raise ApiError(e.status, e.type, e.message) from None

    def body_limit(self, path: str) -> int:
        """The request body limit for `path`: PANTHEON_MAX_BODY_BYTES, but a session restore may be
        as large as the largest blob a loaded model can produce, in base64, with its tokens."""
        if path != "/session/restore":
            return self.config.max_body_bytes
        from pantheon.web.session_routes import restore_body_limit

        return max([restore_body_limit(e.engine) for e in self.pool.ready()] + [self.config.max_body_bytes])

    def default_prefill_rate(self) -> float:
        from pantheon.engine.engine import DEFAULT_PREFILL_TOK_S

        return DEFAULT_PREFILL_TOK_S

    def refuse_if_shutting_down(self):
        if self.shutting_down:
            raise ApiError(503, "server_shutting_down", "server is draining for shutdown", {"Retry-After": "1"})

    def load_startup_models(self) -> None:
        from pantheon.default_model import default_model_path

        for path, name in self.startup_models():
            try:
                if path is None:
                    self.fetching.append(name)
                    try:
                        path = str(default_model_path())
                    finally:
                        self.fetching.remove(name)
                self.pool.load(self.config.model_config(path, name))
                log.info("loaded %s", name)
            except Exception as e:  # noqa: BLE001 - reported by GET / and /v1/models (`pantheon serve` exits)
                msg = getattr(e, "message", str(e))
                log.error("could not load %s: %s", path, msg)
                self.load_errors.append({"model": name, "path": path, "error": msg})
            finally:
                if name in self.starting:
                    self.starting.remove(name)
        if not self.pool.ready() and self.load_errors and self.on_all_failed is not None:
            self.on_all_failed()

    def startup_models(self) -> list[tuple[str | None, str]]:
        """(path, served name) of the configured models; path None: the embedded default."""
        from pantheon.default_model import SERVED_NAME

        return [(path, name or (Path(path).name.removesuffix(".gguf") if path else SERVED_NAME))
                for path, name in self.config.models or ((None, None),)]

    def health_status(self) -> str:
        """GET /'s `status`: "ok", or "failed" when every configured model failed to load and none is
        loaded or loading (the server answers nothing but errors until one is loaded)."""
        if self.load_errors and not self.pool.entries() and not self.loading():
            return "failed"
        return "ok"


def create_app(config: ServeConfig | None = None, load_models: bool = True) -> Quart:
    from pantheon.web import (admin_routes, anthropic_routes, completions_routes, dashboard, embeddings_routes,
                              metrics, native_routes, openai_routes, props_routes, responses_routes, session_routes,
                              test_hooks, tokenize_routes)
    from pantheon.web.observe import AccessLog, configure_access_log

    app = Quart("pantheon")
    app.pantheon = state = ServerState(config or ServeConfig.from_env())
    for bp in (openai_routes.bp, completions_routes.bp, anthropic_routes.bp, responses_routes.bp,
               embeddings_routes.bp, tokenize_routes.bp, native_routes.bp, props_routes.bp, admin_routes.bp, session_routes.bp,
               test_hooks.bp, metrics.bp, dashboard.bp):
        app.register_blueprint(bp)
    # One access-log line and the request metrics per request, at the ASGI level: the status sent
    # and the end of the body (a stream's last chunk), whatever route or error produced it.
    state.metrics = metrics.Metrics(state)
    configure_access_log(state.config.access_log)
    app.asgi_app = AccessLog(app.asgi_app, state.config.access_log, state.metrics)

    app.request_class = request_class(state.body_limit)
    app.config["MAX_CONTENT_LENGTH"] = state.config.max_body_bytes
    _lifecycle(app, state, load_models)
    _guard(app, state)
    _health(app, state)
    _error_handlers(app, state)
    answer_unknown_routes(app)
    return app


def _lifecycle(app: Quart, state: ServerState, load_models: bool) -> None:
    """Start-up (drain handlers, JAX, the models' loads in the background, router registration) and
    shut-down (drain, then free the pool)."""

    @app.before_serving
    async def start_loading():
        from pantheon.web import protocol_errors
        from pantheon.web.serve import install_drain

        install_drain(state)
        protocol_errors.install()
        configure_jax()
        limit_thread_caches()
        if load_models:
            state.starting = [name for _, name in state.startup_models()]  # loading() from the first request on
            app.add_background_task(asyncio.to_thread, state.load_startup_models)
        if state.config.router:
            from pantheon.web.registration import Registration
            from pantheon.web.serve import binds

            advertise = state.config.advertise or "http://" + binds(state.config.host, state.config.port)[0]
            state.registration = Registration(state, state.config.router, advertise)
            state.registration.start()

    @app.after_serving
    async def shut_down():
        from pantheon.web.serve import DRAIN_S, drain, uninstall_drain

        # Under hypercorn the drain ran before it stopped accepting; the turns it then cut (past
        # DRAIN_S) free their slots within a step. Another ASGI server: drain here, bounded.
        await drain(state, 5.0 if state.shutting_down else DRAIN_S)  # deregisters from a router first
        uninstall_drain(state)
        await asyncio.to_thread(state.pool.close)


def _guard(app: Quart, state: ServerState) -> None:
    """Every request: CORS preflights, the admin token on operator routes, the API key elsewhere;
    the contract's headers on every response."""
    from pantheon.web import dashboard

    @app.before_request
    async def preflight():
        note(route=request.url_rule.rule if request.url_rule else None)
        if request.method == "OPTIONS":  # answered before any auth check: a preflight carries no token
            asked = request.headers.get("Access-Control-Request-Headers")
            return {}, 200, {"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                             "Access-Control-Allow-Headers": asked or "authorization, content-type, x-session-id",
                             "Access-Control-Max-Age": "86400"}
        # The matched rule as well as the raw path: no spelling of a path (//admin/...) reaches an
        # admin route unguarded.
        paths = (request.path, request.url_rule.rule if request.url_rule else "")
        if paths[1] == dashboard.PATH:  # a static page without data: its script sends the token
            return None
        operator = any(p.lstrip("/").split("/", 1)[0] in OPERATOR_ROUTES for p in paths)
        if state.config.admin_token and operator:
            if not admin_authorized(request.headers.get("Authorization"), state.config.admin_token):
                return error_response(401, "unauthorized", "this route needs Authorization: Bearer <admin token> "
                                                           "(PANTHEON_ADMIN_TOKEN)", {"WWW-Authenticate": "Bearer"})
        if state.config.api_key and not operator and request.path not in OPEN_PATHS:
            given = request.headers.get("x-api-key")
            if not (key_matches(given, state.config.api_key) if given is not None else
                    admin_authorized(request.headers.get("Authorization"), state.config.api_key)):
                return error_response(401, "authentication_error", "this server needs an API key: Authorization: Bearer "
                                                           "<key> or x-api-key: <key>", {"WWW-Authenticate": "Bearer"})

    @app.after_request
    async def contract_headers(response: Response) -> Response:
        if (origin := allowed_origin(state.config.cors_origins, request.headers.get("Origin"))) is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != "*":
                response.headers["Vary"] = "Origin"
        response.headers["Connection"] = "close"
        return response


def allowed_origin(allowed: str, origin: str | None) -> str | None:
    """Access-Control-Allow-Origin for a request from `origin` under --cors-origins: "*" for any (the
    contract's default); with "localhost", the origin itself when it is a loopback one (llama-server's
    special value); with a comma-separated list, the origin itself when listed; else none."""
    if allowed == "*":
        return "*"
    if not origin:
        return None
    if allowed == "localhost":
        from urllib.parse import urlsplit

        try:
            host = urlsplit(origin).hostname or ""
        except ValueError:
            return None
        return origin if host in ("localhost", "127.0.0.1", "::1") else None
    return origin if origin in {o.strip() for o in allowed.split(",")} else None


def _health(app: Quart, state: ServerState) -> None:
    @app.route("/", methods=["GET"])
    async def health():
        import jax

        body = {"service": "pantheon", "status": state.health_status(), "backend": state.backend,
                "build": state.build, "accelerator": accelerator_in_use(), "dies_visible": len(jax.devices()),
                "loading": state.loading(),
                "compiling": [e.config.name for e in state.pool.ready() if e.engine.compiling]}
        if state.load_errors:
            body["load_errors"] = state.load_errors
        return body

    @app.route("/health", methods=["GET"])
    async def readiness():
        """GET /'s body once a model is ready; llama-server's 503 while the models load before that (a
        readiness probe, and llama.cpp's clients, wait on it). GET / answers 200 always (the contract)."""
        if state.loading() and not state.pool.ready():
            return error_response(503, "unavailable_error", "Loading model", {"Retry-After": "5"})
        return await health()


def _error_handlers(app: Quart, state: ServerState) -> None:
    """Every failure in the contract's error shape: ApiError and PoolError as they say, Quart's own
    refusals (413, a body timeout), and anything else as a 500 whose body says what failed."""

    @app.errorhandler(ApiError)
    async def api_error(e: ApiError):
        return error_response(e.status, e.type, e.message, e.headers, **e.fields)

    @app.errorhandler(PoolError)
    async def pool_error(e: PoolError):
        return error_response(e.status, e.type, e.message)


    @app.errorhandler(413)
    async def too_large(_):
        request.body.clear()  # what was buffered up to the limit goes now, not when a cycle is collected
        limit = state.body_limit(request.path)
        if request.path == "/session/restore":
            return error_response(413, "request_too_large", f"request body exceeds {limit} bytes, the largest "
                                                            "session blob a loaded model can produce")
        return error_response(413, "request_too_large", f"request body exceeds {limit} bytes "
                                                        f"(PANTHEON_MAX_BODY_BYTES); shorten the conversation")

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):
        # Quart's own refusals (a body timeout, a bad request it parsed) in the contract's shape,
        # not the generic 500 below that an unregistered HTTPException would otherwise reach.
        status = e.code or 500
        return error_response(status, type_of(status), e.description or e.name)

    @app.errorhandler(Exception)
    async def server_error(e: Exception):
        # The body says what failed in words and carries the id; the log has the exception.
        message = failure_message(log, "internal error", e, f"{request.method} {request.path}")
        return error_response(500, "server_error", message)


def admin_authorized(header: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return key_matches(given, token)


def key_matches(given: str, token: str) -> bool:
    enc = lambda s: s.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(enc(given.strip()), enc(token))


class EnvApp:
    """`hypercorn pantheon.web:app`: an ASGI callable that builds the app from the environment on
    its first event (lifespan included) and forwards every event to it. Hypercorn looks `app` up in
    the module's namespace, so it must be a real attribute; building lazily keeps `import
    pantheon.web` (tests, `pantheon serve`) free of environment reads and model loads."""

    def __init__(self):
        self._app: Quart | None = None

    @property
    def quart(self) -> Quart:
        if self._app is None:
            self._app = create_app()
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        await self.quart(scope, receive, send)


app = EnvApp()
