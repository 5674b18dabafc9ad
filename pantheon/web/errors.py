"""The contract's error body: {"error": {"message", "type", "code": null}}."""

from __future__ import annotations

import json

from quart import Request, Response, request

# Routes whose bodies are large by nature and exempt from the body limit: a session blob is the
# slot's KV (tens to hundreds of MB, base64).
UNLIMITED_BODY_PATHS = frozenset({"/session/restore"})


class LimitedRequest(Request):
    """Quart's Request; the app's MAX_CONTENT_LENGTH (PANTHEON_MAX_BODY_BYTES) bounds every body
    but UNLIMITED_BODY_PATHS'. Past the limit reading the body raises 413 (rendered as the
    contract's JSON error by the app), and Quart stops buffering the rest."""

    def __init__(self, method, scheme, path, *args, **kwargs):
        if path in UNLIMITED_BODY_PATHS:
            kwargs["max_content_length"] = None
        super().__init__(method, scheme, path, *args, **kwargs)


class ApiError(Exception):
    """Raised anywhere in a route; rendered by the app's error handler."""

    def __init__(self, status: int, type_: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}


def error_body(type_: str, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": type_, "code": None, **extra}}


def error_response(status: int, type_: str, message: str, headers: dict | None = None) -> Response:
    return Response(json.dumps(error_body(type_, message)), status=status, headers=headers or {},
                    content_type="application/json")


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


async def json_body():
    """The request body parsed as JSON; empty or malformed -> 400 invalid_request_error."""
    raw = await request.get_data()
    if not raw or not raw.strip():
        raise invalid("empty request body")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"malformed JSON: {e}") from None
