"""Session routes: export, restore, release, estimate, watch. The session table lives on the
engine's device thread; these routes reach it through `engine.call`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import math

from quart import Blueprint, Response, current_app, request

from pantheon.engine.sessions import SessionError
from pantheon.web import sse
from pantheon.web.errors import ApiError, invalid, json_body

bp = Blueprint("sessions", __name__)
BLOB_BYTES_PER_TOKEN = 16 * 1024
DEFAULT_UPLOAD_BPS = 12.5e6
WATCH_KEEPALIVE_S = 15.0
ESTIMATE_MAX = 2**53  # /session/estimate's tokens, blob_bytes and upload_bps


def _engine(name, session_id=None):
    if name is not None and not isinstance(name, str):
        raise invalid("'name' must be a string")
    engine = current_app.pantheon.pool.find(name, session_id)
    if engine is None:
        raise ApiError(404, "model_not_found", f"model {name!r} not found" if name else "no models loaded")
    return engine


async def _call(engine, fn):
    try:
        return await engine.call(fn)
    except SessionError as e:
        raise ApiError(e.status, e.type, e.message, {"Retry-After": "30"} if e.status == 429 else None) from None


async def _body() -> dict:
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def _session_id(body: dict, header: bool = True) -> str:
    sid = body.get("session_id")
    if not (isinstance(sid, str) and sid) and header:
        sid = request.headers.get("X-Session-Id")
    if not (isinstance(sid, str) and sid):
        raise invalid("'session_id' is required")
    return sid


def restore_body_limit(engine) -> int:
    """The largest /session/restore body `engine` can be sent: its largest blob (a whole window of
    state) in base64, the window's token ids as JSON, and 64 KiB for the rest of the body."""
    blob = engine.max_blob_bytes
    token_chars = len(str(max(engine.spec.n_vocab - 1, 0))) + 2  # "123456, "
    return 4 * -(-blob // 3) + engine.ctx * token_chars + (64 << 10)


@bp.route("/admin/session/export", methods=["POST"])
async def session_export():
    body = await _body()
    sid = _session_id(body, header=False)
    engine = _engine(body.get("name"), sid)
    out = await _call(engine, lambda: engine.export_session(sid))
    data = out.pop("blob")
    return {**out, "blob_b64": base64.b64encode(data).decode()}


@bp.route("/session/restore", methods=["POST"])
async def session_restore():
    body = await _body()
    sid = _session_id(body)
    blob, tokens = body.get("blob"), body.get("tokens")
    if not isinstance(blob, str) or not blob:
        raise invalid("'blob' (base64) is required")
    if not isinstance(tokens, list):
        raise invalid("'tokens' is required")
    engine = _engine(body.get("name"))
    try:
        data = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_session_blob", "'blob' is not valid base64") from None
    return await _call(engine, lambda: engine.restore_session(sid, data, tokens))


@bp.route("/session/release", methods=["POST"])
async def session_release():
    body = await _body()
    sid = _session_id(body)
    engine = _engine(body.get("name"), sid)
    await _call(engine, lambda: engine.table.release(sid))
    return {"released": True, "session_id": sid}


@bp.route("/session/estimate", methods=["GET"])
async def session_estimate():
    args = request.args

    def positive(key: str, default=None, at_least: float = 0.0):
        raw = args.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise invalid(f"'{key}' must be a number") from None
        if not math.isfinite(value):
            raise invalid(f"'{key}' must be a finite number")
        if not value > 0:
            raise invalid(f"'{key}' must be positive")
        if value < at_least:
            raise invalid(f"'{key}' must be at least {at_least:g}")
        if value > ESTIMATE_MAX:  # keeps every quotient below finite (JSON has no Infinity)
            raise invalid(f"'{key}' must be at most {ESTIMATE_MAX}")
        return value

    tokens = positive("tokens")
    if tokens is None:
        raise invalid("'tokens' is required and must be positive")
    tokens = int(tokens)
    engine = current_app.pantheon.pool.find(args.get("name"))  # an unknown name is not an error here
    blob = int(positive("blob_bytes", tokens * BLOB_BYTES_PER_TOKEN))
    bps = positive("upload_bps", DEFAULT_UPLOAD_BPS, at_least=1.0)
    rate = engine.prefill_rate() if engine else current_app.pantheon.default_prefill_rate()
    return {"model": engine.name if engine else "", "tokens": tokens, "prefill_tok_per_s": round(rate, 2),
            "cold_reprefill_s": round(tokens / rate, 2), "warm_restore_s": round(blob / bps, 3),
            "blob_bytes_est": blob}


@bp.route("/session/watch", methods=["GET"])
async def session_watch():
    sid = request.args.get("session_id") or request.headers.get("X-Session-Id")
    if not sid:
        raise invalid("'session_id' is required")
    engine = _engine(request.args.get("name"), sid)
    if not await _call(engine, lambda: engine.table.watch(sid)):
        raise ApiError(503, "watch_unavailable", "the watch table is full")

    async def hold():
        try:
            yield sse.comment("watch established")
            while True:  # the session is never reaped while this connection is open
                await asyncio.sleep(WATCH_KEEPALIVE_S)
                yield sse.comment("keep-alive")
        finally:
            engine.scheduler.put(("call", (lambda: engine.table.unwatch(sid), lambda *_: None)))

    response = Response(hold(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None
    return response
