"""Server-sent events framing."""

from __future__ import annotations

import json

from quart import Response

DONE = b"data: [DONE]\n\n"


def event(payload: dict, name: str | None = None) -> bytes:
    """One event; `name` gives it an `event:` line (Anthropic's and the Responses API's streams)."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def comment(text: str) -> bytes:
    return f": {text}\n\n".encode()


def streaming_response(body) -> Response:
    """An SSE response streaming `body` (an async iterator of bytes), with no body timeout."""
    response = Response(body, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None
    return response
