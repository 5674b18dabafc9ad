"""MiniCPM5's attribute XML calls (llama-arch models whose chat template adds BOS). No wrapper
tag; several calls simply follow each other::

    <function name="NAME"><param name="KEY">VALUE</param></function>

A VALUE that contains "<", "&" or a line break is wrapped in `<![CDATA[...]]>`. Values are kept
exactly (no newline stripping): a file content that ends in "\n" keeps it.

Source: the chat template shipped with openbmb's MiniCPM5 checkpoints (`chat_template` in
tokenizer_config.json). We read it as quoted by several independent ports, which agree on it
word for word: the template renders calls with
`'<function name="' ~ tool_call.name ~ '">'`, `'<param name="' ~ param_name ~ '">' ... '</param>'`,
`'</function>'`; its tool instructions spell out the syntax above and the CDATA rule; tool
definitions are JSON lines inside `<tools></tools>` in the system turn (a `<tool_def_sep>`
marker in the system message says where they go); tool results go back in a user turn as
`<tool_response>\\n...\\n</tool_response>`. The instruction text below is ours.

Grammar limits: plain values cannot contain "<" or "&" (CDATA can); the grammar does not model a
think block before the call (see engine/chat.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from pantheon.text.tools.dialect import Dialect, value_text
from pantheon.text.tools.rules import GAP, CallRules, Tag, function_rules, json_value, lit, string_value, value_kind
from pantheon.text.tools.scanning import (DONE, MALFORMED, NEED_MORE, RawCall, Scan, Scanner, is_prefix_of_any,
                                          partial_suffix, skip_ws, sure_prefix, unfinished, xml_unescape)
from pantheon.text.tools.spec import ToolSpec


def cdata_if_needed(text: str) -> str:
    if any(c in text for c in "<&\n"):
        # "]]>" cannot appear inside one CDATA section: split it across two
        return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"
    return text


def xml_attr(text: str) -> str:
    """Text escaped for a double-quoted XML attribute (names are normally plain identifiers)."""
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


class MiniCpmXmlScanner(Scanner):
    OPEN = '<function name="'
    FN_CLOSE = "</function>"
    P_OPENS = ('<param name="', '<parameter name="')
    CDATA, CDATA_END = "<![CDATA[", "]]>"
    TRIGGER_CHARS = ">"

    @classmethod
    def find_start(cls, buf: str, line_start: bool) -> tuple[int | None, int]:
        i = buf.find(cls.OPEN)
        if i >= 0:
            return i, 0
        return None, len(buf) - partial_suffix(buf, (cls.OPEN,))

    def _malformed(self, buf, k, final, msg, call) -> Scan:
        e = buf.find(self.FN_CLOSE, k)
        if e >= 0:
            return Scan(MALFORMED, e + len(self.FN_CLOSE), partial=call, message=msg)
        if not final:
            return Scan(NEED_MORE, partial=call)
        return Scan(MALFORMED, len(buf), partial=call, message=msg)

    def _end(self, call, n, final, what, key=None) -> Scan:
        return unfinished(call, n, what, key) if final else Scan(NEED_MORE, partial=call)

    def scan(self, buf: str, final: bool) -> Scan:
        n = len(buf)
        k = len(self.OPEN)
        q = buf.find('"', k)
        if q < 0:
            if any(c in buf[k:] for c in "<>\n"):
                return self._malformed(buf, k, final, "unterminated function name", None)
            return self._end(None, n, final, "the output ended inside <function name=...>")
        call = RawCall(name=xml_unescape(buf[k:q]))
        k = skip_ws(buf, q + 1)
        if k == n:
            return self._end(None, n, final, "the output ended inside <function ...>")
        if buf[k] != ">":
            return self._malformed(buf, k, final, "expected '>' after the function name", None)
        k += 1
        while True:
            k = skip_ws(buf, k)
            if k == n:
                return self._end(call, n, final, "the output ended inside the call")
            opener = next((p for p in self.P_OPENS if buf.startswith(p, k)), None)
            if opener is not None:
                got = self._parameter(buf, k, opener, call, final)
                if isinstance(got, Scan):
                    return got
                k = got
                continue
            if buf.startswith(self.FN_CLOSE, k):
                return Scan(DONE, k + len(self.FN_CLOSE), calls=[call])
            if is_prefix_of_any(buf[k:], self.P_OPENS + (self.FN_CLOSE,)):
                return self._end(call, n, final, "the output ended inside the call")
            return self._malformed(buf, k, final, "unexpected text inside the call", call)

    def _parameter(self, buf: str, k: int, opener: str, call: RawCall, final: bool) -> int | Scan:
        """<param name="KEY">VALUE</param> (or <parameter ...>) at k: appended to the call; where the
        next part starts."""
        n = len(buf)
        close = "</param>" if opener == self.P_OPENS[0] else "</parameter>"
        q = buf.find('"', k + len(opener))
        if q < 0:
            return self._end(call, n, final, "the output ended inside a <param> tag")
        key = xml_unescape(buf[k + len(opener):q])
        gt = skip_ws(buf, q + 1)
        if gt == n:
            return self._end(call, n, final, "the output ended inside a <param> tag", key)
        if buf[gt] != ">":
            return self._malformed(buf, gt, final, "expected '>' after the parameter name", call)
        vs = gt + 1
        if buf.startswith(self.CDATA, vs) or (not final and n - vs < len(self.CDATA)
                                              and self.CDATA.startswith(buf[vs:])):
            return self._cdata_value(buf, vs, key, close, call, final)
        ends = [e for e in (buf.find(close, vs), buf.find(self.FN_CLOSE, vs)) if e >= 0]
        if not ends:
            sure = sure_prefix(buf[vs:], (close, self.FN_CLOSE), strip_newlines=False)
            if "&" in sure[sure.rfind(";") + 1:]:  # an entity not complete yet
                sure = sure[: sure.rfind("&")]
            call.open_value = (key, xml_unescape(sure))
            return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
        e = min(ends)
        call.params.append((key, xml_unescape(buf[vs:e])))
        return e + len(close) if buf.startswith(close, e) else e

    def _cdata_value(self, buf: str, vs: int, key: str, close: str, call: RawCall, final: bool) -> int | Scan:
        """A value in CDATA sections from vs, then its close tag."""
        n = len(buf)
        if n - vs < len(self.CDATA):
            return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
        value, j = "", vs
        while buf.startswith(self.CDATA, j):  # "]]>" in a value is split across sections
            ce = buf.find(self.CDATA_END, j + len(self.CDATA))
            if ce < 0:
                rest = sure_prefix(buf[j + len(self.CDATA):], (self.CDATA_END,), strip_newlines=False)
                call.open_value = (key, value + rest)
                return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
            value += buf[j + len(self.CDATA):ce]
            j = ce + len(self.CDATA_END)
        j2 = skip_ws(buf, j)
        if buf.startswith(close, j2):
            call.params.append((key, value))
            return j2 + len(close)
        if j2 == n or close.startswith(buf[j2:]) or self.CDATA.startswith(buf[j2:]):
            return self._end(call, n, final, f"the output ended inside the value of {key!r}", key)
        return self._malformed(buf, j2, final, f"expected {close} after the CDATA value of {key!r}", call)


class MiniCpmXmlDialect(Dialect):
    name = "minicpm_xml"
    priority = 10
    call_openers = ('<function name="',)
    call_separator = ""
    closers = ("</function>",)
    Scanner = MiniCpmXmlScanner

    call_instructions = (
        "How to call functions:\n"
        "- Write the call as <function name=\"FUNCTION_NAME\"><param name=\"PARAMETER_NAME\">"
        "value</param></function>, with one <param> per argument. Several calls simply follow "
        "each other.\n"
        "- Strings are written as plain text; numbers, booleans, null, arrays and objects as "
        "JSON.\n"
        "- If a value contains <, & or a line break, wrap it in a CDATA block: "
        "<param name=\"PARAMETER_NAME\"><![CDATA[...value...]]></param>\n"
        "- Always give every required parameter.\n"
        "- If no function is needed, answer normally and do not write any <function> tag."
    )

    def serves(self, served_name: str, arch: str, template_adds_bos: bool) -> bool:
        return (arch or "").lower() == "llama" and template_adds_bos

    def render_call(self, name: str, args: Mapping) -> str:
        parts = [f'<function name="{xml_attr(name)}">']
        for k, v in args.items():
            parts.append(f'<param name="{xml_attr(k)}">{cdata_if_needed(value_text(v))}</param>')
        parts.append("</function>")
        return "".join(parts)

    def call_rules(self, tag: Tag, specs: list[ToolSpec], typed: bool | str) -> CallRules:
        rules = ['cdata: "<![CDATA[" cdata_rest', "cdata_rest[lazy]: /(?s:.*)\\]\\]>/",
                 "PLAIN: /[^<&]*/", "sval: cdata | PLAIN"]

        def bounded(n):  # at most n plain characters (no CDATA)
            return f"PLAIN_{n}", f"PLAIN_{n}: /[^<&]{{0,{n}}}/"

        def param(spec, key, sch):
            kind, data = value_kind(spec, sch) if typed else ("text", None)
            head = lit(f'<param name="{xml_attr(key)}">')
            close = lit("</param>")
            if kind == "enum":
                vals = [v if not any(c in v for c in "<&\n") else f"<![CDATA[{v}]]>" for v in data]
                return f"{head} ({' | '.join(lit(v) for v in vals)}) {close}"
            if kind == "json":
                return f"{head} {json_value(rules, data, typed)} {close}"
            return f"{head} {string_value(rules, sch, bounded)} {close}"

        function_rules(rules, specs, "fnr", lambda spec: lit(xml_attr(spec.name) + '">'), param)
        open_lit = lit('<function name="')
        rules.append(f"call: {open_lit} fnr {lit('</function>')}?")
        return CallRules(rules, opener=open_lit, after_open="fnr", call="call", between=lit("</function>"),
                         tail=f"({lit('</function>')} {GAP}?)?")


DIALECT = MiniCpmXmlDialect()
