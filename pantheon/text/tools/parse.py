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

Each dialect's syntax is read by its own scanner (dialects/*.py); arguments are typed and
validated by `ArgumentChecker` (arguments.py).

Think blocks: the parser expects the answer text after the reasoning splitter. If it is fed raw
output, a leading `<think>...</think>` (or everything up to `</think>` with
`start_in_reasoning=True`) is passed through as content untouched and call openers inside it are
ignored.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pantheon.text.tools.arguments import ArgumentChecker, ArgumentError
from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.dialects import get_dialect
from pantheon.text.tools.scanning import DONE, NEED_MORE, NOT_CALL, UNFINISHED, RawCall, Scan, partial_suffix, unfinished
from pantheon.text.tools.spec import ToolSpec, dumps, normalize_tools

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# ---- results and events -------------------------------------------------------------------------

@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return dumps(self.arguments)

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


# ---- the parser ---------------------------------------------------------------------------------

_START, _THINK, _TEXT, _CALL = "start", "think", "text", "call"


class ToolCallParser:
    def __init__(self, dialect: Dialect | str, tools, *, incremental: bool = False,
                 start_in_reasoning: bool = False, id_factory: Callable[[], str] | None = None,
                 think_tags: tuple[str, str] = ("<think>", "</think>")):
        self.dialect = get_dialect(dialect)
        self.specs: dict[str, ToolSpec] = {s.name: s for s in normalize_tools(tools)}
        self._scanner_cls = self.dialect.Scanner
        self._checkers: dict[str, ArgumentChecker] = {}
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
        """Consume the buffer, mode by mode, as far as it can be decided (all of it when final)."""
        step = {_START: self._at_start, _THINK: self._in_think, _TEXT: self._in_text, _CALL: self._in_call}
        while step[self._mode](ev, final):
            pass

    # Each mode's step: True to go on (the mode or the buffer changed), False to wait for more text.
    def _at_start(self, ev: ParseEvents, final: bool) -> bool:
        body = self._buf.lstrip()
        if not final and (not body or (self._think_open.startswith(body) and len(body) < len(self._think_open))):
            return False
        self._mode = _THINK if body.startswith(self._think_open) else _TEXT
        return True

    def _in_think(self, ev: ParseEvents, final: bool) -> bool:
        buf = self._buf
        idx = buf.find(self._think_close)
        if idx < 0:
            keep = 0 if final else partial_suffix(buf, (self._think_close,))
            self._emit_text(ev, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        cut = idx + len(self._think_close)
        self._emit_text(ev, buf[:cut])
        self._buf = buf[cut:]
        self._mode, self._line_start = _TEXT, True
        return True

    def _in_text(self, ev: ParseEvents, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        start, hold_from = self._scanner_cls.find_start(buf, self._line_start)
        if start is None:
            if final:
                hold_from = len(buf)
            self._emit_text(ev, buf[:hold_from])
            self._buf = buf[hold_from:]
            return False
        self._emit_text(ev, buf[:start])
        self._buf = buf[start:]
        self._mode = _CALL
        self._scanner = self.dialect.scanner(set(self.specs))
        self._inc = None
        return True

    def _in_call(self, ev: ParseEvents, final: bool) -> bool:
        buf = self._buf
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
                return False
            sc = unfinished(sc.partial, len(buf), "the output ended inside the call")
        if sc.status == NOT_CALL:
            self._buf = buf[sc.end:]
            self._mode = _TEXT
            self._emit_text(ev, buf[: sc.end])
            return True
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
        return True

    # -- call results ---------------------------------------------------------------------------
    def _error(self, code: str, message: str, function=None, parameter=None, index=None) -> None:
        self.errors.append(ToolCallError(code, message, function, parameter, index))

    def _reject(self, sc: Scan) -> None:
        name = sc.partial.name if sc.partial is not None else None
        index = self._inc["index"] if self._inc and self._inc.get("index") is not None else None
        if self._inc and self._inc.get("failed"):
            return  # already reported
        if sc.status == UNFINISHED:
            self._error("unfinished_call", sc.message, name, sc.parameter, index)
        else:
            self._error("malformed_call", sc.message or "the call cannot be read", name, sc.parameter, index)

    def _checker(self, spec: ToolSpec) -> ArgumentChecker:
        if spec.name not in self._checkers:
            self._checkers[spec.name] = ArgumentChecker(spec)
        return self._checkers[spec.name]

    def _type_args(self, spec: ToolSpec, raw: RawCall) -> tuple[dict | None, ToolCallError | None]:
        check = self._checker(spec)
        items = raw.json_args.items() if raw.is_json else raw.params
        out: dict = {}
        try:
            for key, val in items:
                out[key] = check.typed(key, val, is_text=not raw.is_json)
            check.check(out)
        except ArgumentError as e:
            return None, ToolCallError(e.code, e.message, spec.name, e.parameter)
        return out, None

    def _accept(self, ev: ParseEvents, raw: RawCall) -> None:
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
    def _incremental_progress(self, ev: ParseEvents, raw: RawCall | None) -> None:
        if raw is None or raw.name is None:
            return
        inc = self._inc
        if inc is None:
            spec = self.specs.get(raw.name)
            inc = self._inc = {"spec": spec, "index": None, "id": None, "sent": 0, "args": {},
                               "raw": [], "failed": spec is None, "open": None}
            if spec is None:
                self._error("unknown_function", f"no tool named {raw.name!r} was offered", raw.name)
                return
            inc["index"], inc["id"] = self._next_index, self._new_id()
            self._next_index += 1
            ev._add(ToolCallStart(inc["index"], inc["id"], spec.name))
        if inc["failed"]:
            return
        spec = inc["spec"]
        items = raw.params
        if raw.is_json and raw.json_args is not None:  # the complete call: its parsed arguments
            items = list(raw.json_args.items()) if isinstance(raw.json_args, dict) else []
            if raw.error is None and items[: inc["sent"]] != inc["raw"]:
                self._fail(inc, "malformed_call", f"{spec.name}: the arguments changed after they were streamed", None)
                return
        while inc["sent"] < len(items):
            if not self._stream_item(ev, inc, *items[inc["sent"]], is_text=not raw.is_json):
                return
        if raw.open_value is not None:
            self._stream_open_value(ev, inc, *raw.open_value)

    def _stream_item(self, ev: ParseEvents, inc: dict, key: str, val, is_text: bool) -> bool:
        """Stream one more argument of an incremental call (or the rest of the string value that was
        streaming open); False when the call fails (reported)."""
        spec = inc["spec"]
        inc["sent"] += 1
        inc["raw"].append((key, val))
        try:
            typed = self._checker(spec).typed(key, val, is_text=is_text)
        except ArgumentError as e:
            return self._fail(inc, e.code, e.message, e.parameter)
        if key in inc["args"]:  # a repeated parameter cannot be streamed twice into one object
            return self._fail(inc, "malformed_call", f"{spec.name}: parameter {key!r} given twice", key)
        opened = inc["open"]
        inc["open"] = None
        if opened is None:
            frag = ("{" if not inc["args"] else ", ") + dumps(key) + ": " + dumps(typed)
        elif opened[0] == key and isinstance(typed, str) and typed.startswith(opened[1]):
            frag = dumps(typed[len(opened[1]):])[1:-1] + '"'  # the rest of the string streamed so far
        else:
            return self._fail(inc, "malformed_call",
                              f"{spec.name}: the value of {opened[0]!r} changed after it was streamed", opened[0])
        inc["args"][key] = typed
        ev._add(ToolCallArgs(inc["index"], frag))
        return True

    def _fail(self, inc: dict, code: str, message: str, parameter) -> bool:
        inc["failed"] = True
        self._error(code, message, inc["spec"].name, parameter, inc["index"])
        return False

    def _stream_open_value(self, ev: ParseEvents, inc: dict, key: str, sure: str | None) -> None:
        """A string argument still being written streams as it grows: its key and opening quote,
        then each piece of text that is sure to be part of it (JSON-escaped). Only for parameters
        whose schema allows nothing but a string, so its typed value is the text itself."""
        if sure is None or key in inc["args"] or not self._checker(inc["spec"]).string_only(key):
            return
        opened = inc["open"]
        if opened is None:
            opened = inc["open"] = [key, ""]
            ev._add(ToolCallArgs(inc["index"], ("{" if not inc["args"] else ", ") + dumps(key) + ': "'))
        if opened[0] == key and len(sure) > len(opened[1]) and sure.startswith(opened[1]):
            ev._add(ToolCallArgs(inc["index"], dumps(sure[len(opened[1]):])[1:-1]))
            opened[1] = sure

    def _finish_incremental(self, ev: ParseEvents, raw: RawCall) -> None:
        inc = self._inc
        if inc["failed"]:
            return
        spec = inc["spec"]
        if raw.error:
            inc["failed"] = True
            return self._error("malformed_call", raw.error, spec.name, None, inc["index"])
        try:
            self._checker(spec).check(inc["args"])
        except ArgumentError as e:
            inc["failed"] = True
            return self._error(e.code, e.message, spec.name, e.parameter, inc["index"])
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
