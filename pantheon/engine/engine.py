"""Engine: one per loaded model. Ties the GGUF file, tokenizer, chat template and ModelRunner
together, and owns the device thread.

The asyncio side never touches a JAX array: it submits a `GenerationRequest` and reads events
(`Delta`, `ChoiceEnd`, `RequestEnd`, `RequestError`) from an asyncio queue that the device thread
fills. `run` is the synchronous loop itself (the CLI calls it directly)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

from pantheon.engine.graphs import GraphRegistry
from pantheon.engine.runner import ModelRunner, SlotSampling
from pantheon.engine.sampler import MAX_TOP_LOGPROBS, SamplingParams
from pantheon.gguf.reader import GGUFFile, open_gguf
from pantheon.model.spec import ModelSpec, spec_from_gguf
from pantheon.model.weights import load_params, numerics_for, params_nbytes
from pantheon.text.chat_template import ChatTemplate
from pantheon.text.pipeline import ChoiceText
from pantheon.text.reasoning import think_mode
from pantheon.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
THINK_CLOSE = "</think>\n\n"


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    choices: list[SamplingParams]  # one per choice; seeds already offset per choice
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    think: bool = False  # split <think>...</think> into reasoning_content
    start_in_reasoning: bool = False  # the rendered prompt ends inside an open think block
    reasoning_budget: int = 0  # force the think block closed after this many tokens (0 = off)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class TokenInfo:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    index: int
    reasoning: str = ""
    content: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)  # tokens since the previous delta (logprobs)


@dataclass
class ChoiceEnd:
    index: int
    finish_reason: str
    completion_tokens: int


@dataclass
class RequestEnd:
    prompt_tokens: int
    completion_tokens: int
    kv_used: int


@dataclass
class RequestError:
    type: str
    message: str
    fields: dict = field(default_factory=dict)  # extra members of the error object (kv_used, kv_cap)


class Engine:
    def __init__(self, path: str | Path, name: str | None = None, ctx_cap: int = 4096, n_slots: int = 1,
                 numerics: str = "llamacpp", reasoning_budget: int = 0, device=None):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf: GGUFFile = open_gguf(self.path)
        self.spec: ModelSpec = spec_from_gguf(self.gguf)
        self.name = name or self.path.name.removesuffix(".gguf")
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.template = ChatTemplate.from_gguf(self.gguf, self.tokenizer)
        self.think = think_mode(self.template.source)
        self.ctx_configured = ctx_cap if ctx_cap > 0 else self.spec.ctx_train
        self.ctx = min(self.ctx_configured, self.spec.ctx_train)
        self.reasoning_budget = reasoning_budget
        self.numerics = numerics_for(self.gguf, self.spec, numerics)
        self.registry = GraphRegistry()
        self.device = device
        params = load_params(self.gguf, self.spec, device=device)
        self.runner = ModelRunner(self.spec, self.numerics, params, n_slots, self.ctx, self.registry, device=device)
        self.load_s = time.perf_counter() - t0
        self.weight_bytes = params_nbytes(params)
        self.kv_bytes = self.runner.cache.nbytes
        self.prefill_tok_s: float | None = None  # measured on real prompts
        self.busy = threading.Lock()  # the single-user path: one generation at a time
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    # ---- text helpers -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], **kwargs) -> str:
        return self.template.render(messages, add_generation_prompt=True, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True, add_bos=False)

    # ---- the device thread ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve_jobs, name=f"device-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _serve_jobs(self) -> None:
        while (item := self._jobs.get()) is not None:
            request, emit, done = item
            try:
                self.run(request, emit)
            except Exception as e:  # noqa: BLE001 - a failed generation must not kill the thread
                log.exception("generation failed")
                emit(RequestError("server_error", f"generation failed: {e}"))
            finally:
                done()

    async def submit(self, request: GenerationRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator:
        """Run `request` on the device thread; yield its events. Closing the iterator early (client
        disconnect) cancels the generation, which stops at the next token."""
        self.start()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        finished = object()
        emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)

        def done():
            if on_done:
                on_done()
            loop.call_soon_threadsafe(events.put_nowait, finished)

        self._jobs.put((request, emit, done))
        try:
            while (ev := await events.get()) is not finished:
                yield ev
        finally:
            request.cancelled.set()

    # ---- the token loop -----------------------------------------------------------------------------
    def run(self, request: GenerationRequest, emit: Callable) -> None:
        """Generate every choice of `request` in turn on slot 0, emitting events."""
        runner, tok = self.runner, self.tokenizer
        prompt = request.prompt_ids
        if len(prompt) >= self.ctx:
            emit(RequestError("context_over_budget", f"prompt of {len(prompt)} tokens exceeds the context window "
                              f"(kv_used={len(prompt)}, kv_cap={self.ctx})", {"kv_used": len(prompt), "kv_cap": self.ctx}))
            return
        total, kv_used = 0, len(prompt)
        force_close = tok.encode(THINK_CLOSE, parse_special=True, add_bos=False)
        for index, params in enumerate(request.choices):
            if request.cancelled.is_set():
                return
            t0 = time.perf_counter()
            logits = runner.prefill(0, prompt, 0)[None]
            logits.block_until_ready()
            self.prefill_tok_s = len(prompt) / max(time.perf_counter() - t0, 1e-9)
            state = runner.start_sampling(0, params)
            text = ChoiceText(tok, request.stops, request.think, request.start_in_reasoning)
            n, reason = self._decode_choice(request, index, params, state, text, logits, force_close, emit)
            total += n
            kv_used = len(prompt) + n
            emit(ChoiceEnd(index, reason, n))
        emit(RequestEnd(len(prompt), total, kv_used))

    def _decode_choice(self, request, index, params, state: SlotSampling, text: ChoiceText, logits,
                       force_close: list[int], emit) -> tuple[int, str]:
        runner = self.runner
        pos = len(request.prompt_ids)
        budget = request.reasoning_budget if request.think else 0
        reasoning_tokens, forced = 0, []
        pending: list[TokenInfo] = []
        n = 0
        want_top = params.logprobs and params.top_logprobs > 0
        while True:
            if request.cancelled.is_set():
                return n, "stop"
            out = runner.sample(logits, [0], [state], forced=[forced.pop(0)] if forced else None)
            token = int(out.tokens[0])
            if token in self.tokenizer.eog_ids:
                self._emit_delta(emit, index, text.finish(), pending)
                return n, "stop"
            n += 1
            top = []
            if want_top:
                k = min(params.top_logprobs, MAX_TOP_LOGPROBS)
                top = [(int(a), float(b)) for a, b in zip(out.top_ids[0][:k], out.top_logprobs[0][:k])]
            if params.logprobs:
                pending.append(TokenInfo(token, float(out.logprob[0]), top))
            was_reasoning = text.in_reasoning
            delta = text.push(token)
            if delta.stopped:
                self._emit_delta(emit, index, delta, pending)
                return n, "stop"
            if delta:
                self._emit_delta(emit, index, delta, pending)
                pending = []
            if delta.looping:
                self._emit_delta(emit, index, text.finish(), pending)
                return n, "repetition_loop"
            if was_reasoning and text.in_reasoning and not forced:
                reasoning_tokens += 1
                if budget > 0 and reasoning_tokens == budget:
                    forced = list(force_close)
            if n >= request.max_tokens or pos + 1 >= self.ctx:
                self._emit_delta(emit, index, text.finish(), pending)
                return n, "length"
            logits = runner.decode([0], [token], [pos])
            pos += 1

    @staticmethod
    def _emit_delta(emit, index: int, delta, tokens: list[TokenInfo]) -> None:
        if delta or tokens:
            emit(Delta(index, delta.reasoning, delta.content, list(tokens)))
