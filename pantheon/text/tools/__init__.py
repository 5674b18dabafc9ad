"""Tool calling: dialects (prompt rendering, scanning, call grammars), the streaming call parser,
argument typing, and llguidance grammars.

    from pantheon.text.tools import dialect_for, ToolCallParser, GrammarFactory

spec.py (what a request offers), dialect.py + dialects/ (one module per dialect), scanning.py
(the scanners' toolkit), arguments.py (typing + jsonschema validation), parse.py (the streaming
parser), rules.py + grammar.py (constrained decoding for tool_choice and response_format)."""

from pantheon.text.tools.arguments import coerce_text, coerce_value, schema_problem
from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.dialects import DIALECTS, apply_dialect, dialect_for, get_dialect
from pantheon.text.tools.dialects.json_calls import JsonDialect
from pantheon.text.tools.dialects.minicpm_xml import MiniCpmXmlDialect
from pantheon.text.tools.dialects.qwen_xml import QwenXmlDialect
from pantheon.text.tools.parse import (ContentDelta, ParseEvents, ToolCall, ToolCallArgs, ToolCallError,
                                       ToolCallParser, ToolCallStart, parse_complete)
from pantheon.text.tools.spec import ToolSpec, ToolSpecError, normalize_tools

QWEN_XML, MINICPM_XML, JSON_CALLS = DIALECTS["qwen_xml"], DIALECTS["minicpm_xml"], DIALECTS["json"]

_GRAMMAR_NAMES = ("Grammar", "GrammarError", "GrammarFactory", "GrammarMatcher", "apply_bitmask_numpy",
                  "tool_grammar_policy")


def __getattr__(name):  # grammar.py imports llguidance and numpy: only when asked for
    if name in _GRAMMAR_NAMES:
        from pantheon.text.tools import grammar
        return getattr(grammar, name)
    raise AttributeError(name)


__all__ = ["DIALECTS", "JSON_CALLS", "MINICPM_XML", "QWEN_XML", "ContentDelta", "Dialect", "JsonDialect",
           "MiniCpmXmlDialect", "ParseEvents", "QwenXmlDialect", "ToolCall", "ToolCallArgs", "ToolCallError",
           "ToolCallParser", "ToolCallStart", "ToolSpec", "ToolSpecError", "apply_dialect", "coerce_text",
           "coerce_value", "dialect_for", "get_dialect", "normalize_tools", "parse_complete", "schema_problem",
           *_GRAMMAR_NAMES]
