"""What every generating route shares, whatever API it speaks: submitting a planned request and
waiting for its slot (refusals become HTTP errors while the status line can still say so), the
engine's errors as statuses, and a finished request's choices collected from its events.

Each API module (chat completions, completions, Anthropic Messages, Responses) is a translation of
its body onto `ChatRequest` and of these results onto its own response shapes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from quart import current_app

from pantheon.engine.chat import ChatPlan, PlanError, PromptOverBudget, count_prompt_tokens
from pantheon.engine.events import (Admitted, ChoiceEnd, Delta, PromptProgress, RequestEnd, RequestError, Timings,
                                    failure_message)
from pantheon.engine.scheduler import BusyError, MemoryConstrained
from pantheon.web.errors import ApiError, invalid, status_of
from pantheon.web.observe import current_record, mark, note, observe_events

log = logging.getLogger(__name__)

def raise_for(err: RequestError):
    """An engine RequestError as the HTTP error it stands for."""
    retry = err.fields.get("retry_after")
    raise ApiError(status_of(err.type), err.type, err.message,
                   {"Retry-After": str(retry)} if retry is not None else None,
                   **{k: err.fields[k] for k in ("kv_used", "kv_cap") if k in err.fields})



async def count_input_tokens(chat) -> int:
    """The prompt a request would prefill, in tokens, with nothing generated: Anthropic's
    count_tokens, OpenAI's responses.input_tokens and llama-server's chat input_tokens."""
    engine = current_app.pantheon.resolve(chat.model)
    try:
        return await asyncio.to_thread(count_prompt_tokens, engine, chat)
    except PlanError as e:
        raise invalid(str(e)) from None


def system_fingerprint() -> str:
    """The build a response came from, as llama-server says it ("b" and the build id)."""
    return f"b{current_app.pantheon.build}"


def timings(end: RequestEnd) -> dict:
    """llama-server's `timings` of a finished request: the prompt tokens computed (not cached) and
    the tokens generated, each with its milliseconds and rates."""
    timing = end.timing or {}
    return timings_json(Timings(end.cached_tokens, end.prompt_tokens - end.cached_tokens,
                                timing.get("prefill_ms", 0.0) / 1e3, end.completion_tokens,
                                timing.get("decode_step_ms", 0.0) / 1e3, timing.get("decode_steps", 0)))


def timings_json(t: Timings) -> dict:
    """llama-server's `timings` object. The generation rate is over the decode steps: the first
    token comes from the prompt's last chunk and costs none."""
    prompt_ms, predicted_ms = round(t.prompt_s * 1e3, 3), round(t.predicted_s * 1e3, 3)
    return {"cache_n": t.cache_n, "prompt_n": t.prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / t.prompt_n if t.prompt_n else 0.0,
            "prompt_per_second": 1e3 * t.prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": t.predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / t.decode_steps if t.decode_steps else 0.0,
            "predicted_per_second": 1e3 * t.decode_steps / predicted_ms if predicted_ms and t.decode_steps else 0.0}


def delta_timings(ev: Delta) -> dict:
    """A streamed delta's `timings` field (`timings_per_token`), or nothing."""
    return {"timings": timings_json(ev.timings)} if ev.timings is not None else {}


def progress_fields(ev: PromptProgress, chat) -> dict:
    """A streamed chunk's llama-server fields for a PromptProgress event (`return_progress`):
    `prompt_progress`, and `timings` so far with `timings_per_token`."""
    fields = {"prompt_progress": {"total": ev.total, "cache": ev.cache, "processed": ev.processed,
                                  "time_ms": int(ev.elapsed_s * 1e3)}}
    if chat.timings_per_token:
        fields["timings"] = timings_json(ev.timings)
    return fields


