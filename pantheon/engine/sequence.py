"""One choice of one request, from admission to finish, with its per-token policy.

The scheduler decides *when* a sequence computes; everything about *what a sampled token means*
lives here: end-of-generation ids, stop strings and the repetition detector (through the text
pipeline), the reasoning budget and its forced `</think>`, grammar masks and closing text,
max_tokens and the window. `accept` turns one sampled token into an `Outcome` the scheduler acts
on (emit a delta, finish with a reason, or go on)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pantheon.engine.events import GenerationRequest, Timings, TokenInfo
from pantheon.engine.sampler import MAX_TOP_LOGPROBS, SamplingParams
from pantheon.engine.sessions import Slot
from pantheon.text.pipeline import ChoiceText, TextDelta


@dataclass(frozen=True)
class TokenPolicy:
    """What a model contributes to every sequence's per-token decisions."""

    eog_ids: frozenset[int]
    force_close: tuple[int, ...]  # the tokens of "</think>\n\n", forced when the reasoning budget is spent
    ctx: int  # the window: a sequence whose next token would not fit ends with "length" (the ladder may
    # shrink it under memory pressure: Scheduler._token_policy)


@dataclass
class RequestState:
    """What the choices of one request share: the event sink and the usage counters."""

    request: GenerationRequest
    emit: object  # Callable[[event | None], None]
    enqueued: float
    remaining: int  # choices not finished yet
    admitted: bool = False
    completion_tokens: int = 0
    kv_used: int = 0
    cached: int = 0
    failed: bool = False
    # where its time went, for the request's trace line (web/observe.py): device steps it took part
    # in and their seconds, and the host time spent turning its tokens into text (detok, stops, tools)
    prefill_chunks: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    text_s: float = 0.0

    admitted_at: float = 0.0  # time.perf_counter() when it got its slot

    def timings(self, prompt_n: int, predicted_n: int) -> Timings:
        """llama-server's counts so far: `prompt_n` prompt tokens computed, `predicted_n` generated."""
        return Timings(self.cached, prompt_n, self.prefill_s, predicted_n, self.decode_s, self.decode_steps)

    def timing(self) -> dict:
        ms = lambda s: round(s * 1e3, 2)  # noqa: E731
        return {"prefill_chunks": self.prefill_chunks, "prefill_ms": ms(self.prefill_s),
                "decode_steps": self.decode_steps, "decode_step_ms": ms(self.decode_s), "detok_ms": ms(self.text_s)}


@dataclass
class Outcome:
    """What one accepted token asks of the scheduler."""

    delta: TextDelta | None = None  # text and tool-call events to emit now
    finish: str | None = None  # "stop" | "length" | "repetition_loop": the choice ends


@dataclass
class Sequence:
    state: RequestState
    index: int
    params: SamplingParams
    slot: Slot | None = None
    sampling: object = None  # the runner's SlotSampling
    text: ChoiceText | None = None
    history: list[int] = field(default_factory=list)  # tokens whose KV is in the slot
    prefill_at: int = 0
    last: int | None = None  # sampled, to be fed to the next decode step
    n: int = 0  # completion tokens
    forced: list[int] = field(default_factory=list)
    reasoning_tokens: int = 0
    pending: list[TokenInfo] = field(default_factory=list)  # logprobs not yet emitted
    prompt_scores: list[TokenInfo] = field(default_factory=list)  # the prompt's, as its chunks run
    matcher: object = None  # the grammar state of a constrained choice
    prefill_turn: int = 0  # the scheduler step that last gave this sequence a prefill chunk

    @property
    def request(self) -> GenerationRequest:
        return self.state.request

    @property
    def prefilling(self) -> bool:
        return self.prefill_at < len(self.request.prompt_ids)

    @property
    def decoding(self) -> bool:
        return not self.prefilling and self.last is not None

    # ---- what the next sampling call needs ----------------------------------------------------------
    def take_forced(self) -> int:
        """The token this row must produce next (-1: sample)."""
        return self.forced.pop(0) if self.forced else -1

    def fill_mask(self, row: np.ndarray) -> None:
        """Clear the bits of the tokens the grammar forbids (row starts all ones)."""
        if self.matcher is not None and not self.forced:
            self.matcher.fill_bitmask(row)

    # ---- one sampled token ----------------------------------------------------------------------------
    def accept(self, token: int, logprob: float, top: list[tuple[int, float]], policy: TokenPolicy,
               post: tuple[float, list[tuple[int, float]]] = (0.0, [])) -> Outcome:
        """post: the token's probability under the sampler's own distribution, and that
        distribution's likeliest tokens (llama-server's post_sampling_probs)."""
        req, params = self.request, self.params
        if token in policy.eog_ids:
            return Outcome(self.closing(), "stop")
        if self.matcher is not None:
            self.matcher.consume(token)
        self.n += 1
        if params.logprobs:
            n_top = min(params.top_logprobs, MAX_TOP_LOGPROBS)
            self.pending.append(TokenInfo(token, logprob, top[:n_top], post[0], post[1][:n_top]))
        was_reasoning = self.text.in_reasoning
        delta = self.text.push(token)
        if delta.stopped:
            return Outcome(delta, "stop")
        if delta.looping and not self.compelled:
            return Outcome(self._merge(delta, self.closing()), "repetition_loop")
        budget = req.reasoning_budget if req.think else 0
        if was_reasoning and self.text.in_reasoning and not self.forced:
            self.reasoning_tokens += 1
            if budget > 0 and self.reasoning_tokens == budget:
                self.forced = list(policy.force_close)
        if self.n >= req.max_tokens or len(self.history) + 1 >= policy.ctx:
            return Outcome(self._merge(delta, self.closing()), "length")
        self.last = token
        return Outcome(delta)

    @property
    def compelled(self) -> bool:
        """A choice the grammar compels to a call or a JSON value: a loop inside it runs into the
        grammar's bounds or max_tokens and is closed there, rather than cut off unfinished."""
        g = self.matcher.grammar if self.matcher is not None else None
        return g is not None and (g.kind == "json" or g.mode in ("required", "named"))

    def closing(self) -> TextDelta:
        """End of a choice: a constrained call that can still close gets its closing text appended
        (the grammar allowed the end token only where that is possible), then the text is flushed."""
        closing = self.matcher.closing_text() if self.matcher is not None else None
        first = self.text.push_text(closing) if closing else TextDelta()
        return self._merge(first, self.text.finish())

    @property
    def grammar_closed(self) -> bool | None:
        return None if self.matcher is None else self.matcher.closing_text() == ""

    @staticmethod
    def _merge(a: TextDelta, b: TextDelta) -> TextDelta:
        return TextDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls,
                         a.stopped or b.stopped, a.looping or b.looping)
