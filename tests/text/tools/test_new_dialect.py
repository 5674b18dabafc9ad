"""A dialect is one module: a fourth one, written here and nowhere else, renders, streams, parses,
validates and constrains through the same driver as the built-in three; and dialects/ is
discovered, not listed."""

from __future__ import annotations

import json
import pkgutil
from collections.abc import Mapping

import jsonschema
import pytest

from pantheon.text.tools import (DIALECTS, ContentDelta, ParseEvents, ToolCallArgs, ToolCallParser, ToolCallStart,
                                 parse_complete)
from pantheon.text.tools import dialects as dialects_pkg
from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.rules import GAP, CallRules, args_schema, function_rules, json_value, lit
from pantheon.text.tools.scanning import (DONE, MALFORMED, NEED_MORE, RawCall, Scan, Scanner, partial_suffix,
                                          unfinished)
from pantheon.text.tools.spec import dumps
from tests.text.tools.helpers import TOOLS, RandomDriver, tool_schema


class BracketScanner(Scanner):
    """[[call NAME]] KEY=JSON ... [[end]], one argument per line."""
    OPEN, END = "[[call ", "[[end]]"
    TRIGGER_CHARS = "]\n"

    @classmethod
    def find_start(cls, buf, line_start):
        i = buf.find(cls.OPEN)
        return (i, 0) if i >= 0 else (None, len(buf) - partial_suffix(buf, (cls.OPEN,)))

    def scan(self, buf, final):
        n = len(buf)
        head_end = buf.find("]]", len(self.OPEN))
        if head_end < 0:
            return unfinished(None, n, "the output ended inside the call head") if final else Scan(NEED_MORE)
        call = RawCall(name=buf[len(self.OPEN):head_end].strip(), is_json=True)
        lines, k = [], head_end + 2
        while True:
            nl = buf.find("\n", k + 1)
            line = buf[k:nl if nl >= 0 else n].strip()
            if line == self.END:
                call.json_args = dict(lines)
                return Scan(DONE, k + buf[k:].index(self.END) + len(self.END), calls=[call])
            if nl < 0:
                call.params = list(lines)
                if final:
                    return unfinished(call, n, "the output ended inside the call")
                return Scan(NEED_MORE, partial=call)
            if line:
                key, eq, value = line.partition("=")
                try:
                    lines.append((key.strip(), json.loads(value)))
                except json.JSONDecodeError:
                    return Scan(MALFORMED, n, message=f"bad value for {key!r}")
            k = nl


class BracketDialect(Dialect):
    name = "bracket"
    call_openers = ("[[call ",)
    closers = ("\n[[end]]",)
    call_instructions = "To call a function write [[call NAME]], then KEY=JSON lines, then [[end]]."
    Scanner = BracketScanner

    def serves(self, served_name, arch, template_adds_bos):
        return served_name == "bracket-model"

    def render_call(self, name: str, args: Mapping) -> str:
        return f"[[call {name}]]" + "".join(f"\n{k}={dumps(v)}" for k, v in args.items()) + "\n[[end]]"

    def call_rules(self, tag, specs, typed):
        rules = []

        def param(spec, key, sch):
            value = json_value(rules, args_schema(spec, sch), typed) if typed else "%json{}"
            return f"{lit(chr(10) + key + '=')} {value}"

        function_rules(rules, specs, "fn", lambda spec: lit(f"{spec.name}]]"), param)
        rules.append(f"call: {lit('[[call ')} fn ({lit(chr(10) + '[[end]]')})?")
        return CallRules(rules, opener=lit("[[call "), after_open="fn", call="call",
                         between=lit("\n[[end]]"), tail=f"({lit(chr(10) + '[[end]]')} {GAP}?)?")


BRACKET = BracketDialect()
TEXT = 'Let me check.\n[[call get_weather]]\nlocation="Oslo"\ndays=2\n[[end]]'


def test_every_module_of_dialects_is_registered_by_its_dialect_name():
    modules = {m.name for m in pkgutil.iter_modules(dialects_pkg.__path__)}
    assert len(modules) == len(DIALECTS) == 3
    for d in DIALECTS.values():
        assert type(d).__module__.rsplit(".", 1)[1] in modules
        assert d.closers and d.call_instructions and issubclass(d.Scanner, Scanner)


def test_a_new_dialect_renders_history_and_parses_back():
    msgs = BRACKET.apply([{"role": "user", "content": "weather?"},
                          {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"location": "Oslo"}}}]},
                          {"role": "tool", "content": "sunny"}], TOOLS)
    assert msgs[0]["role"] == "system" and BRACKET.call_instructions in msgs[0]["content"]
    assert msgs[2]["content"] == '[[call get_weather]]\nlocation="Oslo"\n[[end]]'
    content, calls, errors = parse_complete(TEXT, BRACKET, TOOLS)
    assert errors == [] and content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"location": "Oslo", "days": 2})]


def test_a_new_dialect_streams_arguments_and_validates_them():
    p = ToolCallParser(BRACKET, TOOLS, incremental=True)
    stream = ParseEvents()  # merges adjacent content
    for ch in TEXT:
        stream.extend(p.push(ch))
    stream.extend(p.finish()[0])
    events = stream.events
    kinds = [type(e) for e in events]
    assert kinds[0] is ContentDelta and kinds[1] is ToolCallStart
    frags = [e.fragment for e in events if isinstance(e, ToolCallArgs)]
    assert frags == ['{"location": "Oslo"', ', "days": 2', "}"]
    bad = TEXT.replace("days=2", 'days="soon"')
    _, calls, errors = parse_complete(bad, BRACKET, TOOLS)
    assert calls == [] and [(e.code, e.parameter) for e in errors] == [("invalid_argument", "days")]


@pytest.mark.parametrize("seed", range(2))
def test_a_new_dialect_gets_a_tool_grammar(smollm2_factory, seed):
    g = smollm2_factory.tool_grammar(BRACKET, TOOLS, "required", think="none")
    m = smollm2_factory.matcher(g)
    text, _, _ = RandomDriver(smollm2_factory).run(m, seed)
    tail = m.closing_text()
    assert tail is not None, text
    content, calls, errors = parse_complete(text + tail, BRACKET, TOOLS)
    assert errors == [] and len(calls) == 1 and content is None, text
    jsonschema.validate(calls[0].arguments, tool_schema(calls[0].name))
