"""Parse tool calls out of model output, streamed or complete.

`ToolCallParser(dialect, tools)` is fed the answer text piece by piece (`push`) and returns
`ParseEvents`: an ordered list of

* `ContentDelta(text)`: answer text that is safe to show. No part of a call is ever in it: a
  suffix that may be the start of a call opener (e.g. "<tool_" or a line-start "{") is held back
  until the next piece decides it. Whitespace between content and a call is dropped (the call
  turn's `content` should not end in "\\n\\n").
* `ToolCallStart(index, id, name)`: a call opens (`id` is `call_<24 random alphanumerics>`).
* `ToolCallArgs(index, fragment)`: JSON text of the call's arguments; the fragments of one call
  concatenate to a JSON object, typed from the tool's JSON schema.

By default a call's events come out together once the call is complete and valid, so nothing is
announced that is later dropped and streaming and non-streaming agree exactly. With
`incremental=True` the call opens as soon as its function name is read and each
argument follows as soon as its value is complete; a call that then fails validation or never
finishes has already been announced, and its error carries its `index`.

`finish()` ends the stream: held-back text is released, and a call that began but did not
finish is dropped and reported. Errors (`ToolCallError`, `to_dict()` gives the contract's
`tool_call_error` entry `{code, function?, parameter?, message}`):

  unfinished_call   the output ended inside a call
  malformed_call    call syntax that cannot be read (stray text inside a call, bad JSON, ...)
  unknown_function  a call to a function that was not offered (not a call then)
  invalid_argument  a value that cannot be converted to its schema type
  missing_argument  a `required` parameter was not given
  unknown_argument  a parameter the schema does not define, with additionalProperties: false

XML values: Qwen3-Coder puts every value on its own lines, so one leading and one trailing newline
are stripped. MiniCPM's template writes values (and CDATA sections) with no newline around them,
so its values are kept exactly: a file content that ends in "\n" keeps it.

Argument typing (`coerce_text` for XML values, `coerce_value` for JSON values): the schema's
`type` (a list is tried in order; `enum`/`const`/`anyOf`/`oneOf`/local `$ref` are followed) decides:
integer ("3", "3.0"), number, boolean ("true"/"false", any case), null ("null"/"None"),
array/object (JSON, then a Python literal as fallback), string (raw text). "null" is read as
null whenever null is allowed. Without a
schema, a value that is a JSON object or array is parsed, anything else stays a string.

Think blocks: the parser expects the answer text after the reasoning splitter. If it is fed raw
output, a leading `<think>...</think>` (or everything up to `</think>` with
`start_in_reasoning=True`) is passed through as content untouched and call openers inside it are
ignored.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pantheon.text.tools.dialects import JSON_SEPARATORS, Dialect, ToolSpec, get_dialect, normalize_tools

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=JSON_SEPARATORS)


# ---- results and events -------------------------------------------------------------------------

@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return _dumps(self.arguments)

    def to_dict(self) -> dict:
        """The OpenAI `message.tool_calls[]` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class ToolCallError:
    code: str
    message: str
    function: str | None = None
    parameter: str | None = None
    index: int | None = None  # set only when the call had been announced (incremental mode)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"code": self.code}
        if self.function is not None:
            d["function"] = self.function
        if self.parameter is not None:
            d["parameter"] = self.parameter
        d["message"] = self.message
        if self.index is not None:
            d["index"] = self.index
        return d


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str

    def to_delta(self) -> dict:
        """The streaming `delta.tool_calls[]` entry that opens this call."""
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}


@dataclass
class ToolCallArgs:
    index: int
    fragment: str

    def to_delta(self) -> dict:
        return {"index": self.index, "function": {"arguments": self.fragment}}


@dataclass
class ParseEvents:
    events: list = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, ContentDelta))

    @property
    def tool_events(self) -> list:
        return [e for e in self.events if not isinstance(e, ContentDelta)]

    def __bool__(self) -> bool:
        return bool(self.events)

    def extend(self, other: ParseEvents) -> None:
        for e in other.events:
            self._add(e)

    def _add(self, e) -> None:
        if isinstance(e, ContentDelta):
            if not e.text:
                return
            if self.events and isinstance(self.events[-1], ContentDelta):
                self.events[-1] = ContentDelta(self.events[-1].text + e.text)
                return
        self.events.append(e)


# ---- argument typing ----------------------------------------------------------------------------

class _CoerceError(ValueError):
    pass


_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")


def _json_type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _resolve_ref(schema: dict, root: dict | None) -> dict | None:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#") or root is None:
        return None
    node: Any = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def schema_types(schema: Any, root: dict | None = None, _depth: int = 0) -> list[str] | None:
    """The JSON types a schema allows, in the order to try them; None = anything."""
    if not isinstance(schema, dict) or _depth > 16:
        return None
    if "$ref" in schema:
        target = _resolve_ref(schema, root)
        return schema_types(target, root, _depth + 1) if target is not None else None
    t = schema.get("type")
    if isinstance(t, str) and t in _JSON_TYPES:
        return [t]
    if isinstance(t, list):
        ts = [x for x in t if x in _JSON_TYPES]
        return ts or None
    if "const" in schema:
        return [_json_type_of(schema["const"])]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        out: list[str] = []
        for v in schema["enum"]:
            jt = _json_type_of(v)
            if jt not in out:
                out.append(jt)
        return out
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out = []
            for sub in schema[key]:
                ts = schema_types(sub, root, _depth + 1)
                if ts is None:
                    return None
                out += [x for x in ts if x not in out]
            return out or None
    if isinstance(schema.get("allOf"), list):
        for sub in schema["allOf"]:
            ts = schema_types(sub, root, _depth + 1)
            if ts is not None:
                return ts
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return None


