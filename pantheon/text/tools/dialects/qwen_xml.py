"""Qwen3-Coder's XML calls (the default dialect)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

VALUE is raw text for strings (several lines allowed, no quoting or escaping) and JSON for
numbers, booleans, null, arrays and objects. Qwen3-Coder puts every value on its own lines, so
the scanner strips one leading and one trailing newline. A JSON body inside <tool_call> (the
Qwen2.5/Hermes style) is read too.

Grammar limits: string values cannot contain "</parameter>", "<parameter=", "</function>" or
"</tool_call>"; arguments come in the schema's order.
"""

from __future__ import annotations

from collections.abc import Mapping

from pantheon.text.tools.dialect import Dialect, value_text
from pantheon.text.tools.rules import GAP, CallRules, Tag, function_rules, json_value, lit, string_value, value_kind
from pantheon.text.tools.scanning import (DONE, MALFORMED, NEED_MORE, RawCall, Scan, Scanner, is_prefix_of_any,
                                          partial_suffix, skip_ws, strip_one_newline, sure_prefix, unfinished)
from pantheon.text.tools.spec import ToolSpec


class QwenXmlScanner(Scanner):
    OPEN, BARE = "<tool_call>", "<function="
    CLOSE, FN_CLOSE, P_OPEN, P_CLOSE = "</tool_call>", "</function>", "<parameter=", "</parameter>"
    # a call ends with ">" (a tag) or "}" (JSON body): no rescan is needed for pieces without these
    TRIGGER_CHARS = ">}]"
    VALUE_ENDS = (P_CLOSE, P_OPEN, FN_CLOSE, CLOSE)

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        idx = [i for i in (buf.find(cls.OPEN), buf.find(cls.BARE)) if i >= 0]
        if idx:
            return min(idx), 0
        return None, len(buf) - partial_suffix(buf, (cls.OPEN, cls.BARE))

    def _skip_to_close(self, buf: str, k: int, wrapped: bool, final: bool, msg: str, partial) -> Scan:
        """Malformed call: swallow it up to its closing tag (wait for it unless final)."""
        tag = self.CLOSE if wrapped else self.FN_CLOSE
        e = buf.find(tag, k)
        if e >= 0:
            return Scan(MALFORMED, e + len(tag), partial=partial, message=msg)
        if not final:
            return Scan(NEED_MORE, partial=partial)
        return Scan(MALFORMED, len(buf), partial=partial, message=msg)

    def scan(self, buf: str, final: bool) -> Scan:
        wrapped = buf.startswith(self.OPEN)
        k = len(self.OPEN) if wrapped else 0
        n = len(buf)
        if wrapped:
            k = skip_ws(buf, k)
            if k == n:
                return unfinished(None, n, "the output ended right after <tool_call>") if final \
                    else Scan(NEED_MORE)
            if buf[k] in "{[":  # a JSON body (Qwen2.5/Hermes style) is read too
                return self._scan_json_body(buf, k, final)
            if not buf.startswith(self.BARE, k):
                if self.BARE.startswith(buf[k:]):
                    return unfinished(None, n, "the output ended inside the call") if final else Scan(NEED_MORE)
                return self._skip_to_close(buf, k, True, final, "expected <function=NAME> after <tool_call>", None)
        head = self._function_tag(buf, k + len(self.BARE), wrapped, final)
        return head if isinstance(head, Scan) else self._scan_body(buf, head[1], head[0], wrapped, final)

    def _function_tag(self, buf: str, k: int, wrapped: bool, final: bool) -> tuple[RawCall, int] | Scan:
        """NAME> of <function=NAME> from k: the call and where its body starts."""
        n = len(buf)
        gt = buf.find(">", k)
        if gt < 0:
            if "\n" in buf[k:] or "<" in buf[k:]:
                return self._skip_to_close(buf, k, wrapped, final, "unterminated <function=...> tag", None)
            return unfinished(None, n, "the output ended inside <function=...>") if final else Scan(NEED_MORE)
        name = buf[k:gt].strip()
        if not name or "\n" in name or "<" in name:
            return self._skip_to_close(buf, gt, wrapped, final, "bad function name in <function=...>", None)
        return RawCall(name=name), gt + 1

    def _scan_body(self, buf: str, k: int, call: RawCall, wrapped: bool, final: bool) -> Scan:
        """The parameters from k, up to </function> (and </tool_call>)."""
        n = len(buf)
        while True:
            k = skip_ws(buf, k)
            if k == n:
                return unfinished(call, n, "the output ended inside the call") if final \
                    else Scan(NEED_MORE, partial=call)
            if buf.startswith(self.P_OPEN, k):
                got = self._parameter(buf, k, call, wrapped, final)
                if isinstance(got, Scan):
                    return got
                k = got
                continue
            if buf.startswith(self.FN_CLOSE, k):
                k += len(self.FN_CLOSE)
                k2 = skip_ws(buf, k)
                if buf.startswith(self.CLOSE, k2):
                    return Scan(DONE, k2 + len(self.CLOSE), calls=[call])
                if k2 == n or self.CLOSE.startswith(buf[k2:]):
                    if not final:
                        return Scan(NEED_MORE, partial=call)
                    return Scan(DONE, n, calls=[call])  # a partial "</tool_c" at the very end is swallowed
                return Scan(DONE, k, calls=[call])  # no </tool_call>: lenient
            if wrapped and buf.startswith(self.CLOSE, k):  # </function> missing: lenient
                return Scan(DONE, k + len(self.CLOSE), calls=[call])
            if is_prefix_of_any(buf[k:], (self.P_OPEN, self.FN_CLOSE, self.CLOSE)):
                return unfinished(call, n, "the output ended inside the call") if final \
                    else Scan(NEED_MORE, partial=call)
            return self._skip_to_close(buf, k, wrapped, final, "unexpected text inside the call", call)

    def _parameter(self, buf: str, k: int, call: RawCall, wrapped: bool, final: bool) -> int | Scan:
        """<parameter=KEY> VALUE </parameter> at k: appended to the call; where the next part starts."""
        n = len(buf)
        gt = buf.find(">", k + len(self.P_OPEN))
        if gt < 0:
            if "\n" in buf[k:]:
                return self._skip_to_close(buf, k, wrapped, final, "unterminated <parameter=...> tag", call)
            return unfinished(call, n, "the output ended inside a <parameter=...> tag") if final \
                else Scan(NEED_MORE, partial=call)
        key = buf[k + len(self.P_OPEN):gt].strip()
        vs = gt + 1
        ends = [(e, tag) for tag in self.VALUE_ENDS if (e := buf.find(tag, vs)) >= 0]
        if not ends:
            if final:
                return unfinished(call, n, f"the output ended inside the value of {key!r}", key)
            call.open_value = (key, sure_prefix(buf[vs:], self.VALUE_ENDS, strip_newlines=True))
            return Scan(NEED_MORE, partial=call)
        e, tag = min(ends)
        call.params.append((key, strip_one_newline(buf[vs:e])))
        return e + len(self.P_CLOSE) if tag == self.P_CLOSE else e

    def _scan_json_body(self, buf: str, k: int, final: bool) -> Scan:
        got = self.json_calls_at(buf, k, final)
        if isinstance(got, Scan):
            return got
        end, calls, problem = got
        if calls is None:
            return self._skip_to_close(buf, end, True, final, problem, None)
        n = len(buf)
        k2 = skip_ws(buf, end)
        if buf.startswith(self.CLOSE, k2):
            return Scan(DONE, k2 + len(self.CLOSE), calls=calls)
        if not final and (k2 == n or self.CLOSE.startswith(buf[k2:])):
            return Scan(NEED_MORE)
        return Scan(DONE, n if k2 == n or self.CLOSE.startswith(buf[k2:]) else end, calls=calls)


