"""What the asyncio side hands the device thread (`GenerationRequest`) and what comes back."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from pantheon.engine.sampler import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    choices: list[SamplingParams]  # one per choice; seeds already offset per choice
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    think: bool = False  # split <think>...</think> into reasoning_content
    start_in_reasoning: bool = False  # the rendered prompt ends inside an open think block
    # reasoning_format "none" (llama-server's): the thoughts stay in the content, not split out
    # (the budget still closes the block); the content opens with this (the think block's opening
    # the prompt holds, or "")
    thoughts_in_content: str | None = None
    reasoning_budget: int = 0  # force the think block closed after this many tokens (0 = off)
    session_id: str | None = None  # choice 0 resumes from / stores into this session's cache
    dialect: object = None  # a tools Dialect: parse tool calls out of the content
    tools: list | None = None  # the request's tool definitions (for typed argument parsing)
    grammar: object = None  # a tools Grammar constraining every choice (tool call or JSON)
    progress: bool = False  # report the prompt's prefill as it goes (PromptProgress events)
    timed: bool = False  # every Delta carries the request's timings so far
    # Score the prompt (PromptLogprobs before the first token): each prompt token's log-probability
    # given the ones before it, with this many likeliest alternatives (0-20); None: off. The prompt
    # then runs from its first token (no cached prefix: its positions' logits are needed).
    prompt_logprobs: int | None = None
    # Where the last user turn starts in prompt_ids, for a model whose slots are marked there too
    # (SlotTable.mark: a conversation sharing only what comes before resumes there); None: no mark.
    mark_at: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class TokenInfo:
    token: int
    logprob: float  # under the model's distribution
    top: list[tuple[int, float]]  # its likeliest tokens and their log-probabilities
    prob: float = 0.0  # under the sampler's distribution (after bias, penalties, temperature, top-k/p)
    post: list[tuple[int, float]] = field(default_factory=list)  # the sampler's likeliest and their probabilities


@dataclass
class Timings:
    """A request's counts and device seconds so far (llama-server's `timings`): prompt tokens found
    cached and computed, tokens generated, and the decode steps that generated them (the first
    token comes from the prompt's last chunk)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_s: float = 0.0
    predicted_n: int = 0
    predicted_s: float = 0.0
    decode_steps: int = 0


@dataclass
class PromptProgress:
    """How far the prompt's prefill has come (llama-server's `return_progress`): `processed` of its
    `total` tokens are in the cache, `cache` of them found there; `elapsed_s` since admission."""

    total: int
    cache: int
    processed: int
    elapsed_s: float
    timings: Timings


@dataclass
class PromptLogprobs:
    """The prompt's scores (GenerationRequest.prompt_logprobs), once its prefill is done: an entry for
    each prompt token after the first (the first has no context to be scored in)."""

    first_token: int  # the prompt's first token (unscored)
    tokens: list[TokenInfo]


@dataclass
class Admitted:
    """The request got its slot; nothing can refuse it any more."""

    cached_tokens: int


@dataclass
class Delta:
    index: int
    reasoning: str = ""
    content: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)  # tokens since the previous delta (logprobs)
    tool_calls: list[dict] = field(default_factory=list)  # streaming delta.tool_calls[] entries
    timings: Timings | None = None  # with GenerationRequest.timed


@dataclass
class ChoiceEnd:
    index: int
    finish_reason: str
    completion_tokens: int
    tool_call_error: dict | None = None  # a call begun but not finished (or invalid)
    grammar_closed: bool | None = None  # constrained choices: did the output complete the grammar
    stop_string: str | None = None  # the stop string that ended it (Anthropic's stop_sequence)


@dataclass
class RequestEnd:
    prompt_tokens: int
    completion_tokens: int
    kv_used: int
    cached_tokens: int = 0
    session_conflict: bool = False
    timing: dict | None = None  # RequestState.timing(): prefill chunks, decode steps, detok time


@dataclass
class RequestError:
    type: str
    message: str
    fields: dict = field(default_factory=dict)  # kv_used/kv_cap for context_over_budget; retry_after


def failure_message(log: logging.Logger, what: str, error: BaseException | None = None, detail: str = "") -> str:
    """A server_error's message: what failed, in words, and a short request id; the full exception
    is logged under the same id (a client's report of the id finds the traceback). No exception
    class or text reaches the client."""
    rid = uuid.uuid4().hex[:12]
    log.error("%s [request id %s]%s", what, rid, f" ({detail})" if detail else "", exc_info=error)
    return f"{what} (request id {rid})"
