"""Tool calling: dialects (prompt rendering), the streaming call parser, and llguidance grammars.

    from pantheon.text.tools import dialect_for, ToolCallParser, GrammarFactory

See dialects.py (syntax per model family), parse.py (events, errors, argument typing) and
grammar.py (constrained decoding for tool_choice and response_format)."""

from pantheon.text.tools.dialects import (DIALECTS, JSON_CALLS, MINICPM_XML, QWEN_XML, Dialect, JsonDialect,
                                          MiniCpmXmlDialect, QwenXmlDialect, ToolSpec, ToolSpecError,
                                          apply_dialect, dialect_for, get_dialect, normalize_tools)
from pantheon.text.tools.parse import (ContentDelta, ParseEvents, ToolCall, ToolCallArgs, ToolCallError,
                                       ToolCallParser, ToolCallStart, coerce_text, coerce_value, parse_complete)

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
           "coerce_value", "dialect_for", "get_dialect", "normalize_tools", "parse_complete", *_GRAMMAR_NAMES]