async def plan_and_submit(chat, plan_fn):
    """Resolve `chat.model`, plan the request off the event loop with `plan_fn(engine, chat, window)`,
    submit it and wait for its slot. Returns (engine, plan, events); `events` yields what follows
    Admitted and must be closed by the caller."""
    state = current_app.pantheon
    state.refuse_if_shutting_down()
    state.admitting += 1  # a shutdown drain waits for this turn from here on
    try:
        engine = state.resolve(chat.model, chat.session_id)
        note(model=engine.name, session=chat.session_id)
        window = engine.effective_ctx
        try:
            # Rendering, tokenizing and grammar compiles are CPU work: off the event loop.
            plan = await asyncio.to_thread(plan_fn, engine, chat, window)
        except PlanError as e:
            raise invalid(str(e)) from None
        except RecursionError:  # a schema or message structure too deep to render or compile
            raise invalid("request nested too deeply to render (tools, response_format or messages)") from None
        except PromptOverBudget as e:
            # Known before the stream opens, so streamed or not it gets its status: 422, with
            # kv_used/kv_cap as fields of the error object as well as in the message text (a
            # deliberate, additive departure: the contract streams it as 200 + an SSE error event,
            # which stays for errors found after the stream opened).
            raise ApiError(422, "context_over_budget", str(e), kv_used=e.tokens, kv_cap=e.kv_cap) from None
        mark("planned")
        events = observe_events(engine.submit(plan.request), current_record(), state.metrics)
        await admitted(events, engine)
    finally:
        state.admitting -= 1
    return engine, plan, events


async def admitted(events, engine) -> None:
    """Wait until the scheduler gives the request its slot; refusals become HTTP errors here, while
    the status line can still say so."""
    try:
        first = await anext(events)
    except BusyError:
        raise ApiError(429, "server_busy", f"model {engine.name!r}: every slot is busy and the queue is full; "
                                           "retry", {"Retry-After": "1"}) from None
    except MemoryConstrained:
        raise ApiError(503, "server_memory_constrained", "host memory is critically low: admission refused; "
                                                         "retry later") from None
    if isinstance(first, RequestError):
        await events.aclose()
        raise_for(first)
    if not isinstance(first, Admitted):
        await events.aclose()
        message = failure_message(log, "internal error: the engine did not admit the request",
                                  detail=f"first engine event {first!r}")
        raise ApiError(500, "server_error", message)


def merge_tool_deltas(calls: list[dict], entries: list[dict]) -> None:
    """Assemble streaming tool-call entries into complete OpenAI tool_calls."""
    for e in entries:
        if "id" in e:
            calls.append({"id": e["id"], "type": "function",
                          "function": {"name": e["function"]["name"], "arguments": ""}})
        else:
            calls[e["index"]]["function"]["arguments"] += e["function"]["arguments"]


@dataclass
class Choice:
    """One choice of a finished request, as every API renders it."""

    index: int
    reasoning: str = ""
    content: str = ""
    tokens: list = field(default_factory=list)  # TokenInfo, when logprobs were asked for
    tool_calls: list[dict] = field(default_factory=list)  # complete OpenAI tool_calls
    end: ChoiceEnd | None = None

    @property
    def finish_reason(self) -> str:
        return self.end.finish_reason if self.end else "stop"


async def collect(events, n: int) -> tuple[list[Choice], RequestEnd]:
    """Run a request to its end: its n choices and the RequestEnd (an engine error raises)."""
    choices = [Choice(i) for i in range(n)]
    end = None
    async for ev in events:
        if isinstance(ev, Delta):
            c = choices[ev.index]
            c.reasoning += ev.reasoning
            c.content += ev.content
            c.tokens.extend(ev.tokens)
            merge_tool_deltas(c.tool_calls, ev.tool_calls)
        elif isinstance(ev, ChoiceEnd):
            choices[ev.index].end = ev
        elif isinstance(ev, RequestEnd):
            end = ev
        elif isinstance(ev, RequestError):
            raise_for(ev)
    if end is None:
        raise ApiError(500, "server_error", "generation ended without a result")
    for c in choices:
        failed = ((c.end.tool_call_error if c.end else None) or {}).get("index")
        if failed is not None and failed < len(c.tool_calls):  # announced while streaming, then cut off
            del c.tool_calls[failed]
    return choices, end


def response_format_status(plan: ChatPlan, ends: list[ChoiceEnd]) -> str | None:
    if not plan.json_constrained:
        return plan.response_format_status
    if not all(e.grammar_closed for e in ends):
        return "not_enforced"
    return "schema_downgraded" if plan.schema_downgraded else "applied"


async def collect_one(events) -> tuple[Choice, RequestEnd]:
    """A one-choice request run to its end (Anthropic Messages, Responses); the events are closed."""
    try:
        (choice,), end = await collect(events, 1)
    finally:
        await events.aclose()
    return choice, end
