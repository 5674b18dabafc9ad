"""Engine: one per loaded model. Ties the GGUF file, tokenizer, chat template and ModelRunner
together. `generate` is the synchronous token loop used by the CLI and, from its own thread, by the
server; nothing outside the owning thread touches a JAX array."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from pantheon.engine.graphs import GraphRegistry
from pantheon.engine.runner import ModelRunner
from pantheon.engine.sampler import MAX_TOP_LOGPROBS, SamplingParams
from pantheon.gguf.reader import GGUFFile, open_gguf
from pantheon.model.spec import ModelSpec, spec_from_gguf
from pantheon.model.weights import load_params, numerics_for, params_nbytes
from pantheon.text.chat_template import ChatTemplate
from pantheon.text.tokenizer import Tokenizer


@dataclass
class TokenEvent:
    """One generated token, with what the response layer may need about it."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first
    finish_reason: str | None = None  # set on the last event: "stop" or "length"


@dataclass
class LoadStats:
    load_s: float
    weight_bytes: int
    kv_bytes: int


class Engine:
    def __init__(self, path: str | Path, name: str | None = None, ctx_cap: int = 4096, n_slots: int = 1,
                 numerics: str = "llamacpp"):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf: GGUFFile = open_gguf(self.path)
        self.spec: ModelSpec = spec_from_gguf(self.gguf)
        self.name = name or self.path.name.removesuffix(".gguf")
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.template = ChatTemplate.from_gguf(self.gguf, self.tokenizer)
        self.ctx = min(ctx_cap, self.spec.ctx_train) if ctx_cap > 0 else self.spec.ctx_train
        self.numerics = numerics_for(self.gguf, self.spec, numerics)
        self.registry = GraphRegistry()
        params = load_params(self.gguf, self.spec)
        self.runner = ModelRunner(self.spec, self.numerics, params, n_slots, self.ctx, self.registry)
        self.stats = LoadStats(time.perf_counter() - t0, params_nbytes(params), self.runner.cache.nbytes)

    # ---- text helpers -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], **kwargs) -> str:
        return self.template.render(messages, add_generation_prompt=True, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True)

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, slot: int = 0,
                 stop_ids: frozenset[int] | None = None) -> Iterator[TokenEvent]:
        """Prefill `prompt_ids` into `slot` and decode until an end token or `max_tokens`.
        The end token itself is reported (finish_reason "stop") but is not text."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + 1 > self.ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context window ({self.ctx})")
        stop_ids = self.tokenizer.eog_ids if stop_ids is None else stop_ids
        runner = self.runner
        state = runner.start_sampling(slot, sampling)
        logits = runner.prefill(slot, prompt_ids, 0)[None]
        pos = len(prompt_ids)
        for i in range(max_tokens):
            out = runner.sample(logits, [slot], [state])
            tok = int(out.tokens[0])
            ev = TokenEvent(tok, float(out.logprob[0]))
            if sampling.logprobs:
                k = min(sampling.top_logprobs, MAX_TOP_LOGPROBS)
                ev.top = [(int(a), float(b)) for a, b in zip(out.top_ids[0][:k], out.top_logprobs[0][:k])]
            if tok in stop_ids:
                ev.finish_reason = "stop"
            elif i == max_tokens - 1 or pos + 1 >= self.ctx:
                ev.finish_reason = "length"
            yield ev
            if ev.finish_reason:
                return
            logits = runner.decode([slot], [tok], [pos])
            pos += 1
