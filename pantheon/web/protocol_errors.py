"""Requests refused before the app sees them: hypercorn's HTTP/1.1 layer (h11) answers a malformed
request line, bad headers, a bad Content-Length or chunk size, oversized headers (431), ... with an
empty body. `install()` gives those answers the contract's error body and headers instead (JSON,
`Access-Control-Allow-Origin: *`, `Connection: close`), by wrapping the one method hypercorn sends
them through (`H11Protocol._send_error_response`, which receives only the status), at lifespan
start-up, the same way serve.install_drain wraps its shutdown trigger.

What this cannot reach (listed in the README): errors after the response has started (a bad chunk
in a body the app already answered), HTTP/2 framing errors (h2 answers those with its own frames),
and a TLS handshake that fails before any HTTP."""

from __future__ import annotations

import json
from itertools import chain

from pantheon.web.errors import error_body
from pantheon.web.serve import patch_once

MESSAGES = {
    400: "malformed HTTP request (the request line, a header, Content-Length or the chunked framing)",
    408: "the request did not arrive in time",
    413: "request too large",
    414: "request target too long",
    431: "request headers too large",
    501: "this Transfer-Encoding is not supported (only chunked)",
    505: "HTTP version not supported",
}


def response_for(status: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The contract's error body and headers for a status h11 chose."""
    message = MESSAGES.get(status, "malformed HTTP request")
    type_ = "request_too_large" if status in (413, 431) else "invalid_request_error"
    body = json.dumps(error_body(type_, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), (b"access-control-allow-origin", b"*")]
    return headers, body


def install() -> None:
    try:
        import h11
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:  # another ASGI server: its own answers stand
        return

    def wrap(original):
        async def _send_error_response(self, status_code: int) -> None:
            headers, body = response_for(status_code)
            await self._send_h11_event(h11.Response(status_code=status_code,
                                                    headers=list(chain(headers, self.config.response_headers("h11")))))
            await self._send_h11_event(h11.Data(data=body))
            await self._send_h11_event(h11.EndOfMessage())

        return _send_error_response

    patch_once(H11Protocol, "_send_error_response", wrap, "malformed requests get its empty-bodied answers")
