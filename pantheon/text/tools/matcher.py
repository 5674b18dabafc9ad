"""A grammar and its per-slot matcher: the Lark text a GrammarFactory builds (grammar.py) with
what ending needs, and the llguidance matcher one decoding sequence advances token by token (the
bitmask of allowed tokens each step, the text that closes an open call at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from pantheon.text.tools.dialect import Dialect
from pantheon.text.tools.parse import ToolCallParser

if TYPE_CHECKING:
    from pantheon.text.tools.grammar import GrammarFactory


@dataclass
class Grammar:
    """A compiled-on-demand grammar: its Lark text plus what closing_text() needs."""
    lark: str
    kind: str                       # "tool" | "json" | "gbnf"
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
