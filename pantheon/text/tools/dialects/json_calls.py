"""JSON calls (served names starting with "ornith"): a JSON object per call, bare at the start of
a line or fenced in ```json ... ```::

    {"name": NAME, "arguments": {...}}

"function" is accepted for "name", "parameters" for "arguments" (also nested as
`{"function": {"name": ..., "arguments": ...}}`), an array of such objects is several calls, and a
`<tool_call>...</tool_call>` wrapper is tolerated. A JSON object that is not call-shaped (no
known function name and no arguments) is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.rules import GAP, X_GUIDANCE_ARGS, CallRules, Tag, args_schema, json_value, lit
from pantheon.text.tools.scanning import (DONE, MALFORMED, NEED_MORE, NOT_A_CALL, NOT_CALL, Scan, Scanner, partial_suffix,
                                          skip_ws, unfinished)
from pantheon.text.tools.spec import ToolSpec, dumps

_JSON_HEAD = re.compile(r'"(name|function)"\s*:')
_JSON_HEAD_PARTIAL = re.compile(r'"(n(a(m(e)?)?)?|f(u(n(c(t(i(o(n)?)?)?)?)?)?)?)?|"(name|function)"\s*')


class JsonCallScanner(Scanner):
    FENCE, TC_OPEN, TC_CLOSE = "```", "<tool_call>", "</tool_call>"
    TRIGGER_CHARS = ">}]`"

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
            k = skip_ws(buf, k + 1)
            if k == n:
                return None
        if buf[k] != "{":
            return False
        k = skip_ws(buf, k + 1)
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
        k = skip_ws(buf, nl + 1)
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
        hold = partial_suffix(buf, (cls.FENCE, cls.TC_OPEN))
        return None, len(buf) - hold

    def scan(self, buf: str, final: bool) -> Scan:
        n = len(buf)
        if buf.startswith(self.TC_OPEN):
            k = skip_ws(buf, len(self.TC_OPEN))
            closer = self.TC_CLOSE
        elif buf.startswith(self.FENCE):
            nl = buf.find("\n", 3)
            if nl < 0:
                return Scan(NOT_CALL, n) if final else Scan(NEED_MORE)
            k = skip_ws(buf, nl + 1)
            closer = self.FENCE
        else:
            k, closer = 0, None
        if k == n:
            return unfinished(None, n, "the output ended inside the call") if final else Scan(NEED_MORE)
        if buf[k] not in "{[":
            return self._not_json(buf, k, closer, final, "expected a JSON object")
        got = self.json_calls_at(buf, k, final)
        if isinstance(got, Scan):
            return got
        end, calls, problem = got
        if calls is None:
            if closer == self.TC_CLOSE or problem != NOT_A_CALL:
                return self._not_json(buf, end, closer, final, problem)
            return self._release(buf, end, closer, final)
        if closer is None:
            return Scan(DONE, end, calls=calls)
        k2 = skip_ws(buf, end)
        if buf.startswith(closer, k2):
            return Scan(DONE, k2 + len(closer), calls=calls)
        if k2 == n or closer.startswith(buf[k2:]):
            return Scan(NEED_MORE) if not final else Scan(DONE, n, calls=calls)
        return Scan(DONE, end, calls=calls)

    def _release(self, buf: str, k: int, closer: str | None, final: bool) -> Scan:
        """JSON that is not a call: content, up to its end (a fence: up to the closing fence)."""
        if closer is None:
            return Scan(NOT_CALL, k)
        e = buf.find(closer, k)
        if e >= 0:
            return Scan(NOT_CALL, e + len(closer))
        return Scan(NOT_CALL, len(buf)) if final else Scan(NEED_MORE)

    def _not_json(self, buf: str, k: int, closer: str | None, final: bool, msg: str) -> Scan:
        if closer == self.TC_CLOSE:
            e = buf.find(closer, k)
            if e >= 0:
                return Scan(MALFORMED, e + len(closer), message=msg)
            return Scan(MALFORMED, len(buf), message=msg) if final else Scan(NEED_MORE)
        if closer is None:  # a bare object whose head looked like a call but whose body is not JSON
            return Scan(MALFORMED, k, message=msg)
        return self._release(buf, k, closer, final)


class JsonDialect(Dialect):
    name = "json"
    priority = 20
    call_openers = ('{"name": "',)
    call_at_line_start = True
    closers = ("}",)
    Scanner = JsonCallScanner

    call_instructions = (
        "To call a function, reply with one JSON object on its own line, exactly in this form:\n"
        "{\"name\": \"FUNCTION_NAME\", \"arguments\": {\"PARAMETER_NAME\": value}}\n\n"
        "Rules for calls:\n"
        "- \"arguments\" is a JSON object that matches the function's parameter schema; give "
        "every required parameter.\n"
        "- To call several functions, write one object per line.\n"
        "- You may explain what you are about to do before the first call, never after the last.\n"
        "- If no function is needed, answer normally without such an object."
    )

    def serves(self, served_name: str, arch: str, template_adds_bos: bool) -> bool:
        return (served_name or "").lower().startswith("ornith")

    def render_call(self, name: str, args: Mapping) -> str:
        return dumps({"name": name, "arguments": dict(args)})

    def call_rules(self, tag: Tag, specs: list[ToolSpec], typed: bool | str) -> CallRules:
        rules, alts = [], []
        for i, spec in enumerate(specs):
            params = spec.parameters if isinstance(spec.parameters, dict) else {}
            sch = args_schema(spec, params) if typed else {"x-guidance": dict(X_GUIDANCE_ARGS)}
            sch.setdefault("type", "object")
            name = json.dumps(spec.name, ensure_ascii=False)[1:-1]  # as it appears inside a JSON string
            rules.append(f"fnr_{i}: {lit(name + chr(34) + ', ' + chr(34) + 'arguments' + chr(34) + ': ')} "
                         f"{json_value(rules, sch, typed)}")
            alts.append(f"fnr_{i}")
        rules.append(f"fnr: {' | '.join(alts)}")
        open_lit = lit('{"name": "')
        rules.append(f"call: {open_lit} fnr \"}}\"?")
        return CallRules(rules, opener=open_lit, after_open="fnr", call="call", between="\"}\"",
                         tail=f"(\"}}\" {GAP}?)?")


DIALECT = JsonDialect()
