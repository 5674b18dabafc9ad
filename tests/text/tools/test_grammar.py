"""llguidance grammars on real vocabularies: random-logit decoding always yields valid output."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from pantheon.text.tools import parse_complete
from pantheon.text.tools.grammar import GrammarError, tool_grammar_policy
from tests.text.tools.helpers import TOOLS, RandomDriver, tool_schema

DIALECTS = ["qwen_xml", "minicpm_xml", "json"]


@pytest.fixture(scope="module")
def driver(smollm2_factory):
    return RandomDriver(smollm2_factory)


def _check_one_call(text, tail, dialect, **kw):
    assert tail is not None, f"cannot close: {text[-120:]!r}"
    content, calls, errors = parse_complete(text + tail, dialect, TOOLS, **kw)
    assert errors == [], (text, errors)
    assert len(calls) == 1, text
    jsonschema.validate(calls[0].arguments, tool_schema(calls[0].name))
    return content, calls[0]


def _allowed(factory, m):
    row = factory.allocate_bitmask(1)[0]
    m.fill_bitmask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[: factory.vocab_size].astype(bool)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("seed", range(4))
def test_required_random_decoding_gives_one_valid_call(smollm2_factory, driver, dialect, seed):
    g = smollm2_factory.tool_grammar(dialect, TOOLS, "required", think="none")
    m = smollm2_factory.matcher(g)
    text, steps, _ = driver.run(m, seed, delay=8 * seed)
    content, call = _check_one_call(text, m.closing_text(), dialect)
    assert content is None


@pytest.mark.parametrize("dialect", DIALECTS)
def test_required_after_think_block(smollm2_factory, driver, dialect):
    f = smollm2_factory
    think = "<think>\nThe user wants the weather. Draft: <tool_call>\n<function=nope> {\"name\": \"x\"}\n</think>\n\n"
    for mode in ("optional", "open"):
        g = f.tool_grammar(dialect, TOOLS, "required", think=mode)
        m = f.matcher(g)
        prefix = think if mode == "optional" else think[len("<think>"):]
        for t in f.tokenizer.encode(prefix, add_bos=False):
            assert m.consume(t)
        text, _, _ = driver.run(m, 11, delay=5)
        content, _ = _check_one_call(text, m.closing_text(), dialect, start_in_reasoning=mode == "open")
        assert content.startswith("<think>" if mode == "optional" else "\nThe user")


def test_required_refuses_end_and_text_before_the_call(smollm2_factory):
    f = smollm2_factory
    for dialect in DIALECTS:
        m = f.matcher(f.tool_grammar(dialect, TOOLS, "required", think="optional"))
        allowed = _allowed(f, m)
        assert not any(allowed[t] for t in f.eos_ids)
        assert not m.is_accepting() and m.closing_text() is None
        assert not m.consume(f.tokenizer.encode("Sure", add_bos=False)[0])


@pytest.mark.parametrize("dialect,prefix,closable,tail", [
    ("qwen_xml", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n", True,
     "</function>\n</tool_call>"),
    ("qwen_xml", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>", False,
     "\n</tool_call>"),
    ("qwen_xml", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
     True, ""),
    ("qwen_xml", "<tool_call>\n<function=search>\n<parameter=query>\nx", False, None),
    ("qwen_xml", "<tool_call>\n<function=get_weather>\n<parameter=location>\nx\n</parameter>\n", False, None),
    ("minicpm_xml", '<function name="search"><param name="query">x</param>', True, "</function>"),
    ("minicpm_xml", '<function name="get_weather"><param name="location">x</param>', False, None),
    ("json", '{"name": "search", "arguments": {"query": "x"}', True, "}"),
    ("json", '{"name": "search", "arguments": {"query": "x"', False, None),
])
def test_end_inside_a_call(smollm2_factory, dialect, prefix, closable, tail):
    """An end token is allowed exactly where appending a fixed text completes the call."""
    f = smollm2_factory
    m = f.matcher(f.tool_grammar(dialect, TOOLS, "required", think="none"))
    for t in f.tokenizer.encode(prefix, add_bos=False):
        assert m.consume(t)
    assert any(_allowed(f, m)[t] for t in f.eos_ids) == closable
    assert m.closing_text() == tail
    if tail is not None:
        _check_one_call(prefix, tail, dialect)
        assert m.closing_tokens() == f.tokenizer.encode(tail, add_bos=False)


def test_named_function(smollm2_factory, driver):
    f = smollm2_factory
    for dialect in DIALECTS:
        g = f.tool_grammar(dialect, TOOLS, "named", function="get_weather")
        m = f.matcher(g)
        text, _, _ = driver.run(m, 3, delay=4)
        _, call = _check_one_call(text, m.closing_text(), dialect)
        assert call.name == "get_weather"
    with pytest.raises(ValueError):
        f.tool_grammar("qwen_xml", TOOLS, "named", function="nope")


@pytest.mark.parametrize("dialect,opener,bad", [
    ("qwen_xml", "I will look it up.\n<tool_call>", "\n<function=nope>"),
    ("minicpm_xml", 'I will look it up.\n<function name="', 'nope">'),
    ("json", 'I will look it up.\n{"name": "', 'nope", '),
])
def test_auto_free_text_then_constrained_call(smollm2_factory, driver, dialect, opener, bad):
    f = smollm2_factory
    g = f.tool_grammar(dialect, TOOLS, "auto", think="optional")
    m = f.matcher(g)
    allowed = _allowed(f, m)
    assert all(allowed[t] for t in f.eos_ids) and allowed.sum() > 0.9 * f.vocab_size
    assert m.closing_text() == ""
    for t in f.tokenizer.encode("Plain answer, no tools needed. ", add_bos=False):
        assert m.consume(t)
    assert m.is_accepting() and m.closing_text() == ""
    m = f.matcher(g)
    for t in f.tokenizer.encode(opener, add_bos=False):
        assert m.consume(t)
    assert not m.is_accepting()
    probe = f.matcher(g)  # an unknown function name is refused once the call has opened
    assert all(probe.consume(t) for t in f.tokenizer.encode(opener, add_bos=False))
    assert not all(probe.consume(t) for t in f.tokenizer.encode(bad, add_bos=False))
    text, _, _ = driver.run(m, 5, delay=3, eos_when=lambda x: bool(parse_complete(x, dialect, TOOLS)[1]))
    content, call = _check_one_call(text, m.closing_text(), dialect)
    assert content == "I will look it up."


def test_special_token_vocab(qwen35_factory):
    """Qwen3.5 vocab: <think>, </think>, <tool_call>, </tool_call> are single special tokens."""
    f = qwen35_factory
    g = f.tool_grammar("qwen_xml", TOOLS, "required", think="optional")
    assert "<[380]>" in g.lark and "<[382]>" in g.lark and '"<tool_call>"' not in g.lark
    enc = f.tokenizer.encode
    m = f.matcher(g)
    # the reasoning may mention the special tags; the call must use the special tokens
    for t in enc("<think>\nplan: <tool_call>maybe</tool_call>\n</think>\n\n", add_bos=False):
        assert m.consume(t)
    assert not m.copy().consume(enc("<", add_bos=False)[0])  # "<tool_call>" as text is refused
    text, _, _ = RandomDriver(f).run(m, 2, delay=10, max_steps=3000)
    assert text.count("<tool_call>") == 2
    _check_one_call(text, m.closing_text(), "qwen_xml")


def test_json_object_random_decoding(smollm2_factory, driver):
    f = smollm2_factory
    g = f.json_object_grammar()
    assert g.downgraded == ()
    for seed in range(3):
        m = f.matcher(g)
        text, _, _ = driver.run(m, seed, delay=6 * seed)
        assert m.closing_text() == ""
        assert isinstance(json.loads(text), dict)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}


def test_json_schema_random_decoding(smollm2_factory, driver):
    f = smollm2_factory
    g = f.json_schema_grammar(PERSON)
    assert g.downgraded == ()
    for seed in range(3):
        m = f.matcher(g)
        text, _, _ = driver.run(m, seed, delay=4 * seed)
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_think_prefix(smollm2_factory, driver):
    f = smollm2_factory
    m = f.matcher(f.json_schema_grammar(PERSON, think="optional"))
    for t in f.tokenizer.encode("<think>\nfill the form {not json}\n</think>\n", add_bos=False):
        assert m.consume(t)
    text, _, _ = driver.run(m, 7)
    jsonschema.validate(json.loads(text.split("</think>", 1)[1]), PERSON)


YES_NO = r'''root ::= answer " " number
answer ::= "yes" | "no"
number ::= [0-9] [0-9]? # a start-like word in a comment, and "start" in a string: ("start")?
'''


def test_gbnf_random_decoding(smollm2_factory, driver):
    """llama-server's `grammar`: GBNF through llguidance's converter, decoded at random."""
    f = smollm2_factory
    g = f.gbnf_grammar(YES_NO)
    assert g.kind == "gbnf"
    for seed in range(3):
        m = f.matcher(g)
        text, _, _ = driver.run(m, seed)
        assert re.fullmatch(r"(yes|no) [0-9]{1,2}", text), text
        assert m.closing_text() == ""


def test_gbnf_think_prefix_and_refusals(smollm2_factory, driver):
    f = smollm2_factory
    m = f.matcher(f.gbnf_grammar('root ::= "start" | "go"', think="optional"))
    for t in f.tokenizer.encode("<think>\nsay start\n</think>\n", add_bos=False):
        assert m.consume(t)
    text, _, _ = driver.run(m, 3)
    assert text.split("</think>", 1)[1].strip() in ("start", "go")
    for bad in ("root ::= (", "root ::= missing", "", "x ::= \"a\""):
        with pytest.raises(ValueError):
            f.gbnf_grammar(bad)


def test_rename_rule_leaves_literals_alone():
    from pantheon.text.tools.rules import rename_rule

    lark = '%llguidance {"start": 1}\nstart: "start" /start\\/x/ start_b | start\nstart_b: "a\\"start"\n'
    assert rename_rule(lark, "start", "r") == \
        '%llguidance {"start": 1}\nr: "start" /start\\/x/ start_b | r\nstart_b: "a\\"start"\n'


def test_json_schema_downgrades(smollm2_factory):
    f = smollm2_factory
    g = f.json_schema_grammar({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert any("uniqueItems" in d for d in g.downgraded)
    f.matcher(g)
    g = f.json_schema_grammar({"$ref": "https://example.com/schema.json"})
    assert g.downgraded and g.downgraded[0].startswith("schema not enforced")
    m = f.matcher(g)
    for t in f.tokenizer.encode('{"a": 1}', add_bos=False):
        assert m.consume(t)
    assert m.is_accepting()


def test_untypable_parameter_schema_falls_back(smollm2_factory, driver):
    f = smollm2_factory
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "x": {"type": "object", "properties": {"y": {"$ref": "https://example.com/y.json"}}},
            "z": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "required": ["x"]}}}]
    g = f.tool_grammar("qwen_xml", tools, "required", think="none")
    assert "not enforced" in g.downgraded[0]
    m = f.matcher(g)
    text, _, _ = driver.run(m, 1, delay=3)
    _, calls, errors = parse_complete(text + m.closing_text(), "qwen_xml", tools)
    # a well-formed call; its untyped value may not convert (that is what "downgraded" says)
    assert len(calls) + len(errors) == 1 and all(e.code == "invalid_argument" for e in errors)
    g = f.tool_grammar("qwen_xml", tools[:1] and [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"z": tools[0]["function"]["parameters"]["properties"]["z"]}}}}],
        "required")
    assert any("uniqueItems" in d for d in g.downgraded)


def test_matcher_cache_and_api_checks(smollm2_factory):
    f = smollm2_factory
    g = f.tool_grammar("qwen_xml", TOOLS, "required")
    f.matcher(g)
    m = f.matcher(g)
    assert f.last_compile_s == 0.0  # second matcher for the same grammar: copied, not compiled
    with pytest.raises(ValueError):
        m.fill_bitmask(np.zeros(f.mask_words, dtype=np.int64))
    with pytest.raises(GrammarError):
        f.matcher("start: (((")
    # a token the mask forbids: the matcher refuses it and from then on allows only end tokens
    assert not m.consume(f.tokenizer.encode("x", add_bos=False)[0])
    assert m.is_error()
    allowed = _allowed(f, m)
    assert sorted(np.nonzero(allowed)[0]) == f.eos_ids
    assert m.closing_text() is None


@pytest.mark.parametrize("choice,env,expected", [
    ("required", None, ("required", None)),
    ("required", "0", None),
    ("auto", None, None),
    ("auto", "1", ("auto", None)),
    ({"type": "function", "function": {"name": "f"}}, None, None),
    ({"type": "function", "function": {"name": "f"}}, "1", ("named", "f")),
    ("none", "1", None),
])
def test_tool_grammar_policy(choice, env, expected):
    assert tool_grammar_policy(choice, True, "" if env is None else env) == expected
    assert tool_grammar_policy(choice, False, "1") is None


@pytest.mark.parametrize("dialect", DIALECTS)
def test_auto_think_block_may_draft_an_opener(smollm2_factory, dialect):
    f = smollm2_factory
    g = f.tool_grammar(dialect, TOOLS, "auto", think="optional")
    think = ("<think>I could use <tool_call>\n<function=search> or <function name=\"search\"> or\n"
             "{\"name\": \"search\"} here.</think>\n\n")
    m = f.matcher(g)
    toks = f.tokenizer.encode(think + "No tool needed: it is 4.", add_bos=False)
    assert m.try_consume(toks) == len(toks) and m.closing_text() == ""
    m = f.matcher(g)
    from pantheon.text.tools import get_dialect
    call = get_dialect(dialect).render_assistant_tool_calls([{"function": {"name": "search", "arguments": {"query": "4"}}}])
    toks = f.tokenizer.encode(think + call, add_bos=False)
    assert m.try_consume(toks) == len(toks) and m.closing_text() == ""


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rendered_calls_are_grammar_valid(smollm2_factory, dialect):
    """What the dialect renders into history is exactly what its grammar generates."""
    from pantheon.text.tools import get_dialect
    tools = TOOLS + [{"type": "function", "function": {"name": 'météo "x"', "parameters": {
        "type": "object", "properties": {"ville/€": {"type": "string"}, "n": {"enum": [1, 2, 3]},
                                         "o": {"type": "string", "enum": ['a"b', "<x>"]}},
        "required": ["ville/€", "n", "o"]}}}]
    calls = [
        ("write_file", {"path": "a.py", "content": "if a < b:\n    pass\n", "overwrite": False, "mode": None}),
        ("search", {"query": "q", "limit": 3, "score": 0.5, "tags": ["a", "b"], "filters": {"lang": "en"}}),
        ('météo "x"', {"ville/€": "Zürich", "n": 2, "o": "<x>"}),
    ]
    f = smollm2_factory
    d = get_dialect(dialect)
    for name, args in calls:
        for mode in ("required", "auto"):
            text = d.render_assistant_tool_calls([{"function": {"name": name, "arguments": args}}])
            m = f.matcher(f.tool_grammar(dialect, tools, mode, think="none"))
            toks = f.tokenizer.encode(text, add_bos=False)
            assert m.try_consume(toks) == len(toks), (mode, text)
            assert m.is_accepting() and m.closing_text() == ""
            _, got, errors = parse_complete(text, dialect, tools)
            assert errors == [] and [(c.name, c.arguments) for c in got] == [(name, args)]


def test_timing_smoke(smollm2_factory, driver):
    """Compile and per-step mask cost on the 49k SmolLM2 vocabulary (bounds ~50x above measured,
    so a loaded shared CPU does not fail it; the numbers are printed with -s)."""
    import time

    f = smollm2_factory
    tools = TOOLS + [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a"]}}} for i in range(8)]
    f.lltokenizer  # built once per model, not per grammar
    t0 = time.perf_counter()
    g = f.tool_grammar("qwen_xml", tools, "required")
    compile_s = time.perf_counter() - t0
    times = []
    for seed in range(3):
        _, _, ts = driver.run(f.matcher(g), seed, delay=5 * seed)
        times += ts
    mean_ms = 1e3 * sum(times) / len(times)
    print(f"\n11 tools, qwen_xml required: build+compile {compile_s * 1e3:.1f} ms, "
          f"mask mean {mean_ms:.3f} ms over {len(times)} steps")
    assert compile_s < 1.0 and mean_ms < 5.0


# -- bounded numbers (issue 12 §2) -------------------------------------------------------------------
def _accepts(f, m, text) -> bool:
    """The matcher accepts text as a prefix, fed one character's tokens at a time (so a refusal at
    any byte shows, whatever the tokenizer would merge)."""
    toks = [t for ch in text for t in f.tokenizer.encode(ch, add_bos=False)]
    return m.validate_tokens(toks) == len(toks)


NUM_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"},
    "s": {"type": "string", "maxLength": 5}, "k": {"enum": ["aa", "bb"]},
    "l": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}}, "required": ["n"]}}}]


def _tool_prefix(dialect, key, value):
    """The call up to and including `value` as parameter `key` (after n=1 unless key is n)."""
    first = key == "n"
    if dialect == "json":
        return '{"name": "f", "arguments": {' + ("" if first else '"n": 1, ') + f'"{key}": {value}'
    if dialect == "qwen_xml":
        return "<tool_call>\n<function=f>\n" + ("" if first else "<parameter=n>\n1\n</parameter>\n") + \
            f"<parameter={key}>\n{value}"
    return '<function name="f">' + ("" if first else '<param name="n">1</param>') + f'<param name="{key}">{value}'


@pytest.mark.parametrize("dialect", DIALECTS)
def test_tool_numbers_are_bounded(smollm2_factory, dialect):
    f = smollm2_factory
    g = f.tool_grammar(dialect, NUM_TOOLS, "required", think="none")
    assert g.downgraded == ()
    ok = lambda key, v: _accepts(f, f.matcher(g), _tool_prefix(dialect, key, v))  # noqa: E731
    for key in ("n", "x"):
        assert ok(key, "9" * 20) and ok(key, "-" + "1" * 20)
        assert not ok(key, "9" * 21) and not ok(key, "-" + "1" * 21)
        assert not ok(key, "01")
    assert ok("x", "1." + "5" * 20 + "e-123") and not ok("x", "1." + "5" * 21)
    assert not ok("x", "1e1234")
    assert not ok("n", "1.5")
    assert ok("l", "[" + "1" * 20 + ", 2]") and not ok("l", "[1, 2, ") and not ok("l", "[" + "1" * 21)
    # a string's maxLength and an enum still hold
    q = '"' if dialect == "json" else ""
    assert ok("k", q + "aa") and not ok("k", q + "ab")
    assert ok("s", q + "abcde") and not ok("s", q + "abcdef")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_tool_bounded_numbers_random_decoding(smollm2_factory, driver, dialect):
    f = smollm2_factory
    g = f.tool_grammar(dialect, NUM_TOOLS, "required", think="none")
    for seed in range(2):
        m = f.matcher(g)
        text, _, _ = driver.run(m, seed, delay=3)
        _, calls, errors = parse_complete(text + m.closing_text(), dialect, NUM_TOOLS)
        assert errors == [] and len(calls) == 1, text
        jsonschema.validate(calls[0].arguments, NUM_TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("schema", [{"type": "integer"}, {"type": "number"},
                                    {"type": "array", "items": {"type": "number"}}])
def test_json_schema_numbers_are_bounded(smollm2_factory, schema):
    f = smollm2_factory
    g = f.json_schema_grammar(schema)
    assert g.downgraded == ()
    wrap = (lambda v: "[" + v) if schema["type"] == "array" else (lambda v: v)  # noqa: E731
    assert _accepts(f, f.matcher(g), wrap("9" * 20))
    assert not _accepts(f, f.matcher(g), wrap("9" * 21))
    assert not _accepts(f, f.matcher(g), wrap("-" + "9" * 21))


def test_one_sided_integer_range_is_bounded(smollm2_factory):
    """A range with one side open still stops at 20 digits."""
    f = smollm2_factory
    g = f.json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}},
                               "required": ["n"], "additionalProperties": False})
    assert g.downgraded == ()
    assert _accepts(f, f.matcher(g), '{"n": ' + "9" * 20 + "}")
    assert not _accepts(f, f.matcher(g), '{"n": ' + "9" * 21)
    assert not _accepts(f, f.matcher(g), '{"n": -1')


@pytest.mark.parametrize("dialect", DIALECTS)
def test_number_ranges_are_exact_and_bounded(smollm2_factory, dialect):
    """Whole-valued ranges on numbers: the range holds exactly (fractions included), and fraction
    digits stop at 20 (llguidance's own ranged numbers take fraction digits forever)."""
    f = smollm2_factory
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "number", "minimum": 0, "maximum": 100},
        "x": {"type": "number", "exclusiveMinimum": -2, "exclusiveMaximum": 3}}, "required": ["n"]}}}]
    g = f.tool_grammar(dialect, tools, "required", think="none")
    assert g.downgraded == ()
    end = {"json": "}", "qwen_xml": "\n</parameter>", "minicpm_xml": "</param>"}[dialect]
    ok = lambda key, v: _accepts(f, f.matcher(g), _tool_prefix(dialect, key, v) + end)  # noqa: E731
    for v in ("0", "100", "100.0", "99.5", "0.25", "1." + "5" * 20):
        assert ok("n", v), v
    for v in ("101", "100.5", "-1", "-0.5", "1." + "5" * 21, "1e2"):
        assert not ok("n", v), v
    for v in ("-1.5", "2.99", "-1", "0", "2"):
        assert ok("x", v), v
    for v in ("-2", "3", "3.0", "-2.5"):
        assert not ok("x", v), v


