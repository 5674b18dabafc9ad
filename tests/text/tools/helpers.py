"""Shared test data: realistic tool definitions, and a random-logit decoding driver for grammars."""

from __future__ import annotations

import time

import numpy as np

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and forecast for a place.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City, country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["location", "days"]}}}

WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a text file.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"},
        "content": {"type": "string"},
        "overwrite": {"type": "boolean"},
        "mode": {"type": ["integer", "null"]}},
        "required": ["path", "content"], "additionalProperties": False}}}

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "filters": {"type": "object", "properties": {"lang": {"type": "string"},
                                                     "since": {"type": "integer"}},
                    "additionalProperties": False}},
        "required": ["query"]}}}

TOOLS = [WEATHER, WRITE_FILE, SEARCH]


def tool_schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


# Texts whose continuation gets a logit bonus, so random sampling finishes structures. The mask
# does the constraining; the bias only makes loops end in tens of steps instead of never.
CLOSERS = ("</parameter>\n", "</param>", "]]>", "</function>\n", "</function>", "</tool_call>", "</think>",
           '"', "}", "]", "\n")


class RandomDriver:
    """mask -> N(0,1) logits (+ bias toward finishing) -> argmax among allowed -> consume."""

    def __init__(self, factory, closers=CLOSERS):
        self.f = factory
        tk = factory.tokenizer
        self.v = factory.vocab_size
        self.by_bytes: dict[bytes, int] = {}
        for i in range(self.v):
            b = tk.token_bytes(i)
            if b and i not in factory.special_ids:
                self.by_bytes.setdefault(b, i)
        self.special_closers = [i for i in factory.special_ids if tk.token_bytes(i).decode() in closers]
        self.closers = [c.encode() for c in closers]

    def _bias(self, tail: bytes) -> dict[int, float]:
        out: dict[int, float] = {}
        for c in self.closers:
            k = next(k for k in range(min(len(c) - 1, len(tail)), -1, -1) if k == 0 or tail.endswith(c[:k]))
            rest = c[k:]
            for n in range(1, len(rest) + 1):
                t = self.by_bytes.get(rest[:n])
                if t is not None:
                    # continuing a started closer weighs most; completing one a bit more
                    out[t] = max(out.get(t, 0.0), 3.0 * k + (1.0 if n == len(rest) else 0.0))
        return out

    def run(self, matcher, seed: int, *, delay: int = 0, max_steps: int = 1500, eos_when=None):
        """Decode until an end token; returns (text, steps, [mask seconds])."""
        rng = np.random.default_rng(seed)
        row = self.f.allocate_bitmask(1)[0]
        times = []
        for step in range(max_steps):
            t0 = time.perf_counter()
            matcher.fill_bitmask(row)
            times.append(time.perf_counter() - t0)
            allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.v].astype(bool)
            assert allowed.any(), "empty mask"
            logits = rng.normal(size=self.v)
            ramp = max(0, step - delay) * 0.05
            if step >= delay:
                tail = matcher.text().encode()[-16:]
                for t, w in self._bias(tail).items():
                    logits[t] += 2.0 + w + ramp
                for t in self.special_closers:
                    logits[t] += 4.0 + ramp
            for t in self.f.eos_ids:
                logits[t] += ramp + (100.0 if eos_when is not None and eos_when(matcher.text()) else 0.0)
            logits = np.where(allowed, logits, -np.inf)
            tok = int(np.argmax(logits))
            if tok in self.f.eos_set:
                return matcher.text(), step, times
            assert matcher.consume(tok), matcher.error()
        raise AssertionError(f"no end token after {max_steps} steps: {matcher.text()[-200:]!r}")