class QwenXmlDialect(Dialect):
    name = "qwen_xml"
    priority = 0
    call_openers = ("<tool_call>",)
    closers = ("</tool_call>", "\n</tool_call>", "</function>\n</tool_call>")
    Scanner = QwenXmlScanner

    call_instructions = (
        "To call a function, write this block, and nothing after it:\n\n"
        "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n"
        "</function>\n</tool_call>\n\n"
        "Rules for calls:\n"
        "- One <parameter=...> block per argument. Put the value on its own lines between the "
        "tags: plain text for strings (no quotes, no escaping, several lines are fine), JSON for "
        "numbers, booleans, null, arrays and objects.\n"
        "- Always give every required parameter, and only parameters the function defines.\n"
        "- To call several functions, write one <tool_call> block per call, one after another.\n"
        "- You may explain what you are about to do before the first call, never after the last.\n"
        "- If no function fits the request, answer the user directly without any <tool_call>."
    )

    def serves(self, served_name: str, arch: str, template_adds_bos: bool) -> bool:
        return True

    def render_call(self, name: str, args: Mapping) -> str:
        parts = [f"<tool_call>\n<function={name}>\n"]
        for k, v in args.items():
            parts.append(f"<parameter={k}>\n{value_text(v)}\n</parameter>\n")
        parts.append("</function>\n</tool_call>")
        return "".join(parts)

    def call_rules(self, tag: Tag, specs: list[ToolSpec], typed: bool | str) -> CallRules:
        open_tag, close_tag = tag("<tool_call>"), tag("</tool_call>")
        rules = ["sval[lazy]: /(?s:.*)<\\/parameter>/ & ~/(?s:.*)(<parameter=|<\\/function>|<\\/tool_call>)(?s:.*)/"]

        def bounded(n):  # at most n characters, then the newline before the close tag
            return f"sval_{n}", (f"sval_{n}[lazy]: /(?s:.{{0,{n}}})\\n<\\/parameter>/ & "
                                 "~/(?s:.*)(<parameter=|<\\/function>|<\\/tool_call>)(?s:.*)/")

        def param(spec, key, sch):
            kind, data = value_kind(spec, sch) if typed else ("text", None)
            head = lit(f"<parameter={key}>\n")
            if kind == "enum":
                return f"{head} ({' | '.join(lit(v) for v in data)}) {lit(chr(10) + '</parameter>' + chr(10))}"
            if kind == "json":
                return f"{head} {json_value(rules, data, typed)} {lit(chr(10) + '</parameter>' + chr(10))}"
            return f"{head} {string_value(rules, sch, bounded)} \"\\n\""

        function_rules(rules, specs, "fn", lambda spec: lit(f"<function={spec.name}>\n"), param)
        fn_end = lit("</function>\n")
        rules.append(f"call: {open_tag} \"\\n\" fn ({fn_end} {close_tag}?)?")
        return CallRules(rules, opener=open_tag, after_open="\"\\n\" fn", call="call",
                         between=f"{fn_end} {close_tag}", tail=f"({fn_end} ({close_tag} {GAP}?)?)?")


DIALECT = QwenXmlDialect()