_INT_RE = re.compile(r"[-+]?\d+")


def _as_type(raw: str, t: str) -> Any:
    """Convert stripped text to JSON type t, or raise _CoerceError."""
    s = raw.strip()
    if t == "string":
        return raw
    if t == "null":
        if s in ("null", "None"):
            return None
        raise _CoerceError("not null")
    if t == "boolean":
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
        raise _CoerceError("not a boolean")
    if t == "integer":
        if _INT_RE.fullmatch(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            raise _CoerceError("not an integer") from None
        if math.isfinite(f) and f.is_integer():
            return int(f)
        raise _CoerceError("not an integer")
    if t == "number":
        if _INT_RE.fullmatch(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            raise _CoerceError("not a number") from None
        if not math.isfinite(f):
            raise _CoerceError("not a finite number")
        return f
    if t in ("array", "object"):
        want = list if t == "array" else dict
        try:
            v = json.loads(s)
        except (json.JSONDecodeError, RecursionError):
            try:  # Python literal (single quotes, True/False/None): some models write those
                v = ast.literal_eval(s)
                json.dumps(v)
            except Exception:
                raise _CoerceError(f"not a JSON {t}") from None
        if isinstance(v, tuple) and want is list:
            v = list(v)
        if not isinstance(v, want):
            raise _CoerceError(f"not a JSON {t}")
        return v
    raise _CoerceError(f"unknown type {t}")


def coerce_text(raw: str, schema: Any, root: dict | None = None) -> Any:
    """Type an XML parameter value (raw text) from its schema; raises ValueError."""
    types = schema_types(schema, root)
    if types is None:
        s = raw.strip()
        if s[:1] in ("{", "["):
            try:
                v = json.loads(s)
                if isinstance(v, (dict, list)):
                    return v
            except (json.JSONDecodeError, RecursionError):
                pass
        return raw
    if "null" in types and raw.strip() in ("null", "None"):
        return None
    for t in types:
        try:
            return _as_type(raw, t)
        except _CoerceError:
            pass
    raise ValueError(f"expected {' or '.join(types)}, got {_short(raw)}")


def coerce_value(v: Any, schema: Any, root: dict | None = None) -> Any:
    """Type a JSON argument value from its schema: kept when its type is allowed, else converted
    (a string holding a number / JSON, a number or literal for a string parameter); raises
    ValueError."""
    types = schema_types(schema, root)
    if types is None:
        return v
    jt = _json_type_of(v)
    if jt in types:
        return v
    if jt == "integer" and "number" in types:
        return v
    if jt == "number" and "integer" in types and math.isfinite(v) and float(v).is_integer():
        return int(v)
    if isinstance(v, str):
        if "null" in types and v.strip() in ("null", "None"):
            return None
        for t in types:
            if t == "string":
                continue
            try:
                return _as_type(v, t)
            except _CoerceError:
                pass
    elif "string" in types and jt in ("integer", "number", "boolean"):
        return _dumps(v)
    raise ValueError(f"expected {' or '.join(types)}, got {jt} {_short(_dumps(v))}")


def _short(s: str, n: int = 40) -> str:
    s = repr(s)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---- scanning helpers ---------------------------------------------------------------------------

_WS = " \t\r\n"


def _skip_ws(s: str, k: int) -> int:
    n = len(s)
    while k < n and s[k] in _WS:
        k += 1
    return k


def _partial_suffix(s: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of s that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for k in range(min(len(s), len(tag) - 1), best, -1):
            if s.endswith(tag[:k]):
                best = k
                break
    return best


def _is_prefix_of_any(rest: str, tags: Iterable[str]) -> bool:
    return any(t.startswith(rest) for t in tags)


def _strip_one_newline(v: str) -> str:
    if v.startswith("\r\n"):
        v = v[2:]
    elif v.startswith("\n"):
        v = v[1:]
    if v.endswith("\r\n"):
        v = v[:-2]
    elif v.endswith("\n"):
        v = v[:-1]
    return v


_XML_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&"))


def _xml_unescape(v: str) -> str:
    if "&" not in v:
        return v
    for a, b in _XML_ENTITIES:
        v = v.replace(a, b)
    return v


class _JsonExtent:
    """Resumable scan for the end of a JSON object/array that starts at `start` (strings and
    escapes respected). `feed(s)` returns the end offset, None while incomplete."""

    def __init__(self, start: int):
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.end: int | None = None

    def feed(self, s: str) -> int | None:
        if self.end is not None:
            return self.end
        i, n = self.pos, len(s)
        depth, in_str, esc = self.depth, self.in_str, self.esc
        while i < n:
            c = s[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth <= 0:
                    self.end = i
                    break
        self.pos, self.depth, self.in_str, self.esc = i, depth, in_str, esc
        return self.end


class _JsonCallProgress:
    """Partial read of one streaming call object (`{"name": ..., "arguments": {...}}`, also
    `{"function": {...}}` / "parameters"): the name once its string is complete, and each top-level
    argument once its value is complete and followed by "," or "}" (a number may still grow until
    then). `read(buf)` resumes where the last read stopped; `raw(known)` is the progress as a
    partial `_RawCall` (None until a known function's name is read)."""

    _dec = json.JSONDecoder()

    def __init__(self, start: int):
        self.start = start
        self.stack: list[list] = [["call", start + 1, False]]  # [role, pos, expecting "," or "}"]
        self.name: str | None = None
        self.params: list = []
        self.args_seen = False
        self.dead = False

    def read(self, buf: str) -> None:
        n = len(buf)
        while self.stack and not self.dead:
            top = self.stack[-1]
            role, pos, delim = top
            k = _skip_ws(buf, pos)
            if k >= n:
                return
            if delim or buf[k] == "}":
                if buf[k] == "," and delim:
                    top[1], top[2] = k + 1, False
                    continue
                if buf[k] != "}":
                    self.dead = True
                    return
                self.stack.pop()
                if self.stack:
                    self.stack[-1][1], self.stack[-1][2] = k + 1, True
                continue
            if buf[k] != '"':
                self.dead = True
                return
            try:
                key, e = self._dec.raw_decode(buf, k)
            except (json.JSONDecodeError, RecursionError):
                return
            e = _skip_ws(buf, e)
            if e >= n:
                return
            if buf[e] != ":":
                self.dead = True
                return
            v = _skip_ws(buf, e + 1)
            if v >= n:
                return
            if role == "call" and buf[v] == "{" and (
                    key == "function" or (key in ("arguments", "parameters") and not self.args_seen)):
                if key != "function":
                    self.args_seen = True
                top[1], top[2] = v, True  # resumed by the child's closing "}"
                self.stack.append(["args" if key != "function" else "call", v + 1, False])
                continue
            try:
                val, e = self._dec.raw_decode(buf, v)
            except (json.JSONDecodeError, RecursionError):
                return
            e2 = _skip_ws(buf, e)
            if e2 >= n:
                return
            if buf[e2] not in ",}":
                self.dead = True
                return
            if role == "args":
                self.params.append((key, val))
            elif key == "name" or (key == "function" and isinstance(val, str)):
                if isinstance(val, str) and self.name is None:
                    self.name = val
            top[1], top[2] = e, True

    def raw(self, known: set[str]) -> _RawCall | None:
        if self.dead or self.name is None or self.name not in known:
            return None
        return _RawCall(name=self.name, params=list(self.params), is_json=True)


# scan statuses
NEED_MORE, DONE, MALFORMED, NOT_CALL = "need_more", "done", "malformed", "not_call"


@dataclass
class _RawCall:
    name: str | None = None
    params: list = field(default_factory=list)  # XML: [(key, raw text)]
    json_args: Any = None                       # JSON: the parsed arguments value
    is_json: bool = False
    error: str | None = None                    # a problem found while reading the call


@dataclass
class _Scan:
    status: str
    end: int = 0
    calls: list = field(default_factory=list)  # complete _RawCalls (DONE)
    partial: _RawCall | None = None            # progress so far (NEED_MORE, XML dialects)
    message: str = ""
    parameter: str | None = None


def _unfinished(partial: _RawCall | None, n: int, what: str) -> _Scan:
    sc = _Scan(MALFORMED, n, partial=partial, message=what)
    sc.status = "unfinished"
    return sc


def _json_call_entries(obj: Any, known: set[str]) -> list[_RawCall] | None:
    """Calls in a parsed JSON value, or None if it is not call-shaped (then it is content)."""
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return None
    out = []
    for it in items:
        if not isinstance(it, dict):
            return None
        name, args, has_args = it.get("name"), None, False
        fn = it.get("function")
        if isinstance(fn, dict):
            name = fn.get("name")
            for k in ("arguments", "parameters"):
                if k in fn:
                    args, has_args = fn[k], True
                    break
        elif isinstance(fn, str) and name is None:
            name = fn
        if not isinstance(name, str):
            return None
        if not has_args:
            for k in ("arguments", "parameters"):
                if k in it:
                    args, has_args = it[k], True
                    break
        call = _RawCall(name=name, is_json=True)
        if not has_args:
            if name not in known:
                return None  # e.g. {"name": "Ada", "age": 3}: an answer, not a call
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                call.error = "arguments is a string that is not JSON"
        if args is None:
            args = {}
        if call.error is None and not isinstance(args, dict):
            call.error = "arguments must be a JSON object"
        call.json_args = args
        out.append(call)
    return out


# ---- per-dialect scanners -----------------------------------------------------------------------
# A scanner is created per call; `scan(buf, final)` reads the call that starts at buf[0].

class _QwenScanner:
    OPEN, BARE = "<tool_call>", "<function="
    CLOSE, FN_CLOSE, P_OPEN, P_CLOSE = "</tool_call>", "</function>", "<parameter=", "</parameter>"
    # a call ends with ">" (a tag) or "}" (JSON body): no rescan is needed for pieces without these
    TRIGGER_CHARS = ">}]"

    def __init__(self, known: set[str]):
        self.known = known
        self.json = None
        self.progress: _JsonCallProgress | None = None

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        idx = [i for i in (buf.find(cls.OPEN), buf.find(cls.BARE)) if i >= 0]
        if idx:
            return min(idx), 0
        return None, len(buf) - _partial_suffix(buf, (cls.OPEN, cls.BARE))

    def _skip_to_close(self, buf: str, k: int, wrapped: bool, final: bool, msg: str, partial) -> _Scan:
        """Malformed call: swallow it up to its closing tag (wait for it unless final)."""
        tag = self.CLOSE if wrapped else self.FN_CLOSE
        e = buf.find(tag, k)
        if e >= 0:
            return _Scan(MALFORMED, e + len(tag), partial=partial, message=msg)
        if not final:
            return _Scan(NEED_MORE, partial=partial)
        return _Scan(MALFORMED, len(buf), partial=partial, message=msg)

    def scan(self, buf: str, final: bool) -> _Scan:
        wrapped = buf.startswith(self.OPEN)
        k = len(self.OPEN) if wrapped else 0
        n = len(buf)
        if wrapped:
            k = _skip_ws(buf, k)
            if k == n:
                return _unfinished(None, n, "the output ended right after <tool_call>") if final \
                    else _Scan(NEED_MORE)
            if buf[k] in "{[":  # a JSON body (Qwen2.5/Hermes style) is read too
                return self._scan_json_body(buf, k, final)
            if not buf.startswith(self.BARE, k):
                if self.BARE.startswith(buf[k:]):
                    return _unfinished(None, n, "the output ended inside the call") if final else _Scan(NEED_MORE)
                return self._skip_to_close(buf, k, True, final, "expected <function=NAME> after <tool_call>", None)
        # <function=NAME>
        k += len(self.BARE)
        gt = buf.find(">", k)
        if gt < 0:
            if "\n" in buf[k:] or "<" in buf[k:]:
                return self._skip_to_close(buf, k, wrapped, final, "unterminated <function=...> tag", None)
            return _unfinished(None, n, "the output ended inside <function=...>") if final else _Scan(NEED_MORE)
        name = buf[k:gt].strip()
        call = _RawCall(name=name)
        if not name or "\n" in name or "<" in name:
            return self._skip_to_close(buf, gt, wrapped, final, "bad function name in <function=...>", None)
        k = gt + 1
        while True:
            k = _skip_ws(buf, k)
            if k == n:
                return _unfinished(call, n, "the output ended inside the call") if final \
                    else _Scan(NEED_MORE, partial=call)
            if buf.startswith(self.P_OPEN, k):
                gt = buf.find(">", k + len(self.P_OPEN))
                if gt < 0:
                    if "\n" in buf[k:]:
                        return self._skip_to_close(buf, k, wrapped, final, "unterminated <parameter=...> tag", call)
                    return _unfinished(call, n, "the output ended inside a <parameter=...> tag") if final \
                        else _Scan(NEED_MORE, partial=call)
                key = buf[k + len(self.P_OPEN):gt].strip()
                vs = gt + 1
                ends = [(e, tag) for tag in (self.P_CLOSE, self.P_OPEN, self.FN_CLOSE, self.CLOSE)
                        if (e := buf.find(tag, vs)) >= 0]
                if not ends:
                    if final:
                        sc = _unfinished(call, n, f"the output ended inside the value of {key!r}")
                        sc.parameter = key
                        return sc
                    return _Scan(NEED_MORE, partial=call)
                e, tag = min(ends)
                call.params.append((key, _strip_one_newline(buf[vs:e])))
                k = e + len(self.P_CLOSE) if tag == self.P_CLOSE else e
                continue
            if buf.startswith(self.FN_CLOSE, k):
                k += len(self.FN_CLOSE)
                k2 = _skip_ws(buf, k)
                if buf.startswith(self.CLOSE, k2):
                    return _Scan(DONE, k2 + len(self.CLOSE), calls=[call])
                if k2 == n or self.CLOSE.startswith(buf[k2:]):
                    if not final:
                        return _Scan(NEED_MORE, partial=call)
                    return _Scan(DONE, n, calls=[call])  # a partial "</tool_c" at the very end is swallowed
                return _Scan(DONE, k, calls=[call])  # no </tool_call>: lenient
            if wrapped and buf.startswith(self.CLOSE, k):  # </function> missing: lenient
                return _Scan(DONE, k + len(self.CLOSE), calls=[call])
            if _is_prefix_of_any(buf[k:], (self.P_OPEN, self.FN_CLOSE, self.CLOSE)):
                return _unfinished(call, n, "the output ended inside the call") if final \
                    else _Scan(NEED_MORE, partial=call)
            return self._skip_to_close(buf, k, wrapped, final, "unexpected text inside the call", call)

    def _progress(self, buf: str, k: int) -> _RawCall | None:
        if buf[k] != "{":
            return None
        if self.progress is None or self.progress.start != k:
            self.progress = _JsonCallProgress(k)
        self.progress.read(buf)
        return self.progress.raw(self.known)

    def _scan_json_body(self, buf: str, k: int, final: bool) -> _Scan:
        if self.json is None or self.json.start != k:
            self.json = _JsonExtent(k)
        end = self.json.feed(buf)
        n = len(buf)
        if end is None:
            return _unfinished(None, n, "the output ended inside the call's JSON") if final else \
                _Scan(NEED_MORE, partial=self._progress(buf, k))
        try:
            obj = json.loads(buf[k:end])
        except (json.JSONDecodeError, RecursionError):
            return self._skip_to_close(buf, end, True, final, "the call's JSON does not parse", None)
        calls = _json_call_entries(obj, self.known)
        if calls is None:
            return self._skip_to_close(buf, end, True, final, "the JSON inside <tool_call> is not a call", None)
        k2 = _skip_ws(buf, end)
        if buf.startswith(self.CLOSE, k2):
            return _Scan(DONE, k2 + len(self.CLOSE), calls=calls)
        if not final and (k2 == n or self.CLOSE.startswith(buf[k2:])):
            return _Scan(NEED_MORE)
        return _Scan(DONE, n if k2 == n or self.CLOSE.startswith(buf[k2:]) else end, calls=calls)


class _MiniCpmScanner:
    OPEN = '<function name="'
    FN_CLOSE = "</function>"
    P_OPENS = ('<param name="', '<parameter name="')
    CDATA, CDATA_END = "<![CDATA[", "]]>"
    TRIGGER_CHARS = ">"

    def __init__(self, known: set[str]):
        self.known = known

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        i = buf.find(cls.OPEN)
        if i >= 0:
            return i, 0
        return None, len(buf) - _partial_suffix(buf, (cls.OPEN,))

    def _malformed(self, buf, k, final, msg, call) -> _Scan:
        e = buf.find(self.FN_CLOSE, k)
        if e >= 0:
            return _Scan(MALFORMED, e + len(self.FN_CLOSE), partial=call, message=msg)
        if not final:
            return _Scan(NEED_MORE, partial=call)
        return _Scan(MALFORMED, len(buf), partial=call, message=msg)

    def _end(self, call, n, final, what, key=None) -> _Scan:
        if final:
            sc = _unfinished(call, n, what)
            sc.parameter = key
            return sc
        return _Scan(NEED_MORE, partial=call)

    def scan(self, buf: str, final: bool) -> _Scan:
        n = len(buf)
        k = len(self.OPEN)
        q = buf.find('"', k)
        if q < 0:
            if any(c in buf[k:] for c in "<>\n"):
                return self._malformed(buf, k, final, "unterminated function name", None)
            return self._end(None, n, final, "the output ended inside <function name=...>")
        call = _RawCall(name=_xml_unescape(buf[k:q]))
        k = _skip_ws(buf, q + 1)
        if k == n:
            return self._end(None, n, final, "the output ended inside <function ...>")
        if buf[k] != ">":
            return self._malformed(buf, k, final, "expected '>' after the function name", None)
        k += 1
        while True:
            k = _skip_ws(buf, k)
            if k == n:
                return self._end(call, n, final, "the output ended inside the call")
            opener = next((p for p in self.P_OPENS if buf.startswith(p, k)), None)
            if opener is not None:
                close = "</param>" if opener == self.P_OPENS[0] else "</parameter>"
                q = buf.find('"', k + len(opener))
                if q < 0:
                    return self._end(call, n, final, "the output ended inside a <param> tag")
                key = _xml_unescape(buf[k + len(opener):q])
                gt = _skip_ws(buf, q + 1)
                if gt == n:
                    return self._end(call, n, final, "the output ended inside a <param> tag", key)
                if buf[gt] != ">":
                    return self._malformed(buf, gt, final, "expected '>' after the parameter name", call)
                vs = gt + 1
                if buf.startswith(self.CDATA, vs) or (not final and n - vs < len(self.CDATA)
                                                      and self.CDATA.startswith(buf[vs:])):
                    if n - vs < len(self.CDATA):
                        return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
                    value, j = "", vs
                    while buf.startswith(self.CDATA, j):  # "]]>" in a value is split across sections
                        ce = buf.find(self.CDATA_END, j + len(self.CDATA))
                        if ce < 0:
                            return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
                        value += buf[j + len(self.CDATA):ce]
                        j = ce + len(self.CDATA_END)
                    j2 = _skip_ws(buf, j)
                    if buf.startswith(close, j2):
                        call.params.append((key, value))
                        k = j2 + len(close)
                        continue
                    if j2 == n or close.startswith(buf[j2:]) or self.CDATA.startswith(buf[j2:]):
                        return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
                    return self._malformed(buf, j2, final, f"expected {close} after the CDATA value of {key!r}", call)
                ends = [e for e in (buf.find(close, vs), buf.find(self.FN_CLOSE, vs)) if e >= 0]
                if not ends:
                    return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
                e = min(ends)
                call.params.append((key, _xml_unescape(buf[vs:e])))
                k = e + len(close) if buf.startswith(close, e) else e
                continue
            if buf.startswith(self.FN_CLOSE, k):
                return _Scan(DONE, k + len(self.FN_CLOSE), calls=[call])
            if _is_prefix_of_any(buf[k:], self.P_OPENS + (self.FN_CLOSE,)):
                return self._end(call, n, final, "the output ended inside the call")
            return self._malformed(buf, k, final, "unexpected text inside the call", call)


_JSON_HEAD = re.compile(r'"(name|function)"\s*:')
_JSON_HEAD_PARTIAL = re.compile(r'"(n(a(m(e)?)?)?|f(u(n(c(t(i(o(n)?)?)?)?)?)?)?)?|"(name|function)"\s*')


class _JsonScanner:
    FENCE, TC_OPEN, TC_CLOSE = "```", "<tool_call>", "</tool_call>"
    TRIGGER_CHARS = ">}]`"

    def __init__(self, known: set[str]):
        self.known = known
        self.extent: _JsonExtent | None = None
        self.progress: _JsonCallProgress | None = None

    _progress = _QwenScanner._progress

    @staticmethod
    def _head(buf: str, p: int) -> bool | None:
        """Does buf[p:] start a call object/array? True / False / None (cannot tell yet)."""
        n = len(buf)
        k = p
        while k < n and buf[k] in " \t":
            k += 1
        if k == n:
            return None
        if buf[k] == "[":
            k = _skip_ws(buf, k + 1)
            if k == n:
                return None
        if buf[k] != "{":
            return False
        k = _skip_ws(buf, k + 1)
        if k == n:
            return None
        if _JSON_HEAD.match(buf, k):
            return True
        return None if _JSON_HEAD_PARTIAL.fullmatch(buf, k) else False

    @classmethod
    def _fence_head(cls, buf: str, p: int) -> bool | None:
        """``` + optional language + newline + a JSON object/array."""
        nl = buf.find("\n", p + 3)
        if nl < 0:
            lang = buf[p + 3:]
            return None if re.fullmatch(r"[A-Za-z_]*[ \t]*", lang) else False
        if not re.fullmatch(r"[A-Za-z_]*[ \t]*", buf[p + 3:nl]):
            return False
        k = _skip_ws(buf, nl + 1)
        if k == len(buf):
            return None
        return buf[k] in "{["

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        cands: list[tuple[int, str]] = []
        if line_start:
            cands.append((0, "bare"))
        i = buf.find("\n")
        while i >= 0:
            cands.append((i + 1, "bare"))
            i = buf.find("\n", i + 1)
        for tag, kind in ((cls.FENCE, "fence"), (cls.TC_OPEN, "tc")):
            i = buf.find(tag)
            while i >= 0:
                cands.append((i, kind))
                i = buf.find(tag, i + 1)
        cands.sort()
        for p, kind in cands:
            if kind == "bare":
                verdict = cls._head(buf, p) if p < len(buf) else None
            elif kind == "fence":
                verdict = cls._fence_head(buf, p)
            else:
                verdict = True
            if verdict is None:
                return None, p
            if verdict:
                if kind == "bare":  # the call starts at its "{" / "[" (leading blanks are content)
                    while buf[p] in " \t":
                        p += 1
                return p, 0
        hold = _partial_suffix(buf, (cls.FENCE, cls.TC_OPEN))
        return None, len(buf) - hold

    def scan(self, buf: str, final: bool) -> _Scan:
        n = len(buf)
        if buf.startswith(self.TC_OPEN):
            k = _skip_ws(buf, len(self.TC_OPEN))
            closer = self.TC_CLOSE
        elif buf.startswith(self.FENCE):
            nl = buf.find("\n", 3)
            if nl < 0:
                return _Scan(NOT_CALL, n) if final else _Scan(NEED_MORE)
            k = _skip_ws(buf, nl + 1)
            closer = self.FENCE
        else:
            k, closer = 0, None
        if k == n:
            return _unfinished(None, n, "the output ended inside the call") if final else _Scan(NEED_MORE)
        if buf[k] not in "{[":
            return self._not_json(buf, k, closer, final, "expected a JSON object")
        if self.extent is None or self.extent.start != k:
            self.extent = _JsonExtent(k)
        end = self.extent.feed(buf)
        if end is None:
            return _unfinished(None, n, "the output ended inside the call's JSON") if final else \
                _Scan(NEED_MORE, partial=self._progress(buf, k))
        try:
            obj = json.loads(buf[k:end])
        except (json.JSONDecodeError, RecursionError):
            return self._not_json(buf, end, closer, final, "the call's JSON does not parse")
        calls = _json_call_entries(obj, self.known)
        if calls is None:
            if closer == self.TC_CLOSE:
                return self._not_json(buf, end, closer, final, "the JSON inside <tool_call> is not a call")
            return self._release(buf, end, closer, final)
        if closer is None:
            return _Scan(DONE, end, calls=calls)
        k2 = _skip_ws(buf, end)
        if buf.startswith(closer, k2):
            return _Scan(DONE, k2 + len(closer), calls=calls)
        if k2 == n or closer.startswith(buf[k2:]):
            return _Scan(NEED_MORE) if not final else _Scan(DONE, n, calls=calls)
        return _Scan(DONE, end, calls=calls)

    def _release(self, buf: str, k: int, closer: str | None, final: bool) -> _Scan:
        """JSON that is not a call: content, up to its end (a fence: up to the closing fence)."""
        if closer is None:
            return _Scan(NOT_CALL, k)
        e = buf.find(closer, k)
        if e >= 0:
            return _Scan(NOT_CALL, e + len(closer))
        return _Scan(NOT_CALL, len(buf)) if final else _Scan(NEED_MORE)

    def _not_json(self, buf: str, k: int, closer: str | None, final: bool, msg: str) -> _Scan:
        if closer == self.TC_CLOSE:
            e = buf.find(closer, k)
            if e >= 0:
                return _Scan(MALFORMED, e + len(closer), message=msg)
            return _Scan(MALFORMED, len(buf), message=msg) if final else _Scan(NEED_MORE)
        if closer is None:  # a bare object whose head looked like a call but whose body is not JSON
            return _Scan(MALFORMED, k, message=msg)
        return self._release(buf, k, closer, final)


_SCANNERS = {"qwen_xml": _QwenScanner, "minicpm_xml": _MiniCpmScanner, "json": _JsonScanner}


# ---- the parser ---------------------------------------------------------------------------------

_START, _THINK, _TEXT, _CALL = "start", "think", "text", "call"


class ToolCallParser:
    def __init__(self, dialect: Dialect | str, tools, *, incremental: bool = False,
                 start_in_reasoning: bool = False, id_factory: Callable[[], str] | None = None,
                 think_tags: tuple[str, str] = ("<think>", "</think>")):
        self.dialect = get_dialect(dialect)
        self.specs: dict[str, ToolSpec] = {s.name: s for s in normalize_tools(tools)}
        self._scanner_cls = _SCANNERS[self.dialect.name]
        self.incremental = incremental
        self._new_id = id_factory or new_call_id
        self._think_open, self._think_close = think_tags
        self._start_in_reasoning = start_in_reasoning
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []
        self._buf = ""
        self._mode = _THINK if start_in_reasoning else _START
        self._line_start = True
        self._ws_hold = ""
        self._lstrip = False
        self._saw_call_syntax = False
        self._scanner = None
        self._next_index = 0
        self._finished = False
        self._inc: dict | None = None  # incremental-mode progress of the current call

    # -- public ---------------------------------------------------------------------------------
    @property
    def in_call(self) -> bool:
        """True while the text fed so far ends inside a (possible) call."""
        return self._mode == _CALL

    def push(self, text: str) -> ParseEvents:
        if self._finished:
            raise RuntimeError("push() after finish()")
        ev = ParseEvents()
        if text:
            quick = self._mode == _CALL and not any(c in text for c in self._scanner_cls.TRIGGER_CHARS)
            self._buf += text
            if not quick or self.incremental:
                self._process(ev, final=False)
        return ev

    def finish(self) -> tuple[ParseEvents, list[ToolCallError]]:
        ev = ParseEvents()
        if not self._finished:
            self._process(ev, final=True)
            if self._ws_hold and not self._saw_call_syntax:
                ev._add(ContentDelta(self._ws_hold))
            self._ws_hold = ""
            self._finished = True
        return ev, list(self.errors)

    def parse_complete(self, text: str) -> tuple[str | None, list[ToolCall], list[ToolCallError]]:
        """Parse a whole output with a fresh parser of the same configuration."""
        p = ToolCallParser(self.dialect, list(self.specs.values()), incremental=False,
                           start_in_reasoning=self._start_in_reasoning, id_factory=self._new_id,
                           think_tags=(self._think_open, self._think_close))
        return _complete(p, text)

    # -- internals ------------------------------------------------------------------------------
    def _emit_text(self, ev: ParseEvents, s: str) -> None:
        if not s:
            return
        self._line_start = s.endswith("\n")
        if self._lstrip:
            s = s.lstrip()
            if not s:
                return
            self._lstrip = False
        s = self._ws_hold + s
        body = s.rstrip()
        self._ws_hold = s[len(body):]
        if body:
            ev._add(ContentDelta(body))

    def _process(self, ev: ParseEvents, final: bool) -> None:
        while True:
            buf = self._buf
            if self._mode == _START:
                body = buf.lstrip()
                if not final and (not body or (self._think_open.startswith(body)
                                               and len(body) < len(self._think_open))):
                    return
                self._mode = _THINK if body.startswith(self._think_open) else _TEXT
                continue
            if self._mode == _THINK:
                idx = buf.find(self._think_close)
                if idx < 0:
                    keep = 0 if final else _partial_suffix(buf, (self._think_close,))
                    self._emit_text(ev, buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                cut = idx + len(self._think_close)
                self._emit_text(ev, buf[:cut])
                self._buf = buf[cut:]
                self._mode, self._line_start = _TEXT, True
                continue
            if self._mode == _TEXT:
                if not buf:
                    return
                start, hold_from = self._scanner_cls.find_start(buf, self._line_start)
                if start is None:
                    if final:
                        hold_from = len(buf)
                    self._emit_text(ev, buf[:hold_from])
                    self._buf = buf[hold_from:]
                    return
                self._emit_text(ev, buf[:start])
                self._buf = buf[start:]
                self._mode = _CALL
                self._scanner = self._scanner_cls(set(self.specs))
                self._inc = None
                continue
            # _CALL
            sc = self._scanner.scan(buf, final)
            if self.incremental:
                if sc.status != DONE:
                    raw0 = sc.partial
                else:  # a JSON call streams only if it was seen open (one object, not a whole array at once)
                    raw0 = sc.calls[0] if len(sc.calls) == 1 else None
                    if raw0 is not None and raw0.is_json and self._inc is None:
                        raw0 = None
                self._incremental_progress(ev, raw0)
            if sc.status == NEED_MORE:
                if not final:
                    return
                sc = _unfinished(sc.partial, len(buf), "the output ended inside the call")
            if sc.status == NOT_CALL:
                text = buf[: sc.end]
                self._buf = buf[sc.end:]
                self._mode = _TEXT
                self._emit_text(ev, text)
                continue
            self._ws_hold = ""  # no whitespace between content and a call
            self._saw_call_syntax = True
            if sc.status == DONE:
                for raw in sc.calls:
                    self._accept(ev, raw)
            else:
                self._reject(sc)
            self._inc = None
            self._buf = buf[sc.end:]
            self._mode, self._line_start, self._lstrip = _TEXT, True, True

    # -- call results ---------------------------------------------------------------------------
    def _error(self, code: str, message: str, function=None, parameter=None, index=None) -> None:
        self.errors.append(ToolCallError(code, message, function, parameter, index))

    def _reject(self, sc: _Scan) -> None:
        name = sc.partial.name if sc.partial is not None else None
        index = self._inc["index"] if self._inc and self._inc.get("index") is not None else None
        if self._inc and self._inc.get("failed"):
            return  # already reported
        if sc.status == "unfinished":
            self._error("unfinished_call", sc.message, name, sc.parameter, index)
        else:
            self._error("malformed_call", sc.message or "the call cannot be read", name, sc.parameter, index)

    def _type_args(self, spec: ToolSpec, raw: _RawCall) -> tuple[dict | None, ToolCallError | None]:
        root = spec.parameters
        props = spec.properties
        addl = root.get("additionalProperties") if isinstance(root, dict) else None
        items = raw.json_args.items() if raw.is_json else raw.params
        out: dict = {}
        for key, val in items:
            sch = props.get(key)
            if sch is None:
                if not spec.additional_allowed:
                    return None, ToolCallError("unknown_argument", f"{spec.name} has no parameter {key!r}",
                                               spec.name, key)
                sch = addl if isinstance(addl, dict) else None
            try:
                out[key] = coerce_value(val, sch, root) if raw.is_json else coerce_text(val, sch, root)
            except ValueError as e:
                return None, ToolCallError("invalid_argument", f"{spec.name}.{key}: {e}", spec.name, key)
        missing = [r for r in spec.required if r not in out]
        if missing:
            return None, ToolCallError("missing_argument",
                                       f"{spec.name}: missing required parameter(s) {', '.join(missing)}",
                                       spec.name, missing[0])
        return out, None

    def _accept(self, ev: ParseEvents, raw: _RawCall) -> None:
        if self.incremental and self._inc is not None:
            return self._finish_incremental(ev, raw)
        if raw.error:
            return self._error("malformed_call", raw.error, raw.name)
        spec = self.specs.get(raw.name or "")
        if spec is None:
            return self._error("unknown_function", f"no tool named {raw.name!r} was offered", raw.name)
        args, err = self._type_args(spec, raw)
        if err is not None:
            self.errors.append(err)
            return
        call = ToolCall(self._next_index, self._new_id(), spec.name, args)
        self._next_index += 1
        self.calls.append(call)
        ev._add(ToolCallStart(call.index, call.id, call.name))
        ev._add(ToolCallArgs(call.index, call.arguments_json))

    # -- incremental mode -----------------------------------------------------------------------
    def _incremental_progress(self, ev: ParseEvents, raw: _RawCall | None) -> None:
        if raw is None or raw.name is None:
            return
        inc = self._inc
        if inc is None:
            spec = self.specs.get(raw.name)
            inc = self._inc = {"spec": spec, "index": None, "id": None, "sent": 0, "args": {},
                               "raw": [], "failed": spec is None}
            if spec is None:
                self._error("unknown_function", f"no tool named {raw.name!r} was offered", raw.name)
                return
            inc["index"], inc["id"] = self._next_index, self._new_id()
            self._next_index += 1
            ev._add(ToolCallStart(inc["index"], inc["id"], spec.name))
        if inc["failed"]:
            return
        spec = inc["spec"]
        root, props = spec.parameters, spec.properties
        addl = root.get("additionalProperties") if isinstance(root, dict) else None
        items = raw.params
        if raw.is_json and raw.json_args is not None:  # the complete call: its parsed arguments
            items = list(raw.json_args.items()) if isinstance(raw.json_args, dict) else []
            if raw.error is None and items[: inc["sent"]] != inc["raw"]:
                inc["failed"] = True
                self._error("malformed_call", f"{spec.name}: the arguments changed after they were streamed",
                            spec.name, None, inc["index"])
                return
        while inc["sent"] < len(items):
            key, val = items[inc["sent"]]
            inc["sent"] += 1
            inc["raw"].append((key, val))
            sch = props.get(key)
            if sch is None:
                if not spec.additional_allowed:
                    inc["failed"] = True
                    self._error("unknown_argument", f"{spec.name} has no parameter {key!r}", spec.name, key,
                                inc["index"])
                    return
                sch = addl if isinstance(addl, dict) else None
            try:
                typed = coerce_value(val, sch, root) if raw.is_json else coerce_text(val, sch, root)
            except ValueError as e:
                inc["failed"] = True
                self._error("invalid_argument", f"{spec.name}.{key}: {e}", spec.name, key, inc["index"])
                return
            frag = ("{" if not inc["args"] else ", ") + _dumps(key) + ": " + _dumps(typed)
            if key in inc["args"]:  # a repeated parameter cannot be streamed twice into one object
                inc["failed"] = True
                self._error("malformed_call", f"{spec.name}: parameter {key!r} given twice", spec.name, key,
                            inc["index"])
                return
            inc["args"][key] = typed
            ev._add(ToolCallArgs(inc["index"], frag))

    def _finish_incremental(self, ev: ParseEvents, raw: _RawCall) -> None:
        inc = self._inc
        if inc["failed"]:
            return
        spec = inc["spec"]
        if raw.error:
            inc["failed"] = True
            return self._error("malformed_call", raw.error, spec.name, None, inc["index"])
        missing = [r for r in spec.required if r not in inc["args"]]
        if missing:
            inc["failed"] = True
            return self._error("missing_argument",
                               f"{spec.name}: missing required parameter(s) {', '.join(missing)}",
                               spec.name, missing[0], inc["index"])
        ev._add(ToolCallArgs(inc["index"], "}" if inc["args"] else "{}"))
        self.calls.append(ToolCall(inc["index"], inc["id"], spec.name, dict(inc["args"])))


def _complete(p: ToolCallParser, text: str):
    ev = p.push(text)
    tail, errors = p.finish()
    ev.extend(tail)
    content = ev.content
    if not content.strip() and (p.calls or errors):
        content = None
    return content, list(p.calls), errors


def parse_complete(text: str, dialect: Dialect | str, tools, *, start_in_reasoning: bool = False,
                   id_factory: Callable[[], str] | None = None):
    """Non-streaming parse: (content or None, [ToolCall], [ToolCallError]). content is None when
    the output was nothing but calls (or failed calls)."""
    p = ToolCallParser(dialect, tools, start_in_reasoning=start_in_reasoning, id_factory=id_factory)
    return _complete(p, text)
