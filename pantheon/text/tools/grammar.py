"""Grammar-constrained decoding for tool calls and response_format, on llguidance.

    factory = GrammarFactory(tokenizer)            # one per model; builds/caches the LLTokenizer
    g = factory.tool_grammar(dialect, tools, "required", think="optional")
    m = factory.matcher(g)                         # one per decoding slot (compile is cached)
    per step:   m.fill_bitmask(row)                # row: int32[ceil(V/32)], bit j of word i = token 32i+j
                ...mask the logits, sample...
                m.consume(token)                   # False: the token broke the grammar (sampler bug)
    at the end: tail = m.closing_text()            # "" done / text to append / None: cannot close

Grammars (Lark, llguidance dialect):

* tool choice `required`: an optional unconstrained think block (`<think>...</think>`, as text or as
  the vocabulary's special tokens), then exactly one call to one of the offered tools, in the
  dialect's syntax, its arguments typed by their JSON schemas (`%json` for non-string values; raw
  text for strings, enums as literal alternatives) with every `required` parameter present, then
  the end. Parameters come in the schema's `properties` order; optional ones may be skipped.
* `named`: the same for a single function.
* `auto` (PANTHEON_TOOL_GRAMMAR=1): free text; once the dialect's call opener appears (a lazy
  trigger: `<tool_call>`, `<function name="` or `{"name": "`) the call is constrained, more calls
  may follow (whitespace between them), and nothing but whitespace after the last one.
* `response_format`: `json_object` (any JSON object) and `json_schema` (the schema enforced; the
  keywords llguidance does not implement are ignored and listed in `Grammar.downgraded`, so the
  caller can report `schema_downgraded`).

Numbers are bounded everywhere (llguidance's JSON numbers are not: a model could write digits until
max_tokens): schemas with numbers are translated to Lark down to the number leaves (`_BoundedJson`),
integers `-?(0|[1-9][0-9]{0,19})`, numbers with at most 20 fraction digits and a 3-digit exponent;
integer ranges stay llguidance's (i64: a one-sided range gets +-(10**18-1) as its other side);
strings, enums, booleans and nodes with keywords the translation does not know stay `%json`
(maxLength, enum, pattern... enforced there). Objects translated this way take only their listed
properties, in order; json_object and `{}` values get a generic JSON grammar with bounded numbers.
A translation llguidance rejects falls back to plain `%json` ("numbers not bounded" in downgraded).

End of generation: the model's end tokens (the vocabulary's EOG set) are allowed only where the
grammar accepts. Inside a call that is wherever the call can be completed by appending a fixed
text: after a complete parameter once all required ones are present, after `</function>` (Qwen),
after the arguments object (JSON). `closing_text()` returns that text (e.g.
"</function>\\n</tool_call>"); the server appends it to the output. It is also how to finish a
call cut off by max_tokens at such a point; cut off anywhere else (inside a value), it returns
None and the parser reports the call as unfinished.

Limits: string values in Qwen XML cannot contain "</parameter>", "<parameter=", "</function>" or
"</tool_call>"; MiniCPM plain values cannot contain "<" or "&" (CDATA can); argument order is
fixed by the schema.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import numpy as np

from pantheon.text.tools.dialects import Dialect, ToolSpec, get_dialect, normalize_tools, xml_attr
from pantheon.text.tools.parse import ToolCallParser, schema_types

_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4

# JSON values inside calls: compact, json.dumps-like separators, no free whitespace (a model trained
# on json.dumps output writes exactly this, and random sampling cannot pad with whitespace forever)
_X_GUIDANCE_ARGS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                    "lenient": True}
# response_format: whitespace allowed (models pretty-print) but bounded per gap
_X_GUIDANCE_RF = {"whitespace_pattern": r"[ \t\n\r]{0,16}", "lenient": True}

_WS = r"/[ \t\r\n]{1,8}/"


def _max_length(sch) -> int | None:
    """A string schema's maxLength: the grammar bounds the value, so a model that never closes a
    string on its own is still moved on to the next parameter."""
    n = sch.get("maxLength") if isinstance(sch, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


class GrammarError(ValueError):
    """A grammar llguidance rejected."""


def tool_grammar_policy(tool_choice: Any, has_tools: bool, env: str | None = None) -> tuple[str, str | None] | None:
    """Which tool grammar PANTHEON_TOOL_GRAMMAR arms for a request: None, ("required", None),
    ("auto", None) or ("named", function_name).

    unset: only tool_choice "required"; "1": every request with tools; "0": none."""
    if env is None:
        env = os.environ.get("PANTHEON_TOOL_GRAMMAR", "")
    env = env.strip()
    if not has_tools or tool_choice == "none" or env == "0":
        return None
    if tool_choice == "required":
        return "required", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else {}
        name = fn.get("name") or tool_choice.get("name")
        if env == "1":
            return ("named", name) if isinstance(name, str) and name else ("auto", None)
        return None
    return ("auto", None) if env == "1" else None


def _lit(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


_RX_META = set("\\.^$|?*+()[]{}/-#&~")


def _rx(s: str) -> str:
    """Escape text for use inside a Lark /regex/."""
    out = []
    for c in s:
        if c in _RX_META:
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        else:
            out.append(c)
    return "".join(out)


# -- bounded numbers -----------------------------------------------------------------------------
# llguidance's JSON schema numbers are unbounded (`[1-9][0-9]*`): a model that keeps writing digits
# is never stopped. Schemas with numbers are therefore compiled to Lark here down to the number
# leaves, which get bounded regexes; every other leaf (strings, enums, booleans...) and any node
# using keywords this translation does not know stays `%json` (llguidance enforces maxLength,
# enum, pattern, ... there).
INT_DIGITS, FRAC_DIGITS, EXP_DIGITS = 20, 20, 3
_RX_INT = f"-?(0|[1-9][0-9]{{0,{INT_DIGITS - 1}}})"
_RX_NUM = f"{_RX_INT}(\\.[0-9]{{1,{FRAC_DIGITS}}})?([eE][+-]?[0-9]{{1,{EXP_DIGITS}}})?"
_INT_CAP = 10 ** 18 - 1   # llguidance's integer ranges are i64: a one-sided bound gets this other side
_NOTE_KEYS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
              "writeOnly", "$schema", "$id", "x-guidance", "$defs", "definitions", "format"}


class _BoundedJson:
    """A JSON schema as Lark rules with bounded integer/number lexemes (see above).

    sep: (item, key) separators, or None for response_format (whitespace around punctuation,
    at most `ws` per gap). Rules are appended to `rules`; expr(schema) gives the expression."""

    def __init__(self, root: dict, rules: list[str], xg: dict, prefix: str, compact: bool):
        self.root, self.rules, self.xg, self.p, self.compact = root, rules, xg, prefix, compact
        self.n = 0
        self.refs: dict[str, str] = {}
        self.delegated: dict[str, str] = {}
        if compact:
            self.item, self.key = _lit(xg.get("item_separator", ", ")), _lit(xg.get("key_separator", ": "))
            self.ws = ""
        else:
            self.ws = f"{prefix.upper()}WS?"
            rules.append(f"{prefix.upper()}WS: /[ \\t\\n\\r]{{1,16}}/")
            self.item, self.key = f'{self.ws} "," {self.ws}', f'{self.ws} ":" {self.ws}'
        rules.append(f"{prefix.upper()}INT: /{_RX_INT}/")
        rules.append(f"{prefix.upper()}NUM: /{_RX_NUM}/")

    def _name(self) -> str:
        self.n += 1
        return f"{self.p}r{self.n}"

    def _resolve(self, ref: str) -> Any:
        for k in ("#/$defs/", "#/definitions/"):
            if ref.startswith(k):
                d = self.root.get(k[2:-1])
                if isinstance(d, dict) and ref[len(k):] in d:
                    return d[ref[len(k):]]
        return None

    def _has_numbers(self, sch: Any, seen: set | None = None) -> bool:
        seen = set() if seen is None else seen
        if isinstance(sch, dict):
            ref = sch.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                seen.add(ref)
                if self._has_numbers(self._resolve(ref), seen):
                    return True
            t = sch.get("type")
            if t in ("integer", "number") or (isinstance(t, list) and ("integer" in t or "number" in t)):
                return True
            return any(self._has_numbers(v, seen) for k, v in sch.items()
                       if k not in ("enum", "const", "$defs", "definitions"))
        if isinstance(sch, list):
            return any(self._has_numbers(v, seen) for v in sch)
        return False

    def delegate(self, sch: Any) -> str:
        s = copy.deepcopy(sch) if isinstance(sch, dict) else ({} if sch is True else {"not": {}})
        for k in ("$defs", "definitions"):
            if k in self.root and k not in s:
                s[k] = copy.deepcopy(self.root[k])
        s["x-guidance"] = dict(self.xg)
        text = f"%json{json.dumps(s, ensure_ascii=False)}"
        if text not in self.delegated:   # one rule per distinct schema
            name = self._name()
            self.rules.append(f"{name}: {text}")
            self.delegated[text] = name
        return self.delegated[text]

    def _any(self, kind: str = "val") -> str:
        """Any JSON value (kind "val"), object ("obj") or array ("arr"), numbers bounded."""
        p = self.p
        if f"{p}any_val" not in self.refs:
            self.refs[f"{p}any_val"] = "ok"
            s = self.delegate({"type": "string"})
            self.rules += [
                f'{p}any_val: {p}any_obj | {p}any_arr | {s} | {p.upper()}NUM | "true" | "false" | "null"',
                f'{p}any_obj: "{{" {self.ws} ({s} {self.key} {p}any_val ({self.item} {s} {self.key} {p}any_val)*)? '
                f'{self.ws} "}}"',
                f'{p}any_arr: "[" {self.ws} ({p}any_val ({self.item} {p}any_val)*)? {self.ws} "]"']
        return f"{p}any_{kind}"

    def expr(self, sch: Any) -> str:
        keys = set(sch) - _NOTE_KEYS if isinstance(sch, dict) else set()
        if sch is True or isinstance(sch, dict) and not keys:
            return self._any()
        if isinstance(sch, dict) and sch.get("type") in ("object", "array") and \
                (keys == {"type"} or keys == {"type", "additionalProperties"} and sch["additionalProperties"] is True):
            return self._any(sch["type"][:3])
        if not isinstance(sch, dict) or not self._has_numbers(sch):
            return self.delegate(sch)
        if "$ref" in sch:
            ref = sch["$ref"]
            target = self._resolve(ref) if isinstance(ref, str) else None
            if keys != {"$ref"} or target is None:
                return self.delegate(sch)
            if ref not in self.refs:
                self.refs[ref] = name = self._name()
                self.rules.append(f"{name}: {self.expr(target)}")
            return self.refs[ref]
        for k in ("anyOf", "oneOf"):
            if k in sch:
                if keys != {k} or not isinstance(sch[k], list) or not sch[k]:
                    return self.delegate(sch)
                return "(" + " | ".join(self.expr(s) for s in sch[k]) + ")"
        t = sch.get("type")
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                return self.delegate(sch)
            return "(" + " | ".join(self.expr({**sch, "type": x}) for x in t) + ")"
        if t == "integer":
            return self._integer(sch, keys)
        if t == "number":
            if keys != {"type"}:   # ranges, multipleOf: llguidance's (fraction digits unbounded)
                return self.delegate(sch)
            return f"{self.p.upper()}NUM"
        if t == "array" and keys <= {"type", "items", "minItems", "maxItems"} and isinstance(sch.get("items"), dict):
            return self._array(sch)
        if t == "object" and keys <= {"type", "properties", "required", "additionalProperties"} \
                and isinstance(sch.get("properties"), dict) and sch["properties"] \
                and sch.get("additionalProperties", False) in (False, True):
            return self._object(sch)
        return self.delegate(sch)

    def _integer(self, sch: dict, keys: set) -> str:
        if keys == {"type"}:
            return f"{self.p.upper()}INT"
        if not keys <= {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
            return self.delegate(sch)
        lo, hi = -_INT_CAP, _INT_CAP
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        if num(sch.get("minimum")):
            lo = max(lo, math.ceil(sch["minimum"]))
        if num(sch.get("exclusiveMinimum")):
            lo = max(lo, math.floor(sch["exclusiveMinimum"]) + 1)
        if num(sch.get("maximum")):
            hi = min(hi, math.floor(sch["maximum"]))
        if num(sch.get("exclusiveMaximum")):
            hi = min(hi, math.ceil(sch["exclusiveMaximum"]) - 1)
        return self.delegate({"type": "integer", "minimum": lo, "maximum": hi})

    def _array(self, sch: dict) -> str:
        item = self.expr(sch["items"])
        lo = sch.get("minItems", 0)
        hi = sch.get("maxItems")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0 else 0
        hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo else None
        if hi == 0:
            body = ""
        else:
            rest_lo = max(lo - 1, 0)
            rest = f"({self.item} {item})" + (f"{{{rest_lo},{hi - 1}}}" if hi is not None else
                                                 (f"{{{rest_lo},}}" if rest_lo else "*"))
            body = f"{item} {rest}"
            if lo == 0:
                body = f"({body})?"
        name = self._name()
        self.rules.append(f'{name}: "[" {self.ws} {body} {self.ws} "]"')
        return name

    def _object(self, sch: dict) -> str:
        props = sch["properties"]
        req = set(sch.get("required") or [])
        names = list(props)
        if not req <= set(names):
            return self.delegate(sch)
        members = [f"{_lit(json.dumps(k, ensure_ascii=False))} {self.key} {self.expr(props[k])}" for k in names]
        # tail i: the members from i on, each after a separator (optional ones may be left out)
        tails = [""] * (len(names) + 1)
        for i in range(len(names) - 1, -1, -1):
            tname = self._name()
            opt = "" if names[i] in req else "?"
            self.rules.append(f"{tname}: ({self.item} {members[i]}){opt} {tails[i + 1]}")
            tails[i] = tname
        alts = []
        for f in range(len(names)):   # the first member given
            alts.append(f"{members[f]} {tails[f + 1]}".strip())
            if names[f] in req:
                break
        body = "(" + " | ".join(alts) + ")"
        if not req:
            body += "?"
        name = self._name()
        self.rules.append(f'{name}: "{{" {self.ws} {body} {self.ws} "}}"')
        return name


@dataclass
class Grammar:
    """A compiled-on-demand grammar: its Lark text plus what closing_text() needs."""
    lark: str
    kind: str                       # "tool" | "json"
    dialect: Dialect | None = None
    tools: list = field(default_factory=list)
    mode: str = ""                  # tool grammars: required | named | auto
    think: str = "none"             # none | optional | open
    closers: tuple = ()
    downgraded: tuple = ()          # schema features not enforced (json_schema), or fallbacks used


class GrammarMatcher:
    """Per-slot grammar state. Not thread-safe; one per decoding sequence."""

    def __init__(self, factory: GrammarFactory, grammar: Grammar, ll: llg.LLMatcher):
        self.factory = factory
        self.grammar = grammar
        self._ll = ll
        self._pieces: list[bytes] = []

    # -- per step -------------------------------------------------------------------------------
    def fill_bitmask(self, out_row: np.ndarray) -> None:
        """Write the allowed-token bitmask into out_row (int32, C-contiguous, >= ceil(V/32) words;
        extra words are left alone: mask logits beyond V yourself). In an error state (a token
        the mask did not allow was consumed) only the end tokens are allowed."""
        words = self.factory.mask_words
        if out_row.dtype != np.int32 or out_row.ndim != 1 or not out_row.flags["C_CONTIGUOUS"] \
                or out_row.size < words:
            raise ValueError(f"out_row must be a contiguous int32 vector of >= {words} words")
        if self._ll.is_error():
            out_row[:words] = 0
            for t in self.factory.eos_ids:
                bit = 1 << (t & 31)
                out_row[t >> 5] |= np.int32(bit - (1 << 32) if bit >= 1 << 31 else bit)
            return
        self._ll.unsafe_compute_mask_ptr(out_row.ctypes.data, words * 4)

    def consume(self, token: int) -> bool:
        ok = self._ll.consume_token(int(token))
        if ok:
            self._pieces.append(b"" if token in self.factory.eos_set else self.factory.token_bytes(token))
        return ok

    def copy(self) -> GrammarMatcher:
        """An independent copy of the current state (to probe tokens without committing)."""
        c = GrammarMatcher(self.factory, self.grammar, self._ll.deep_copy())
        c._pieces = list(self._pieces)
        return c

    def try_consume(self, tokens: list[int]) -> int:
        """Consume the longest grammar-valid prefix of tokens (draft tokens); returns its length.
        Unlike consume(), a refused token does not put the matcher in an error state."""
        toks = [int(t) for t in tokens]
        n = self._ll.try_consume_tokens(toks)
        for t in toks[:n]:
            self._pieces.append(b"" if t in self.factory.eos_set else self.factory.token_bytes(t))
        return n

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of tokens (a prefix) the grammar accepts from here, without advancing."""
        return self._ll.validate_tokens([int(t) for t in tokens])

    def rollback(self, n: int) -> bool:
        """Undo the last n consumed tokens (speculative decoding)."""
        ok = self._ll.rollback(n)
        if ok and n:
            del self._pieces[-n:]
        return ok

    def is_accepting(self) -> bool:
        """An end token is allowed now."""
        return self._ll.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but an end token can follow (the grammar is complete)."""
        return self._ll.is_stopped()

    def is_error(self) -> bool:
        return self._ll.is_error()

    def error(self) -> str:
        return self._ll.get_error()

    def text(self) -> str:
        return b"".join(self._pieces).decode("utf-8", "replace")

    # -- end of generation ----------------------------------------------------------------------
    def closing_text(self) -> str | None:
        """What to append when generation ends now: "" when the output is complete (or, in auto
        mode, outside a call), the text that closes the open call, or None when the call cannot
        be closed (cut off inside a value / name, or the matcher is in error)."""
        if self._ll.is_error():
            return None
        g = self.grammar
        if g.kind != "tool":
            return "" if self._ll.is_accepting() else None
        text = self.text()
        if self._ll.is_accepting() and not self._open_call(text):
            return ""
        for cand in g.closers:
            toks = self.factory.tokenizer.encode(cand, parse_special=True, add_bos=False, add_eos=False)
            m2 = self._ll.deep_copy()
            if m2.try_consume_tokens(toks) != len(toks) or not m2.is_accepting():
                continue
            if not self._open_call(text + cand):
                return cand
        return None

    def closing_tokens(self) -> list[int] | None:
        tail = self.closing_text()
        if tail is None:
            return None
        return self.factory.tokenizer.encode(tail, parse_special=True, add_bos=False, add_eos=False) if tail else []

    def _open_call(self, text: str) -> bool:
        g = self.grammar
        p = ToolCallParser(g.dialect, g.tools, start_in_reasoning=g.think == "open")
        _, _, errors = p.parse_complete(text)
        return any(e.code == "unfinished_call" for e in errors)


class GrammarFactory:
    """Builds grammars for one vocabulary and hands out matchers.

    The LLTokenizer is built once (0.1-0.7 s) from our Tokenizer: raw bytes per token, with
    b"\\xff" in front of special tokens (CONTROL, and USER_DEFINED tokens spelled "<...>"), which
    llguidance then matches only through `<[id]>` references, never as text. The end tokens are
    the tokenizer's EOG set. Compiled grammars are cached (LRU) by their text; `matcher()` hands
    out a copy, so a repeated tool set costs no compile."""

    def __init__(self, tokenizer, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.mask_words = (self.vocab_size + 31) // 32
        self.eos_ids = sorted(int(t) for t in tokenizer.eog_ids)
        self.eos_set = frozenset(self.eos_ids)
        self._lltok: llg.LLTokenizer | None = None
        self._special: set[int] | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.last_compile_s = 0.0

    # -- tokenizer ------------------------------------------------------------------------------
    def token_bytes(self, t: int) -> bytes:
        return self.tokenizer.token_bytes(int(t))

    @property
    def special_ids(self) -> set[int]:
        if self._special is None:
            tk, spec = self.tokenizer, set()
            for i in range(self.vocab_size):
                a = tk.token_attr(i)
                if a & _ATTR_CONTROL:
                    spec.add(i)
                elif a & _ATTR_USER_DEFINED:
                    b = tk.token_bytes(i)
                    if b.startswith(b"<") and b.endswith(b">") and len(b) > 2:
                        spec.add(i)
            self._special = spec
        return self._special

    @property
    def lltokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_VocabView(self)), eos_token=self.eos_ids)
            return self._lltok

    def _tag(self, text: str) -> str:
        """A tag as grammar: its special token if the vocabulary has one, else the literal text."""
        tid = self.tokenizer.token_to_id(text)
        if tid is not None and tid in self.special_ids:
            return f"<[{tid}]>"
        return _lit(text)

    def _is_special(self, text: str) -> bool:
        tid = self.tokenizer.token_to_id(text)
        return tid is not None and tid in self.special_ids

    # -- matchers -------------------------------------------------------------------------------
    def _compiled(self, lark: str) -> llg.LLMatcher:
        """The pristine compiled matcher for a grammar text (cached; may be in error state)."""
        with self._lock:
            base = self._cache.get(lark)
            if base is not None:
                self._cache.move_to_end(lark)
                self.last_compile_s = 0.0
                return base
        t0 = time.perf_counter()
        base = llg.LLMatcher(self.lltokenizer, lark, log_level=0)
        self.last_compile_s = time.perf_counter() - t0
        with self._lock:
            self._cache[lark] = base
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return base

    def matcher(self, grammar: Grammar | str) -> GrammarMatcher:
        """A fresh matcher for one decoding sequence (a copy of the cached compiled grammar)."""
        g = grammar if isinstance(grammar, Grammar) else Grammar(lark=grammar, kind="json")
        base = self._compiled(g.lark)
        if base.is_error():
            raise GrammarError(f"grammar rejected: {base.get_error()}")
        return GrammarMatcher(self, g, base.deep_copy())

    def validate(self, lark: str) -> tuple[bool, list[str]]:
        """(is_error, [error] or warnings). Compiles (and caches) the grammar."""
        base = self._compiled(lark)
        if base.is_error():
            return True, [base.get_error().strip().splitlines()[0] if base.get_error().strip() else "error"]
        return False, list(base.get_grammar_warnings())

    def allocate_bitmask(self, batch: int = 1) -> np.ndarray:
        return np.full((batch, self.mask_words), -1, dtype=np.int32)

    # thin function-style API (same as the GrammarMatcher methods)
    def fill_bitmask(self, matcher: GrammarMatcher, out_row: np.ndarray) -> None:
        matcher.fill_bitmask(out_row)

    def consume(self, matcher: GrammarMatcher, token: int) -> bool:
        return matcher.consume(token)

    @staticmethod
    def is_accepting(matcher: GrammarMatcher) -> bool:
        return matcher.is_accepting()

    @staticmethod
    def is_stopped(matcher: GrammarMatcher) -> bool:
        return matcher.is_stopped()

    @staticmethod
    def closing_text(matcher: GrammarMatcher) -> str | None:
        return matcher.closing_text()

    # -- think prefix ---------------------------------------------------------------------------
    def _think_rules(self, think: str) -> tuple[str, list[str]]:
        """(prefix expression for `start`, rules)."""
        if think not in ("none", "optional", "open"):
            raise ValueError(f"think must be none, optional or open, not {think!r}")
        if think == "none":
            return "", []
        close = self._tag("</think>")
        if self._is_special("</think>"):
            # reasoning text may mention the tags the vocabulary has as special tokens (a drafted
            # <tool_call>...); other special tokens cannot be matched as text
            inner = [self._tag(t) for t in ("<think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                            "</tool_response>") if self._is_special(t)]
            if inner:
                rules = [f"think_rest: THINK_TEXT? (({' | '.join(inner)}) THINK_TEXT?)* {close}",
                         "THINK_TEXT: /(?s:.+)/"]
            else:
                rules = [f"think_rest: THINK_TEXT? {close}", "THINK_TEXT: /(?s:.+)/"]
        else:
            rules = [f"think_rest[lazy]: /(?s:.*){_rx('</think>')}/"]
        if think == "open":
            return f"think_rest {_WS}?", rules
        rules.append(f"think_blk: {self._tag('<think>')} think_rest")
        return f"(think_blk {_WS}?)?", rules

    # -- tool grammars --------------------------------------------------------------------------
    def tool_grammar(self, dialect: Dialect | str, tools, mode: str = "required", *,
                     function: str | None = None, think: str = "optional") -> Grammar:
        """mode: "required" (one call to any offered tool), "named" (one call to `function`),
        "auto" (free text, constrained from the call opener on). think: "optional" (the output may
        start with a think block), "open" (the prompt already opened one: the output starts inside
        it) or "none"."""
        d = get_dialect(dialect)
        specs = normalize_tools(tools)
        if mode == "named":
            specs = [s for s in specs if s.name == function]
            if not specs:
                raise ValueError(f"tool_choice names {function!r}, which is not among the offered tools")
        elif mode not in ("required", "auto"):
            raise ValueError(f"unknown tool grammar mode {mode!r}")
        if not specs:
            raise ValueError("a tool grammar needs at least one tool")
        downgraded: list[str] = []
        lark = self._tool_lark(d, specs, mode, think, typed=True, bounded=True)
        is_err, msgs = self.validate(lark)
        if is_err:
            # the bounded-number translation failed: llguidance's own (unbounded) numbers
            note = f"numbers not bounded: {msgs[0] if msgs else 'grammar error'}"
            lark = self._tool_lark(d, specs, mode, think, typed=True)
            is_err, msgs = self.validate(lark)
            if not is_err:
                downgraded.append(note)
        if is_err:
            # a parameter schema llguidance cannot compile: fall back to untyped values
            downgraded.append(f"argument schemas not enforced: {msgs[0] if msgs else 'grammar error'}")
            lark = self._tool_lark(d, specs, mode, think, typed=False)
            is_err, msgs = self.validate(lark)
            if is_err:
                raise GrammarError(msgs[0] if msgs else "tool grammar rejected")
        downgraded += [m for m in msgs if m]
        closers = {"qwen_xml": ("</tool_call>", "\n</tool_call>", "</function>\n</tool_call>"),
                   "minicpm_xml": ("</function>",), "json": ("}",)}[d.name]
        return Grammar(lark=lark, kind="tool", dialect=d, tools=specs, mode=mode, think=think,
                       closers=closers, downgraded=tuple(downgraded))

    def _tool_lark(self, d: Dialect, specs: list[ToolSpec], mode: str, think: str, typed: bool,
                   bounded: bool = False) -> str:
        prefix, rules = self._think_rules(think)
        build = {"qwen_xml": self._qwen_rules, "minicpm_xml": self._minicpm_rules, "json": self._json_rules}[d.name]
        fn_rules, open_expr, after_open, one_call, next_call, tail = build(
            specs, "bounded" if typed and bounded else typed)
        rules += fn_rules
        if mode == "auto":
            # llguidance's lexer commits to one lexeme: where a text think block may open, free
            # text must not also be able to start with "<think>", or it would swallow the block
            no_think = ""
            if think == "optional" and not self._is_special("<think>"):
                no_think = f" & ~/{_rx('<think>')}(?s:.*)/"
            if open_expr.startswith("<["):
                trig = f"TEXT {open_expr}"
            else:
                trig = "trig"
                # a JSON call counts only at the start of a line (as for the parser): text before it
                # ends with a newline, then blanks
                lead = "((?s:.*)\\n)?[ \\t]*" if d.name == "json" else "(?s:.*)"
                rules.append(f"trig[lazy]: /{lead}{_rx(json.loads(open_expr))}/{no_think}")
            rules.append(f"TEXT: /(?s:.*)/{no_think}")
            rules.append(f"body: TEXT | {trig} {after_open} ({next_call} {_WS}? {open_expr} {after_open})* {tail}")
            rules.append(f"start: {prefix} body")
        else:
            rules.append(f"start: {prefix} {one_call}")
        return "\n".join(rules) + "\n"

    def _args_schema(self, spec: ToolSpec, sub: Any) -> dict:
        """A parameter's schema made standalone for %json: root $defs copied in, our options set."""
        s = copy.deepcopy(sub) if isinstance(sub, dict) else {}
        root = spec.parameters if isinstance(spec.parameters, dict) else {}
        for k in ("$defs", "definitions"):
            if k in root and k not in s:
                s[k] = copy.deepcopy(root[k])
        s["x-guidance"] = dict(_X_GUIDANCE_ARGS)
        return s

    @staticmethod
    def _json_value(rules: list[str], sch: dict, typed) -> str:
        """A JSON value typed by sch (made standalone by _args_schema): `%json`, or with typed ==
        "bounded" (bounded numbers) an expression over rules appended to `rules`."""
        if typed != "bounded":
            return f"%json{json.dumps(sch, ensure_ascii=False)}"
        xg = sch.get("x-guidance") if isinstance(sch.get("x-guidance"), dict) else dict(_X_GUIDANCE_ARGS)
        return _BoundedJson(sch, rules, xg, f"v{len(rules)}_", compact=True).expr(sch)

    @staticmethod
    def _string_enum(sch: Any, root: dict) -> list[str] | None:
        if not isinstance(sch, dict):
            return None
        if "const" in sch and isinstance(sch["const"], str):
            return [sch["const"]]
        if isinstance(sch.get("enum"), list) and sch["enum"] and all(isinstance(v, str) for v in sch["enum"]):
            return list(sch["enum"])
        return None

    def _value_kind(self, spec: ToolSpec, sch: Any) -> tuple[str, Any]:
        """("enum", values) | ("text", None) | ("json", schema)."""
        root = spec.parameters if isinstance(spec.parameters, dict) else {}
        types = schema_types(sch, root)
        enum = self._string_enum(sch, root)
        if enum is not None:
            return "enum", enum
        if types is None or "string" in types:
            return "text", None
        return "json", self._args_schema(spec, sch)

    def _function_rules(self, rules: list[str], specs: list[ToolSpec], name: str, fn_head, param_rule) -> None:
        """Append to `rules`, per tool i, its parameter rules `p_{i}_{j}` and `{name}_{i}: fn_head(spec)
        params` (optional parameters marked `?`), then `{name}`, the choice among the tools.
        param_rule(spec, key, schema) -> a parameter's rule body; it may append rules of its own to
        `rules` first."""
        alts = []
        for i, spec in enumerate(specs):
            prules, parts = [], []
            req = set(spec.required)
            props = spec.properties
            # required parameters the schema does not list under properties still have to be given
            names = list(props) + [r for r in spec.required if r not in props]
            for j, key in enumerate(names):
                rname = f"p_{i}_{j}"
                prules.append(f"{rname}: {param_rule(spec, key, props.get(key))}")
                parts.append(rname if key in req else f"{rname}?")
            rules += prules
            rules.append(f"{name}_{i}: {fn_head(spec)} {' '.join(parts)}")
            alts.append(f"{name}_{i}")
        rules.append(f"{name}: {' | '.join(alts)}")

    @staticmethod
    def _string_value(rules: list[str], sch: Any, bounded) -> str:
        """The rule a string value matches: "sval", or under a maxLength n the rule named by
        bounded(n) -> (name, rule text), appended to `rules` the first time."""
        n = _max_length(sch)
        if n is None:
            return "sval"
        name, rule = bounded(n)
        if rule not in rules:
            rules.append(rule)
        return name

    def _qwen_rules(self, specs: list[ToolSpec], typed: bool):
        open_tag, close_tag = self._tag("<tool_call>"), self._tag("</tool_call>")
        rules = ["sval[lazy]: /(?s:.*)<\\/parameter>/ & ~/(?s:.*)(<parameter=|<\\/function>|<\\/tool_call>)(?s:.*)/"]

        def bounded(n):  # at most n characters, then the newline before the close tag
            return f"sval_{n}", (f"sval_{n}[lazy]: /(?s:.{{0,{n}}})\\n<\\/parameter>/ & "
                                 "~/(?s:.*)(<parameter=|<\\/function>|<\\/tool_call>)(?s:.*)/")

        def param(spec, key, sch):
            kind, data = self._value_kind(spec, sch) if typed else ("text", None)
            head = _lit(f"<parameter={key}>\n")
            if kind == "enum":
                return f"{head} ({' | '.join(_lit(v) for v in data)}) {_lit(chr(10) + '</parameter>' + chr(10))}"
            if kind == "json":
                return f"{head} {self._json_value(rules, data, typed)} {_lit(chr(10) + '</parameter>' + chr(10))}"
            return f"{head} {self._string_value(rules, sch, bounded)} \"\\n\""

        self._function_rules(rules, specs, "fn", lambda spec: _lit(f"<function={spec.name}>\n"), param)
        fn_end = _lit("</function>\n")
        rules.append(f"call: {open_tag} \"\\n\" fn ({fn_end} {close_tag}?)?")
        after_open = "\"\\n\" fn"
        next_call = f"{fn_end} {close_tag}"
        tail = f"({fn_end} ({close_tag} {_WS}?)?)?"
        return rules, open_tag, after_open, "call", next_call, tail

    def _minicpm_rules(self, specs: list[ToolSpec], typed: bool):
        rules = ['cdata: "<![CDATA[" cdata_rest', "cdata_rest[lazy]: /(?s:.*)\\]\\]>/",
                 "PLAIN: /[^<&]*/", "sval: cdata | PLAIN"]

        def bounded(n):  # at most n plain characters (no CDATA)
            return f"PLAIN_{n}", f"PLAIN_{n}: /[^<&]{{0,{n}}}/"

        def param(spec, key, sch):
            kind, data = self._value_kind(spec, sch) if typed else ("text", None)
            head = _lit(f'<param name="{xml_attr(key)}">')
            close = _lit("</param>")
            if kind == "enum":
                vals = [v if not any(c in v for c in "<&\n") else f"<![CDATA[{v}]]>" for v in data]
                return f"{head} ({' | '.join(_lit(v) for v in vals)}) {close}"
            if kind == "json":
                return f"{head} {self._json_value(rules, data, typed)} {close}"
            return f"{head} {self._string_value(rules, sch, bounded)} {close}"

        self._function_rules(rules, specs, "fnr", lambda spec: _lit(xml_attr(spec.name) + '">'), param)
        open_lit = _lit('<function name="')
        rules.append(f"call: {open_lit} fnr {_lit('</function>')}?")
        tail = f"({_lit('</function>')} {_WS}?)?"
        return rules, open_lit, "fnr", "call", _lit("</function>"), tail

    def _json_rules(self, specs: list[ToolSpec], typed: bool):
        rules, alts = [], []
        for i, spec in enumerate(specs):
            params = spec.parameters if isinstance(spec.parameters, dict) else {}
            sch = self._args_schema(spec, params) if typed else {"x-guidance": dict(_X_GUIDANCE_ARGS)}
            sch.setdefault("type", "object")
            name = json.dumps(spec.name, ensure_ascii=False)[1:-1]  # as it appears inside a JSON string
            rules.append(f"fnr_{i}: {_lit(name + chr(34) + ', ' + chr(34) + 'arguments' + chr(34) + ': ')} "
                         f"{self._json_value(rules, sch, typed)}")
            alts.append(f"fnr_{i}")
        rules.append(f"fnr: {' | '.join(alts)}")
        open_lit = _lit('{"name": "')
        rules.append(f"call: {open_lit} fnr \"}}\"?")
        return rules, open_lit, "fnr", "call", "\"}\"", f"(\"}}\" {_WS}?)?"

    # -- response_format ------------------------------------------------------------------------
    def json_object_grammar(self, think: str = "none") -> Grammar:
        return self._json_grammar({"type": "object"}, think, bounded=True)

    def json_schema_grammar(self, schema: dict, think: str = "none") -> Grammar:
        """The schema enforced as far as llguidance can: `downgraded` lists what it ignores
        (e.g. 'Unimplemented keys: ["uniqueItems"]'); a schema it cannot compile at all falls back
        to json_object with the reason in `downgraded`."""
        if not isinstance(schema, dict):
            raise ValueError("json_schema needs a schema object")
        g = self._json_grammar(schema, think, bounded=True)
        is_err, msgs = self.validate(g.lark)
        notes = []
        if is_err:  # the bounded-number translation failed: llguidance's own (unbounded) numbers
            note = f"numbers not bounded: {msgs[0] if msgs else 'error'}"
            g = self._json_grammar(schema, think)
            is_err, msgs = self.validate(g.lark)
            if not is_err:
                notes.append(note)
        if is_err:
            fb = self._json_grammar({"type": "object"}, think)
            fb.downgraded = (f"schema not enforced, any JSON object accepted: {msgs[0] if msgs else 'error'}",)
            return fb
        g.downgraded = tuple(notes + [m for m in msgs if m])
        return g

    def _json_grammar(self, schema: dict, think: str, bounded: bool = False) -> Grammar:
        prefix, rules = self._think_rules(think)
        s = copy.deepcopy(schema)
        xg = dict(_X_GUIDANCE_RF)
        if isinstance(s.get("x-guidance"), dict):
            xg.update(s["x-guidance"])
        s["x-guidance"] = xg
        if bounded:
            value = _BoundedJson(s, rules, xg, "j_", compact=False).expr(s)
        else:
            value = f"%json{json.dumps(s, ensure_ascii=False)}"
        rules.append(f"start: {prefix} {value}")
        return Grammar(lark="\n".join(rules) + "\n", kind="json", think=think)


class _VocabView:
    """The duck-typed tokenizer llguidance.TokenizerWrapper wants."""

    def __init__(self, f: GrammarFactory):
        tk = f.tokenizer
        spec = f.special_ids
        self.tokens = [(b"\xff" + tk.token_bytes(i)) if i in spec else tk.token_bytes(i)
                       for i in range(f.vocab_size)]
        self.special_token_ids = sorted(spec)
        self.eos_token_id = tk.eos_id if tk.eos_id is not None else (f.eos_ids[0] if f.eos_ids else 0)
        self.bos_token_id = tk.bos_id
        self._tk = tk

    def __call__(self, s):
        if isinstance(s, bytes):
            s = s.decode("utf-8", "replace")
        return self._tk.encode(s, parse_special=False, add_bos=False, add_eos=False)


def apply_bitmask_numpy(logits: np.ndarray, row: np.ndarray) -> np.ndarray:
    """logits with disallowed tokens set to -inf (CPU reference; logits beyond the mask are
    disallowed too)."""
    v = logits.shape[-1]
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little")
    if allowed.size < v:
        allowed = np.concatenate([allowed, np.zeros(v - allowed.size, np.uint8)])
    return np.where(allowed[:v].astype(bool), logits, -np.inf)