def test_ranged_number_in_response_format(smollm2_factory):
    f = smollm2_factory
    g = f.json_schema_grammar({"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                               "required": ["p"], "additionalProperties": False})
    assert g.downgraded == ()
    ok = lambda text: _accepts(f, f.matcher(g), '{"p": ' + text)  # noqa: E731
    assert ok("0.75}") and ok("1}") and ok("0." + "3" * 20 + "}")
    assert not ok("1.5") and not ok("0." + "3" * 21) and not ok("2")


def test_json_schema_limits_are_enforced(smollm2_factory):
    f = smollm2_factory
    g = f.json_schema_grammar(PERSON)
    ok = lambda text: _accepts(f, f.matcher(g), text)  # noqa: E731
    assert ok('{"name": "' + "a" * 40 + '"') and not ok('{"name": "' + "a" * 41)
    head = '{"name": "a", "age": '
    assert ok(head + "150") and not ok(head + "151") and not ok(head + "-1")
    assert ok(head + '1, "role": "guest"') and not ok(head + '1, "role": "root"')
    tags = head + '1, "role": "user", "tags": ['
    assert ok(tags + '"a", "b", "c"]') and not ok(tags + '"a", "b", "c", ')
    assert not ok(tags + '"' + "x" * 21)


def test_pydantic_integer_field_stops_at_20_digits(smollm2_factory):
    """client.beta.chat.completions.parse() with a pydantic model looped `"population": 1111...`."""
    f = smollm2_factory
    schema = {"title": "City", "type": "object", "additionalProperties": False, "required": ["name", "population"],
              "properties": {"name": {"title": "Name", "type": "string"},
                             "population": {"title": "Population", "type": "integer"}}}
    for g in (f.json_schema_grammar(schema), f.json_object_grammar()):
        m = f.matcher(g)
        for t in f.tokenizer.encode('{"name": "Paris", "population": ', add_bos=False):
            assert m.consume(t)
        for _ in range(20):
            assert m.consume(f.tokenizer.encode("1", add_bos=False)[0])
        allowed = _allowed(f, m)
        digits = [t for t in range(f.vocab_size) if allowed[t] and f.token_bytes(t)[:1].isdigit()]
        assert digits == [], [f.token_bytes(t) for t in digits[:5]]
        assert m.consume(f.tokenizer.encode("}", add_bos=False)[0])
        assert m.is_accepting()
