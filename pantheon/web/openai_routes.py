"""GET /v1/models and POST /v1/chat/completions (non-streaming and SSE)."""

from __future__ import annotations

import time
import uuid

from quart import Blueprint, current_app, request

from pantheon.engine.chat import ChatPlan, plan_chat
from pantheon.engine.events import ChoiceEnd, Delta, PromptProgress, RequestEnd, RequestError
from pantheon.web import sse
from pantheon.web.chat_request import ChatRequest, parse_chat_request
from pantheon.web.errors import error_body, json_body
from pantheon.web.generation import (collect, count_input_tokens, delta_timings, plan_and_submit, progress_fields, response_format_status,
                                     system_fingerprint, timings)
from pantheon.web.rows import public_row

bp = Blueprint("openai", __name__)


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
    chat = parse_chat_request(await json_body(), request.headers.get("X-Session-Id"))
    engine, plan, events = await plan_and_submit(chat, plan_chat)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": engine.name,
            "system_fingerprint": system_fingerprint()}
    if chat.stream:
        return sse.streaming_response(_stream(chat, plan, meta, events, engine))
    try:
        return await _complete(chat, plan, meta, events, engine)
    finally:
        await events.aclose()


@bp.route("/v1/chat/completions/input_tokens", methods=["POST"])
@bp.route("/chat/completions/input_tokens", methods=["POST"])
async def chat_input_tokens():
    """llama-server's count of a chat request's prompt tokens (the template applied, tools rendered)."""
    chat = parse_chat_request(await json_body(), request.headers.get("X-Session-Id"))
    return {"object": "response.input_tokens", "input_tokens": await count_input_tokens(chat)}


def _logprobs(engine, tokens) -> list[dict]:
    tok = engine.tokenizer

    def entry(token_id: int, logprob: float) -> dict:
        raw = tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]


