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

    def __init__(self, status: int, type_: str, message: str, headers: dict | None = None, **fields):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}
        self.fields = fields  # extra members of the error object (kv_used, kv_cap)


def error_body(type_: str, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": type_, "code": None, **extra}}


def error_response(status: int, type_: str, message: str, headers: dict | None = None, **fields) -> Response:
    from pantheon.web.observe import note

    note(error=type_)  # the access log names the refusal
    return Response(json.dumps(error_body(type_, message, **fields)), status=status, headers=headers or {},
                    content_type="application/json")


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


async def json_body():
    """The request body parsed as JSON; empty, malformed, nested too deeply or holding invalid
    Unicode -> 400 invalid_request_error."""
    raw = await request.get_data()
    if not raw or not raw.strip():
        raise invalid("empty request body")
    try:
        body = json.loads(raw)
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
