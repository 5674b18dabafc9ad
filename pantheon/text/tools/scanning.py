"""The toolkit every dialect's call scanner is built from.

A scanner is created per call (`dialect.scanner(known)`); `scan(buf, final)` reads the call that
starts at buf[0] and answers a `Scan`: NEED_MORE (with the progress so far as a partial
`RawCall`, for argument streaming), DONE (the complete calls and where they end), MALFORMED,
"unfinished" (the output ended inside the call) or NOT_CALL (it was content after all).
`find_start(buf, line_start)` finds where a call may begin and how much text to hold back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# ---- scanning helpers ---------------------------------------------------------------------------

WS = " \t\r\n"


def skip_ws(s: str, k: int) -> int:
    n = len(s)
    while k < n and s[k] in WS:
        k += 1
    return k


def partial_suffix(s: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of s that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for k in range(min(len(s), len(tag) - 1), best, -1):
            if s.endswith(tag[:k]):
                best = k
                break
    return best


def is_prefix_of_any(rest: str, tags: Iterable[str]) -> bool:
    return any(t.startswith(rest) for t in tags)


def sure_prefix(raw: str, end_tags: tuple[str, ...], strip_newlines: bool) -> str | None:
    """The part of a value still being written (raw, up to the end of the output) that is sure to
    start it: a suffix that may begin one of end_tags is held back, and with strip_newlines
    (values on their own lines, `strip_one_newline`) the first newline once it is known and any
    trailing newline characters. None while not even the start can be told."""
    raw = raw[: len(raw) - partial_suffix(raw, end_tags)]
    if strip_newlines:
        if raw in ("", "\r"):
            return None
        raw = raw[2:] if raw.startswith("\r\n") else raw[1:] if raw.startswith("\n") else raw
        raw = raw.rstrip("\r\n")
    return raw


def strip_one_newline(v: str) -> str:
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


def xml_unescape(v: str) -> str:
    if "&" not in v:
        return v
    for a, b in _XML_ENTITIES:
        v = v.replace(a, b)
    return v


class JsonExtent:
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


class JsonCallProgress:
    """Partial read of one streaming call object (`{"name": ..., "arguments": {...}}`, also
    `{"function": {...}}` / "parameters"): the name once its string is complete, and each top-level
    argument once its value is complete and followed by "," or "}" (a number may still grow until
    then), and the sure part of a string argument still being written (`open_value`). `read(buf)`
    resumes where the last read stopped; `raw(known)` is the progress as a partial `RawCall` (None
    until a known function's name is read)."""

    _dec = json.JSONDecoder()

    def __init__(self, start: int):
        self.start = start
        self.stack: list[list] = [["call", start + 1, False]]  # [role, pos, expecting "," or "}"]
        self.name: str | None = None
        self.params: list = []
        self.args_seen = False
        self.dead = False
        self.open_value: tuple[str, str | None] | None = None

    def read(self, buf: str) -> None:
        self.open_value = None
        while self.stack and not self.dead and self._step(buf, self.stack[-1]):
            pass

    def _step(self, buf: str, top: list) -> bool:
        """One step in the innermost open object: a separator or its end, else one member. False
        to wait for more text (or when the text is not a call)."""
        k = skip_ws(buf, top[1])
        if k >= len(buf):
            return False
        if top[2] or buf[k] == "}":  # after a member (or an empty object)
            if buf[k] == "," and top[2]:
                top[1], top[2] = k + 1, False
                return True
            if buf[k] != "}":
                self.dead = True
                return False
            self.stack.pop()
            if self.stack:
                self.stack[-1][1], self.stack[-1][2] = k + 1, True
            return True
        if buf[k] != '"':
            self.dead = True
            return False
        return self._member(buf, top, k)

    def _member(self, buf: str, top: list, k: int) -> bool:
        """"key": value at k; a call's function / arguments object is descended into."""
        n, role = len(buf), top[0]
        try:
            key, e = self._dec.raw_decode(buf, k)
        except (json.JSONDecodeError, RecursionError):
            return False
        e = skip_ws(buf, e)
        if e >= n:
            return False
        if buf[e] != ":":
            self.dead = True
            return False
        v = skip_ws(buf, e + 1)
        if v >= n:
            return False
        if role == "call" and buf[v] == "{" and (
                key == "function" or (key in ("arguments", "parameters") and not self.args_seen)):
            if key != "function":
                self.args_seen = True
            top[1], top[2] = v, True  # resumed by the child's closing "}"
            self.stack.append(["args" if key != "function" else "call", v + 1, False])
            return True
        try:
            val, e = self._dec.raw_decode(buf, v)
        except (json.JSONDecodeError, RecursionError):
            if role == "args" and buf[v] == '"':
                self.open_value = (key, partial_json_string(buf[v + 1:]))
            return False
        e2 = skip_ws(buf, e)
        if e2 >= n:
            return False
        if buf[e2] not in ",}":
            self.dead = True
            return False
        if role == "args":
            self.params.append((key, val))
        elif key == "name" or (key == "function" and isinstance(val, str)):
            if isinstance(val, str) and self.name is None:
                self.name = val
        top[1], top[2] = e, True
        return True

    def raw(self, known: set[str]) -> RawCall | None:
        if self.dead or self.name is None or self.name not in known:
            return None
        return RawCall(name=self.name, params=list(self.params), is_json=True, open_value=self.open_value)


def partial_json_string(body: str) -> str | None:
    """The text of an unterminated JSON string so far (body: after its opening quote), without an
    escape that is not complete yet or a high surrogate still waiting for its pair; None when
    it cannot be read (it will not parse when complete either)."""
    for cut in range(len(body), max(len(body) - 12, 0) - 1, -1):
        try:
            text = json.loads('"' + body[:cut] + '"')
        except json.JSONDecodeError:
            continue
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return None


NOT_A_CALL = "the JSON inside <tool_call> is not a call"

# scan statuses
NEED_MORE, DONE, MALFORMED, UNFINISHED, NOT_CALL = "need_more", "done", "malformed", "unfinished", "not_call"


@dataclass
class RawCall:
    name: str | None = None
    params: list = field(default_factory=list)  # XML: [(key, raw text)]
    json_args: Any = None                       # JSON: the parsed arguments value
    is_json: bool = False
    error: str | None = None                    # a problem found while reading the call
    # the value being written after the complete params: (key, the text sure to start it once it
    # is complete, None while that cannot be told yet); for streaming string arguments
    open_value: tuple[str, str | None] | None = None


@dataclass
class Scan:
    status: str
    end: int = 0
    calls: list = field(default_factory=list)  # complete RawCalls (DONE)
    partial: RawCall | None = None             # progress so far (NEED_MORE, UNFINISHED, MALFORMED)
    message: str = ""
    parameter: str | None = None


def unfinished(partial: RawCall | None, n: int, what: str, parameter: str | None = None) -> Scan:
    """The output ended (at n) inside a call."""
    return Scan(UNFINISHED, n, partial=partial, message=what, parameter=parameter)


def json_call_entries(obj: Any, known: set[str]) -> list[RawCall] | None:
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
        call = RawCall(name=name, is_json=True)
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




class Scanner:
    """Base of the dialects' scanners: one per call, `known` the offered function names.

    TRIGGER_CHARS: a call can only end on a piece holding one of these, so a streaming parser
    that is not reporting progress skips the rescan of pieces without them."""
    TRIGGER_CHARS = ""

    def __init__(self, known: set[str]):
        self.known = known
        self.extent: JsonExtent | None = None
        self.progress: JsonCallProgress | None = None

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        """(where a call starts in buf, or None; with None, how much of buf is surely content —
        the rest may be the start of a call opener and waits for more text)."""
        raise NotImplementedError

    def scan(self, buf: str, final: bool) -> Scan:
        raise NotImplementedError

    def json_end(self, buf: str, k: int) -> int | None:
        """The end of the JSON object/array that starts at buf[k], None while incomplete."""
        if self.extent is None or self.extent.start != k:
            self.extent = JsonExtent(k)
        return self.extent.feed(buf)

    def json_calls_at(self, buf: str, k: int, final: bool) -> Scan | tuple[int, list[RawCall] | None, str]:
        """The JSON call object/array at buf[k]: a Scan while it is incomplete (NEED_MORE with the
        progress, or UNFINISHED when final); once complete (end, calls, problem), calls None with
        the problem in words when it does not parse or is not call-shaped."""
        end = self.json_end(buf, k)
        if end is None:
            return unfinished(None, len(buf), "the output ended inside the call's JSON") if final else \
                Scan(NEED_MORE, partial=self.json_progress(buf, k))
        try:
            obj = json.loads(buf[k:end])
        except (json.JSONDecodeError, RecursionError):
            return end, None, "the call's JSON does not parse"
        calls = json_call_entries(obj, self.known)
        return end, calls, "" if calls is not None else NOT_A_CALL

    def json_progress(self, buf: str, k: int) -> RawCall | None:
        """What an incomplete JSON call object at buf[k] has given so far (name, complete arguments)."""
        if buf[k] != "{":
            return None
        if self.progress is None or self.progress.start != k:
            self.progress = JsonCallProgress(k)
        self.progress.read(buf)
        return self.progress.raw(self.known)