def usage(end: RequestEnd, kv_cap: int) -> dict:
    out = {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
           "total_tokens": end.prompt_tokens + end.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": end.cached_tokens}, "kv_used": end.kv_used, "kv_cap": kv_cap}
    if end.session_conflict:
        out["session_conflict"] = True
    return out


async def _complete(chat: ChatRequest, plan: ChatPlan, meta: dict, events, engine) -> dict:
    choices, end = await collect(events, chat.n)
    out = []
    for c in choices:
        content = c.content
        if c.tool_calls and not content.strip():
            content = None  # a pure tool call
        message = {"role": "assistant", "content": content}
        if c.reasoning:
            message["reasoning_content"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        choice = {"index": c.index, "message": message, "finish_reason": c.finish_reason}
        if c.end and c.end.tool_call_error:
            choice["tool_call_error"] = c.end.tool_call_error
        if chat.logprobs:
            choice["logprobs"] = {"content": _logprobs(engine, c.tokens)}
        out.append(choice)
    body = {**meta, "object": "chat.completion", "choices": out, "usage": usage(end, engine.effective_ctx),
            "timings": timings(end)}  # llama-server's, additive
    status = response_format_status(plan, [c.end for c in choices if c.end])
    if status:
        body["response_format_status"] = status
    if chat.n_status:
        body["n_status"] = chat.n_status
    return body


class ChunkStream:
    """A chat completion's SSE chunks in the contract's delta order. With n > 1 the choices stream
    one after another: a later choice's chunks are held until the earlier ones have ended."""

    def __init__(self, chat: ChatRequest, plan: ChatPlan, meta: dict, engine):
        self.chat, self.plan, self.meta, self.engine = chat, plan, meta, engine
        self.ends: list[ChoiceEnd] = []
        # The first chunk of each choice carries the role only, as the contract lists the deltas:
        # text starts with the first content delta (clients such as llama.cpp's test harness read a
        # present "content" as a text delta and reject an empty one).
        self.held: dict[int, list[bytes]] = {i: [self.chunk(i, {"role": "assistant"})] for i in range(chat.n)}
        self.current, self.ended = 0, set()  # the choice streaming now; the choices that ended

    def chunk(self, index: int, delta: dict, finish=None, logprobs=None, extra=None, top=None) -> bytes:
        chat = self.chat
        choice = {"index": index, "delta": delta, "finish_reason": finish, **(extra or {})}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        body = {**self.meta, "object": "chat.completion.chunk", "choices": [choice], **(top or {})}
        if finish is not None:
            if chat.n_status:
                body["n_status"] = chat.n_status
            status = (response_format_status(self.plan, self.ends) if len(self.ends) == chat.n
                      else self.plan.response_format_status)
            if status:
                body["response_format_status"] = status
        return sse.event(body)

    def render(self, ev: Delta | ChoiceEnd) -> bytes:
        if isinstance(ev, ChoiceEnd):
            self.ends.append(ev)
            extra = {"tool_call_error": ev.tool_call_error} if ev.tool_call_error else None
            return self.chunk(ev.index, {}, finish=ev.finish_reason, extra=extra)
        lp = _logprobs(self.engine, ev.tokens) if self.chat.logprobs else None
        top = delta_timings(ev)
        out = b""
        if ev.reasoning:
            out += self.chunk(ev.index, {"reasoning_content": ev.reasoning}, logprobs=None if ev.content else lp, top=top)
        if ev.content or (lp and not ev.reasoning):
            out += self.chunk(ev.index, {"content": ev.content}, logprobs=lp, top=top)
        for entry in ev.tool_calls:  # the opening chunk, then argument chunks, one per event
            out += self.chunk(ev.index, {"tool_calls": [entry]}, top=top)
        return out

    def progress(self, ev: PromptProgress) -> bytes:
        """llama-server's prompt progress chunk: the role, no content, and the counts."""
        return self.chunk(0, {"role": "assistant", "content": None}, top=progress_fields(ev, self.chat))

    def add(self, ev: Delta | ChoiceEnd) -> bytes | None:
        """Hold ev's chunks; what may go out now (None: ev's choice is not streaming yet)."""
        self.held.setdefault(ev.index, []).append(self.render(ev))
        if isinstance(ev, ChoiceEnd):
            self.ended.add(ev.index)
        return self.release() if ev.index == self.current else None

    def release(self) -> bytes:
        """The held chunks of the streaming choice, and of the ones after it while each has ended."""
        out = b""
        while self.current < self.chat.n:
            out += b"".join(self.held.pop(self.current, []))
            if self.current not in self.ended:
                self.held[self.current] = []
                break
            self.current += 1
        return out

    def finish(self, ev: RequestEnd) -> list[bytes]:
        usage_chunk = ([sse.event({**self.meta, "object": "chat.completion.chunk", "choices": [],
                                   "usage": usage(ev, self.engine.effective_ctx), "timings": timings(ev)})]
                       if self.chat.include_usage else [])
        return [self.release(), *usage_chunk, sse.DONE]

    def fail(self, ev: RequestError) -> bytes:
        """The status line is already sent. context_over_budget ends the stream as an error event;
        any other failure closes the open choices with "stop" (the contract) and then says why in an
        error event, so a client can tell a failure from a natural end."""
        error = sse.event(error_body(ev.type, ev.message, **ev.fields))
        if ev.type == "context_over_budget":
            return error
        out = self.release()
        for i in range(self.current, self.chat.n):
            out += b"".join(self.held.pop(i, [])) + (self.chunk(i, {}, finish="stop") if i not in self.ended else b"")
        return out + error + sse.DONE


async def _stream(chat: ChatRequest, plan: ChatPlan, meta: dict, events, engine):
    stream = ChunkStream(chat, plan, meta, engine)
    try:
        async for ev in events:
            if isinstance(ev, PromptProgress):
                yield stream.progress(ev)
            elif isinstance(ev, (Delta, ChoiceEnd)):
                out = stream.add(ev)
                if out is not None:
                    yield out
            elif isinstance(ev, RequestEnd):
                for piece in stream.finish(ev):
                    yield piece
            elif isinstance(ev, RequestError):
                yield stream.fail(ev)
                return
    finally:
        await events.aclose()
