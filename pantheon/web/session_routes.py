"""Session routes. Their shapes and validation are complete; the session table itself (prefix cache,
export/restore blobs, watch) arrives with the scheduler/sessions issue, so until then every model
reports `session_caching_disabled` where a live session would be needed."""

from __future__ import annotations

from quart import Blueprint, current_app, request

from pantheon.web.errors import ApiError, invalid
from pantheon.web.openai_routes import _json_body

bp = Blueprint("sessions", __name__)
FALLBACK_PREFILL_TOK_S = 500.0  # before a prefill has been measured (SmolLM2 on 2 CPU cores: ~500)
BLOB_BYTES_PER_TOKEN = 16 * 1024
DEFAULT_UPLOAD_BPS = 12.5e6


def _engine(name):
    if name is not None and not isinstance(name, str):
        raise invalid("'name' must be a string")
    engine = current_app.pantheon.pool.find(name)
    if engine is None:
        raise ApiError(404, "model_not_found", f"model {name!r} not found" if name else "no models loaded")
    return engine


def _no_session_cache(engine):
    return ApiError(400, "session_caching_disabled", f"model {engine.name!r} has no session cache")


async def _body() -> dict:
    body = await _json_body()
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


@bp.route("/admin/session/export", methods=["POST"])
async def session_export():
    body = await _body()
    _session_id(body, header=False)
    raise _no_session_cache(_engine(body.get("name")))


@bp.route("/session/restore", methods=["POST"])
async def session_restore():
    body = await _body()
    _session_id(body)
    if not isinstance(body.get("blob"), str):
        raise invalid("'blob' (base64) is required")
    if not isinstance(body.get("tokens"), list):
        raise invalid("'tokens' is required")
    raise _no_session_cache(_engine(body.get("name")))


@bp.route("/session/release", methods=["POST"])
async def session_release():
    body = await _body()
    sid = _session_id(body)
    _engine(body.get("name"))
    return {"released": True, "session_id": sid}  # idempotent: nothing is held


@bp.route("/session/estimate", methods=["GET"])
async def session_estimate():
    args = request.args

    def positive(key: str, default=None):
        raw = args.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise invalid(f"'{key}' must be a number") from None
        if value <= 0:
            raise invalid(f"'{key}' must be positive")
        return value

    tokens = positive("tokens")
    if tokens is None:
        raise invalid("'tokens' is required and must be positive")
    tokens = int(tokens)
    name = args.get("name")
    engine = current_app.pantheon.pool.find(name)
    blob = int(positive("blob_bytes", tokens * BLOB_BYTES_PER_TOKEN))
    bps = positive("upload_bps", DEFAULT_UPLOAD_BPS)
    rate = (engine.prefill_tok_s if engine and engine.prefill_tok_s else FALLBACK_PREFILL_TOK_S)
    return {"model": engine.name if engine else "", "tokens": tokens, "prefill_tok_per_s": round(rate, 2),
            "cold_reprefill_s": round(tokens / rate, 2), "warm_restore_s": round(blob / bps, 3),
            "blob_bytes_est": blob}


@bp.route("/session/watch", methods=["GET"])
async def session_watch():
    sid = request.args.get("session_id") or request.headers.get("X-Session-Id")
    if not sid:
        raise invalid("'session_id' is required")
    raise _no_session_cache(_engine(request.args.get("name")))
