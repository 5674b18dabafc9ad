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

Numbers are bounded everywhere (llguidance's JSON numbers are not): see rules.py. A translation
llguidance rejects falls back to plain `%json` ("numbers not bounded" in downgraded).

Each dialect writes its own call rules (`Dialect.call_rules`, dialects/*.py); this module adds the
think prefix and the mode around them and compiles; the per-slot matchers are matcher.py's.

End of generation: the model's end tokens (the vocabulary's EOG set) are allowed only where the
grammar accepts. Inside a call that is wherever the call can be completed by appending a fixed
text: after a complete parameter once all required ones are present, after `</function>` (Qwen),
after the arguments object (JSON). `closing_text()` returns that text (e.g.
"</function>\\n</tool_call>"); the server appends it to the output. It is also how to finish a
call cut off by max_tokens at such a point; cut off anywhere else (inside a value), it returns
None and the parser reports the call as unfinished.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from typing import Any

import llguidance as llg
import numpy as np

from pantheon.config import tool_grammar
from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.dialects import get_dialect
from pantheon.text.tools.matcher import Grammar, GrammarMatcher
from pantheon.text.tools.rules import GAP, X_GUIDANCE_RF, BoundedJson, lit, rename_rule, rx
from pantheon.text.tools.spec import ToolSpec, normalize_tools

_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4


class GrammarError(ValueError):
    """A grammar llguidance rejected."""


def tool_grammar_policy(tool_choice: Any, has_tools: bool, env: str | None = None) -> tuple[str, str | None] | None:
    """Which tool grammar PANTHEON_TOOL_GRAMMAR arms for a request: None, ("required", None),
    ("auto", None) or ("named", function_name).

    unset: only tool_choice "required"; "1": every request with tools; "0": none."""
    mode = tool_grammar(env)
    if not has_tools or tool_choice == "none" or mode == "off":
        return None
    if tool_choice == "required":
        return "required", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else {}
        name = fn.get("name") or tool_choice.get("name")
        if mode == "all":
            return ("named", name) if isinstance(name, str) and name else ("auto", None)
        return None
    return ("auto", None) if mode == "all" else None


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
        return lit(text)

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
            rules = [f"think_rest[lazy]: /(?s:.*){rx('</think>')}/"]
        if think == "open":
            return f"think_rest {GAP}?", rules
        rules.append(f"think_blk: {self._tag('<think>')} think_rest")
        return f"(think_blk {GAP}?)?", rules

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
        return Grammar(lark=lark, kind="tool", dialect=d, tools=specs, mode=mode, think=think,
                       closers=d.closers, downgraded=tuple(downgraded))

    def _tool_lark(self, d: Dialect, specs: list[ToolSpec], mode: str, think: str, typed: bool,
                   bounded: bool = False) -> str:
        prefix, rules = self._think_rules(think)
        c = d.call_rules(self._tag, specs, "bounded" if typed and bounded else typed)
        rules += c.rules
        if mode == "auto":
            # llguidance's lexer commits to one lexeme: where a text think block may open, free
            # text must not also be able to start with "<think>", or it would swallow the block
            no_think = ""
            if think == "optional" and not self._is_special("<think>"):
                no_think = f" & ~/{rx('<think>')}(?s:.*)/"
            if c.opener.startswith("<["):
                trig = f"TEXT {c.opener}"
            else:
                trig = "trig"
                # a dialect whose calls count only at the start of a line (as for its scanner): text
                # before the opener ends with a newline, then blanks
                lead = "((?s:.*)\\n)?[ \\t]*" if d.call_at_line_start else "(?s:.*)"
                rules.append(f"trig[lazy]: /{lead}{rx(json.loads(c.opener))}/{no_think}")
            rules.append(f"TEXT: /(?s:.*)/{no_think}")
            rules.append(f"body: TEXT | {trig} {c.after_open} ({c.between} {GAP}? {c.opener} {c.after_open})* {c.tail}")
            rules.append(f"start: {prefix} body")
        else:
            rules.append(f"start: {prefix} {c.call}")
        return "\n".join(rules) + "\n"

    # -- llama-server's `grammar` ---------------------------------------------------------------
    def gbnf_grammar(self, gbnf: str, think: str = "none") -> Grammar:
        """A GBNF grammar (llama.cpp's) as Lark through llguidance's converter, its root after the
        think block `think` allows; ValueError with the reason where it does not convert or
        compile."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(gbnf)
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exception (an unknown rule) too
            raise ValueError(str(e)[:400] or type(e).__name__) from None
        prefix, rules = self._think_rules(think)
        if prefix:  # the converted root is `start`; it becomes a rule under a start of ours
            lark = "\n".join([rename_rule(lark, "start", "gbnf_root"), *rules, f"start: {prefix} gbnf_root", ""])
        is_err, msgs = self.validate(lark)
        if is_err:
            raise ValueError((msgs[0] if msgs else "the grammar does not compile")[:400])
        return Grammar(lark=lark, kind="gbnf", think=think)

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
        xg = dict(X_GUIDANCE_RF)
        if isinstance(s.get("x-guidance"), dict):
            xg.update(s["x-guidance"])
        s["x-guidance"] = xg
        if bounded:
            value = BoundedJson(s, rules, xg, "j_", compact=False).expr(s)
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
