"""The contract's error body: {"error": {"message", "type", "code": null}}."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Callable

from quart import Request, Response, has_request_context, request
from quart.wrappers.request import Body

from pantheon.gguf.reader import clip

# A body that sends nothing for this long is answered 408 request_timeout: a stalled upload holds
# its worker no longer than hypercorn's keep-alive (header) timeout holds an idle connection.
BODY_IDLE_S = 5.0
# ... and one still incomplete after this long, however it trickles (slowloris); a body allowed
# to be large (a session blob) gets a further second per MiB of its limit.
BODY_TOTAL_S = 60.0


class TimedBody(Body):
    """Quart's request body, counting what has arrived so that a stall can be told from progress."""

    def __init__(self, expected_content_length, max_content_length):
        super().__init__(expected_content_length, max_content_length)
        self.received = 0

    def append(self, data: bytes) -> None:
        self.received += len(data)
        super().append(data)


class LimitedRequest(Request):
    """Quart's Request with per-path body limits and timeouts. `limit_for(path)` (set per app by
    `request_class`) bounds the body: past it reading raises 413 (rendered as the contract's JSON by
    the app) and Quart stops buffering the rest; a Content-Length over it is refused unread. A body
    that stalls for BODY_IDLE_S, or is still incomplete after its total time, raises 408."""

    body_class = TimedBody
    limit_for: Callable[[str], int | None] = staticmethod(lambda path: None)

    def __init__(self, method, scheme, path, *args, **kwargs):
        limit = type(self).limit_for(path)
        if limit is not None:
            kwargs["max_content_length"] = limit
        super().__init__(method, scheme, path, *args, **kwargs)
        self.body_total_s = BODY_TOTAL_S + (limit or 0) / (1 << 20)

    async def get_data(self, cache=True, as_text=False, parse_form_data=False):
        await self._whole_body()
        return await super().get_data(cache, as_text, parse_form_data)

    async def _whole_body(self) -> None:
        body, loop = self.body, asyncio.get_running_loop()
        deadline = loop.time() + self.body_total_s
        complete = body._complete  # Quart's own completion event (set at the end or past the limit)
        while not complete.is_set() and body._must_raise is None:  # (a Content-Length over the limit)
            seen, left = body.received, deadline - loop.time()
            try:
                await asyncio.wait_for(complete.wait(), timeout=max(min(BODY_IDLE_S, left), 0))
            except TimeoutError:
                if body.received == seen or loop.time() >= deadline:
                    stalled = body.received == seen
                    raise ApiError(408, "request_timeout", (
                        f"the request body stalled: nothing arrived for {BODY_IDLE_S:g} s" if stalled else
                        f"the request body did not complete within {self.body_total_s:.0f} s")) from None


def request_class(limit_for: Callable[[str], int | None]) -> type[LimitedRequest]:
    """An app's request class: its body limit per path (`limit_for`, None: the app's
    MAX_CONTENT_LENGTH)."""
    return type("AppRequest", (LimitedRequest,), {"limit_for": staticmethod(limit_for)})


# The one table of statuses: an engine refusal's type -> its HTTP status (anything else an engine
# reports mid-generation is a 500), and a bare HTTP status -> the contract's error type.
STATUS = {"context_over_budget": 422, "server_busy": 429, "model_at_session_capacity": 429}
TYPE_OF_STATUS = {408: "request_timeout"}


def status_of(type_: str) -> int:
    """The HTTP status of an engine RequestError's type."""
    return STATUS.get(type_, 500)


def type_of(status: int) -> str:
    """The contract's error type for a bare HTTP status (Quart's own refusals)."""
    return TYPE_OF_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")


class ApiError(Exception):
    """Raised anywhere in a route; rendered by the app's error handler."""

    def __init__(self, status: int, type_: str, message: str, headers: dict | None = None, **fields):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}
        self.fields = fields  # extra members of the error object (kv_used, kv_cap)


MAX_ERROR_MESSAGE = 2000  # no error body echoes more of a request or a file than this


def error_body(type_: str, message: str, **extra) -> dict:
    return {"error": {"message": clip(message, MAX_ERROR_MESSAGE), "type": type_, "code": None, **extra}}


def error_response(status: int, type_: str, message: str, headers: dict | None = None, **fields) -> Response:
    """The contract's error response; on Anthropic's routes, Anthropic's shape (its SDK reads it)."""
    from pantheon.web.observe import note

    note(error=type_)  # the access log names the refusal
    body = (anthropic_error_body(status, message) if has_request_context() and speaks_anthropic(request.path)
            else error_body(type_, message, **fields))
    return Response(json.dumps(body), status=status, headers=headers or {}, content_type="application/json")


# Anthropic's error types by status: its SDK raises its own exception classes from these.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": clip(message, MAX_ERROR_MESSAGE)}}


def speaks_anthropic(path: str) -> bool:
    """Routes whose clients read Anthropic's error shape."""
    return path.rstrip("/").startswith("/v1/messages")


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


# Deeper than this is refused at parse: nothing in the contract nests anywhere near it (a JSON schema
# of ~30 levels fits), and what walks a body recursively (templates, grammar compiles) stays far
# from Python's recursion limit.
MAX_JSON_DEPTH = 64


def _path(node) -> str:
    """'messages[0].content' from the walk's (parent, key) chain."""
    parts = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    text = "".join(reversed(parts)).lstrip(".")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")  # a key's lone surrogate, as \udXXX text
    return text if len(text) <= 120 else text[:117] + "..."


def check_json(value) -> None:
    """Refuse (400) a parsed body nested deeper than MAX_JSON_DEPTH or holding a string that is not
    valid Unicode (a lone surrogate from a "\\ud800" escape: it cannot be encoded as UTF-8)."""
    stack = [(value, 1, None)]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise invalid(f"'{_path(where) or 'body'}' is not valid Unicode (a lone surrogate "
                                  "escape such as \\ud800)") from None
            continue
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"JSON nested too deeply at '{_path(where)}': at most {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    stack.append((k, depth, where))  # a key is checked as a string of its object
                    stack.append((item, depth + 1, (where, k)))
            else:
                stack.extend((item, depth + 1, (where, i)) for i, item in enumerate(v))


def json_safe(value):
    """A client's value to echo back, with every non-finite number (a literal past f64's range, such
    as 1e309, parses as infinity) as null: a reply holding Infinity is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


class _NonJsonConstant(ValueError):
    """NaN, Infinity or -Infinity in a body: Python's json reads them, JSON has no such literals."""


def _refuse_constant(name: str):
    raise _NonJsonConstant(name)


async def json_body():
    """The request body parsed as JSON; empty, malformed (NaN and Infinity too: not JSON, and a
    value echoed back would make the reply unreadable to clients), nested too deeply or holding
    invalid Unicode -> 400 invalid_request_error."""
    raw = await request.get_data(cache=False)  # no second copy kept on the request (blobs are large)
    if not raw or not raw.strip():
        raise invalid("empty request body")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except _NonJsonConstant as e:
        raise invalid(f"malformed JSON: {e} is not a JSON value") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"malformed JSON: {e}") from None
    except RecursionError:
        raise invalid(f"JSON nested too deeply: at most {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # e.g. an integer literal past the interpreter's digit limit
        raise invalid("malformed JSON: a number literal is too long") from None
    check_json(body)
    return body


def answer_unknown_routes(app) -> None:
    """The contract's 404 body for an unknown route, and for a known path with another method."""
    async def not_found(_):
        return error_response(404, "not_found", "unknown route")

    app.register_error_handler(404, not_found)
    app.register_error_handler(405, not_found)
