"""GET /v1/models and POST /v1/chat/completions (non-streaming and SSE)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from quart import Blueprint, Response, current_app, request

from pantheon.engine.scheduler import BusyError, MemoryConstrained
from pantheon.engine.chat import ChatPlan, PlanError, PromptOverBudget, plan_chat
from pantheon.engine.events import Admitted, ChoiceEnd, Delta, RequestEnd, RequestError, failure_message
from pantheon.web import sse
from pantheon.web.chat_request import ChatRequest, parse_chat_request
from pantheon.web.errors import ApiError, error_body, invalid, json_body
from pantheon.web.observe import current_record, mark, note, observe_events
from pantheon.web.rows import public_row

bp = Blueprint("openai", __name__)
log = logging.getLogger(__name__)


@bp.route("/v1/models", methods=["GET"])
@bp.route("/models", methods=["GET"])  # clients configured with a base URL lacking /v1
async def list_models():
    state = current_app.pantheon
    seen, data = set(), []
    for entry in state.pool.ready():
        if entry.config.name in seen:  # same-name replicas: one logical id
            continue
        seen.add(entry.config.name)
        data.append(public_row(entry))
    body = {"object": "list", "backend": state.backend, "build": state.build, "data": data}
    if state.load_errors:  # start-up loads that failed, and why (additive)
        body["load_errors"] = state.load_errors
    return body


@bp.route("/v1/chat/completions", methods=["POST"])
@bp.route("/chat/completions", methods=["POST"])  # clients configured with a base URL lacking /v1
async def chat_completions():
    state = current_app.pantheon
    state.refuse_if_shutting_down()
    state.admitting += 1  # a shutdown drain waits for this turn from here on
    try:
        chat = parse_chat_request(await json_body(), request.headers.get("X-Session-Id"))
        engine = state.resolve(chat.model, chat.session_id)
        note(model=engine.name, session=chat.session_id)
        kv_cap = engine.effective_ctx
        try:
            # Rendering, tokenizing and grammar compiles are CPU work: off the event loop.
            plan = await asyncio.to_thread(plan_chat, engine, chat, kv_cap)
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
        await _admitted(events, engine)
    finally:
        state.admitting -= 1
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": engine.name}
    if chat.stream:
        response = Response(_stream(chat, plan, meta, events, engine), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        response.timeout = None
        return response
    try:
        return await _complete(chat, plan, meta, events, engine)
    finally:
        await events.aclose()


async def _admitted(events, engine) -> None:
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
        _raise_for(first)
    if not isinstance(first, Admitted):
        await events.aclose()
        message = failure_message(log, "internal error: the engine did not admit the request",
                                  detail=f"first engine event {first!r}")
        raise ApiError(500, "server_error", message)


def _logprobs(engine, tokens) -> list[dict]:
    tok = engine.tokenizer

    def entry(token_id: int, logprob: float) -> dict:
        raw = tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]


def _usage(end: RequestEnd, kv_cap: int) -> dict:
    usage = {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
             "total_tokens": end.prompt_tokens + end.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": end.cached_tokens}, "kv_used": end.kv_used, "kv_cap": kv_cap}
    if end.session_conflict:
        usage["session_conflict"] = True
    return usage


_STATUS = {"context_over_budget": 422, "server_busy": 429, "model_at_session_capacity": 429}


def _raise_for(err: RequestError):
    retry = err.fields.get("retry_after")
    raise ApiError(_STATUS.get(err.type, 500), err.type, err.message,
                   {"Retry-After": str(retry)} if retry is not None else None,
                   **{k: err.fields[k] for k in ("kv_used", "kv_cap") if k in err.fields})


def _response_format_status(plan: ChatPlan, ends: list[ChoiceEnd]) -> str | None:
    if not plan.json_constrained:
        return plan.response_format_status
    if not all(e.grammar_closed for e in ends):
        return "not_enforced"
    return "schema_downgraded" if plan.schema_downgraded else "applied"


def _merge_tool_deltas(calls: list[dict], entries: list[dict]) -> None:
    """Assemble streaming tool-call entries into complete OpenAI tool_calls."""
    for e in entries:
        if "id" in e:
            calls.append({"id": e["id"], "type": "function",
                          "function": {"name": e["function"]["name"], "arguments": ""}})
        else:
            calls[e["index"]]["function"]["arguments"] += e["function"]["arguments"]


async def _complete(chat: ChatRequest, plan: ChatPlan, meta: dict, events, engine) -> dict:
    choices = [{"index": i, "reasoning": "", "content": "", "logprobs": [], "tool_calls": [], "end": None}
               for i in range(chat.n)]
    usage = None
    async for ev in events:
        if isinstance(ev, Delta):
            c = choices[ev.index]
            c["reasoning"] += ev.reasoning
            c["content"] += ev.content
            c["logprobs"].extend(ev.tokens)
            _merge_tool_deltas(c["tool_calls"], ev.tool_calls)
        elif isinstance(ev, ChoiceEnd):
            choices[ev.index]["end"] = ev
        elif isinstance(ev, RequestEnd):
            usage = _usage(ev, engine.effective_ctx)
        elif isinstance(ev, RequestError):
            _raise_for(ev)
    if usage is None:
        raise ApiError(500, "server_error", "generation ended without a result")
    out = []
    for c in choices:
        end = c["end"] or ChoiceEnd(c["index"], "stop", 0)
        failed = (end.tool_call_error or {}).get("index")
        if failed is not None and failed < len(c["tool_calls"]):  # announced while streaming, then cut off
            del c["tool_calls"][failed]
        content = c["content"]
        if c["tool_calls"] and not content.strip():
            content = None  # a pure tool call
        message = {"role": "assistant", "content": content}
        if c["reasoning"]:
            message["reasoning_content"] = c["reasoning"]
        if c["tool_calls"]:
            message["tool_calls"] = c["tool_calls"]
        choice = {"index": c["index"], "message": message, "finish_reason": end.finish_reason}
        if end.tool_call_error:
            choice["tool_call_error"] = end.tool_call_error
        if chat.logprobs:
            choice["logprobs"] = {"content": _logprobs(engine, c["logprobs"])}
        out.append(choice)
    body = {**meta, "object": "chat.completion", "choices": out, "usage": usage}
    status = _response_format_status(plan, [c["end"] for c in choices if c["end"]])
    if status:
        body["response_format_status"] = status
    if chat.n_status:
        body["n_status"] = chat.n_status
    return body


async def _stream(chat: ChatRequest, plan: ChatPlan, meta: dict, events, engine):
    """SSE in the contract's delta order. With n > 1 the choices stream one after another: events of
    a later choice are held until the earlier ones have ended."""

    ends: list[ChoiceEnd] = []

    def chunk(index: int, delta: dict, finish=None, logprobs=None, extra=None) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish, **(extra or {})}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        body = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        if finish is not None:
            if chat.n_status:
                body["n_status"] = chat.n_status
            status = _response_format_status(plan, ends) if len(ends) == chat.n else plan.response_format_status
            if status:
                body["response_format_status"] = status
        return sse.event(body)

    def render(ev) -> bytes:
        if isinstance(ev, ChoiceEnd):
            ends.append(ev)
            extra = {"tool_call_error": ev.tool_call_error} if ev.tool_call_error else None
            return chunk(ev.index, {}, finish=ev.finish_reason, extra=extra)
        lp = _logprobs(engine, ev.tokens) if chat.logprobs else None
        out = b""
        if ev.reasoning:
            out += chunk(ev.index, {"reasoning_content": ev.reasoning}, logprobs=None if ev.content else lp)
        if ev.content or (lp and not ev.reasoning):
            out += chunk(ev.index, {"content": ev.content}, logprobs=lp)
        for entry in ev.tool_calls:  # the opening chunk, then argument chunks, one per event
            out += chunk(ev.index, {"tool_calls": [entry]})
        return out

    # The first chunk of each choice carries the role only, as the contract lists the deltas: text
    # starts with the first content delta (clients such as llama.cpp's test harness read a present
    # "content" as a text delta and reject an empty one).
    held: dict[int, list[bytes]] = {i: [chunk(i, {"role": "assistant"})] for i in range(chat.n)}
    current, ended = 0, set()

    def release() -> bytes:
        nonlocal current
        out = b""
        while current < chat.n:
            out += b"".join(held.pop(current, []))
            if current not in ended:
                held[current] = []
                break
            current += 1
        return out

    try:
        async for ev in events:
            if isinstance(ev, (Delta, ChoiceEnd)):
                held.setdefault(ev.index, []).append(render(ev))
                if isinstance(ev, ChoiceEnd):
                    ended.add(ev.index)
                if ev.index == current:
                    yield release()
            elif isinstance(ev, RequestEnd):
                yield release()
                if chat.include_usage:
                    yield sse.event({**meta, "object": "chat.completion.chunk", "choices": [],
                                     "usage": _usage(ev, engine.effective_ctx)})
                yield sse.DONE
            elif isinstance(ev, RequestError):
                # The status line is already sent. context_over_budget ends the stream as an error
                # event; any other failure closes the open choices with "stop" (the contract) and
                # then says why in an error event, so a client can tell a failure from a natural end.
                if ev.type == "context_over_budget":
                    yield sse.event(error_body(ev.type, ev.message, **ev.fields))
                    return
                out = release()
                for i in range(current, chat.n):
                    out += b"".join(held.pop(i, [])) + (chunk(i, {}, finish="stop") if i not in ended else b"")
                yield out + sse.event(error_body(ev.type, ev.message, **ev.fields)) + sse.DONE
                return
    finally:
        await events.aclose()
