"""Server-sent events framing."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def comment(text: str) -> bytes:
    return f": {text}\n\n".encode()
