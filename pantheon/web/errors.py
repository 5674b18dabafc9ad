"""The contract's error body: {"error": {"message", "type", "code": null}}."""

from __future__ import annotations

import json

from quart import Response, request


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
