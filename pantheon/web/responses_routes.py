"""POST /v1/responses (and /responses), GET and DELETE /v1/responses/{id}: OpenAI's Responses API
(openai-agents' default model class, Codex CLI), translated onto the chat request model.

`input` items become chat turns (`message`, `function_call` -> an assistant's tool_calls,
`function_call_output` -> tool turns, `reasoning` -> the next assistant turn's reasoning_content),
`instructions` a system turn, function `tools` chat tools, `text.format` a response_format. A kept
response (`store`, the default) holds its conversation, so `previous_response_id` continues it; a
continued chain is bound to a session (its `prompt_cache_key`, else one named after the chain), so
each follow-up prefills only what is new."""

from __future__ import annotations

import json
import time
import uuid

from quart import Blueprint, current_app, request

from pantheon.engine.chat import plan_chat
from pantheon.engine.events import ChoiceEnd, Delta, PromptProgress, RequestEnd, RequestError
from pantheon.web.chat_request import ChatRequest, function_tools, joined_text, sampling_fields
from pantheon.web.errors import ApiError, invalid, json_body, json_safe
from pantheon.web import sse
from pantheon.web.generation import (Choice, collect_one, count_input_tokens, delta_timings, merge_tool_deltas,
                                     plan_and_submit, progress_fields, response_format_status, timings)
from pantheon.web.response_store import Kept, ResponseStore

bp = Blueprint("responses", __name__)

TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _hex() -> str:
    return uuid.uuid4().hex


def store() -> ResponseStore:
    return current_app.pantheon.responses


def _text(where: str, content) -> str:
    """A string, or text parts joined (images and files are refused: this server is text only)."""
    return joined_text(where, content, TEXT_PARTS)


def _turns(items) -> list[dict]:
    """`input` -> chat turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid("'input' is required: a string or an array of input items")
    turns: list[dict] = []
    reasoning, last = None, None  # reasoning waiting for its assistant turn; the previous item's kind
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an input item object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"'{where}.role' must be user, assistant, system or developer")
            turn = {"role": "system" if role == "developer" else role,
                    "content": _text(f"{where}.content", item.get("content", ""))}
            if role == "assistant" and reasoning is not None:
                turn["reasoning_content"], reasoning = reasoning, None
            turns.append(turn)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise invalid(f"'{where}' (function_call) needs string 'call_id', 'name' and 'arguments'")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if last in ("assistant", "function_call") and turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
            else:
                turn = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                turns.append(turn)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output", "")
            if not isinstance(call_id, str):
                raise invalid(f"'{where}' (function_call_output) needs a string 'call_id'")
            turns.append({"role": "tool", "tool_call_id": call_id, "content": _text(f"{where}.output", output)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
            reasoning = "".join(t for t in texts if isinstance(t, str))
        else:
            raise invalid(f"'{where}' is a {kind!r:.40} item; this server reads message, function_call, "
                          "function_call_output and reasoning items")
        last = "assistant" if kind == "message" and turns[-1]["role"] == "assistant" else kind
    return turns


def _tools(value) -> list | None:
    """Function tools -> chat tools. Hosted tools (web_search, file_search, ...) run on OpenAI's side
    and are left out."""
    return function_tools(value, "parameters", lambda t: t.get("type") == "function",
                          {"type": "object", "properties": {}})


def _tool_choice(value):
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}")


def _response_format(text) -> dict | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


def parse_responses_request(body) -> tuple[ChatRequest, dict]:
    """The body -> (ChatRequest, what the response echoes and keeps)."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    prior, previous = None, body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise invalid("'previous_response_id' must be a string")
        prior = store().get(previous)
        if prior is None:
            raise ApiError(404, "not_found", f"previous response {previous!r:.80} is not kept here (never stored, "
                                             "deleted, or evicted); send the whole conversation as 'input'")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string")
    turns = _turns(body.get("input"))
    conversation = (prior.messages if prior else []) + turns
    if not conversation:
        raise invalid("'input' holds no items")
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    fields = sampling_fields({
        "model": body.get("model"), "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
        "stream": body.get("stream", False), "response_format": _response_format(body.get("text")),
        "enable_thinking": None if effort is None else effort not in ("none", "minimal"),
        "prompt_cache_key": body.get("prompt_cache_key"), "seed": body.get("seed"),
        "stop": body.get("stop"), "return_progress": body.get("return_progress"),
        "timings_per_token": body.get("timings_per_token"),
        "chat_template_kwargs": body.get("chat_template_kwargs")}, request.headers.get("X-Session-Id"))
    if fields["session_id"] is None and prior is not None:  # a continued chain resumes its own KV
        fields["session_id"] = prior.session_id or f"response:{previous}"
    keep = body.get("store", True)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat = ChatRequest(messages=messages, tools=_tools(body.get("tools")),
                       tool_choice=_tool_choice(body.get("tool_choice")), **fields)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
            "reasoning": reasoning if isinstance(reasoning, dict) else {"effort": None, "summary": None},
            "store": keep is not False, "temperature": chat.temperature, "top_p": chat.top_p,
            "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": "disabled", "metadata": body.get("metadata") or {}, "user": body.get("user")}
    return chat, {"echo": json_safe(echo), "conversation": conversation}


def _items(c: Choice, ids: dict) -> list[dict]:
    """A finished choice as output items: reasoning, then the message, then each function call."""
    items = []
    if c.reasoning:
        items.append(_reasoning_item(ids["rs"], c.reasoning))
    if c.content.strip() or not c.tool_calls:
        items.append(_message_item(ids["msg"], c.content))
    for call in c.tool_calls:
        items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _response(meta: dict, echo: dict, status: str, output: list, usage: dict | None = None,
              error: dict | None = None) -> dict:
    return {**meta, "object": "response", "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output, "usage": usage, **echo}


def _usage(end: RequestEnd, reasoning_tokens: int) -> dict:
    return {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": end.prompt_tokens + end.completion_tokens}


def _keep(kept: ResponseStore, meta: dict, chat: ChatRequest, ctx: dict, choice: Choice, response: dict) -> None:
    """Store the response with its conversation (this turn's output appended) for continuations."""
    if not ctx["echo"]["store"]:
        return
    turn = {"role": "assistant", "content": choice.content}
    if choice.reasoning:
        turn["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        turn["tool_calls"] = choice.tool_calls
    own = ctx["conversation"][-1:] + [turn]
    size = sum(len(json.dumps(t, ensure_ascii=False)) for t in own)
    kept.put(meta["id"], Kept(ctx["conversation"] + [turn], response, chat.session_id, size))


def _reasoning_tokens(engine, choice: Choice) -> int:
    return len(engine.tokenizer.encode(choice.reasoning, parse_special=False, add_bos=False)) if choice.reasoning else 0


@bp.route("/v1/responses", methods=["POST"])
@bp.route("/responses", methods=["POST"])  # clients configured with a base URL lacking /v1
async def create_response():
    chat, ctx = parse_responses_request(await json_body())
    engine, plan, events = await plan_and_submit(chat, plan_chat)
    meta = {"id": f"resp_{_hex()}", "created_at": int(time.time()), "model": engine.name}
    if chat.stream:
        return sse.streaming_response(_stream(store(), meta, chat, ctx, events, engine))
    choice, end = await collect_one(events)
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    body = _response(meta, ctx["echo"], status, _items(choice, {"rs": f"rs_{_hex()}", "msg": f"msg_{_hex()}"}),
                     _usage(end, _reasoning_tokens(engine, choice)))
    rf_status = response_format_status(plan, [choice.end] if choice.end else [])
    if rf_status:
        body["response_format_status"] = rf_status
    _keep(store(), meta, chat, ctx, choice, body)
    return body


@bp.route("/v1/responses/input_tokens", methods=["POST"])
@bp.route("/responses/input_tokens", methods=["POST"])
async def input_tokens():
    """OpenAI's responses.input_tokens.count: the prompt a create with this body would prefill."""
    chat, _ = parse_responses_request(await json_body())
    return {"object": "response.input_tokens", "input_tokens": await count_input_tokens(chat)}


@bp.route("/v1/responses/<response_id>", methods=["GET"])
@bp.route("/responses/<response_id>", methods=["GET"])
async def get_response(response_id: str):
    kept = store().get(response_id)
    if kept is None:
        raise ApiError(404, "not_found", f"no kept response {response_id!r:.80}")
    return kept.response


@bp.route("/v1/responses/<response_id>", methods=["DELETE"])
@bp.route("/responses/<response_id>", methods=["DELETE"])
async def delete_response(response_id: str):
    if not store().delete(response_id):
        raise ApiError(404, "not_found", f"no kept response {response_id!r:.80}")
    return {"id": response_id, "object": "response", "deleted": True}


class ResponseEvents:
    """The output items of one streamed response, as Responses events (SSE frames): each item opens
    (output_item.added), takes its deltas, and closes (its .done events, output_item.done) when the
    next one opens or the response ends."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []  # the closed items
        self.choice = Choice(0)  # the whole answer, for the kept conversation
        self.current: dict | None = None  # the open item: {"kind", "item", "text"}
        self.pending = ""  # whitespace before any item: a message only if no tool call follows
        self.timings: dict = {}  # the last delta's `timings` (timings_per_token): on each .delta event

    def event(self, kind: str, **payload) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        if kind.endswith(".delta"):
            data.update(self.timings)
        self.seq += 1
        return sse.event(data, kind)

    def _open(self, kind: str, item: dict) -> bytes:
        out = self.close()
        self.current = {"kind": kind, "item": item, "text": ""}
        i = len(self.output)
        out += self.event("response.output_item.added", output_index=i, item=item)
        if kind == "message":
            out += self.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                              part=_text_part(""))
        return out

    def _open_kind(self, kind: str) -> bool:
        return self.current is not None and self.current["kind"] == kind

    def close(self) -> bytes:
        """Close the open item, if any."""
        if self.current is None:
            return b""
        kind, item, text, i = self.current["kind"], self.current["item"], self.current["text"], len(self.output)
        if kind == "message":
            done = _message_item(item["id"], text)
            out = self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text, logprobs=[])
            out += self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=_text_part(text))
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text)
            out = self.event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text)
        else:
            done = _call_item(item["call_id"], item["name"], text)
            out = self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             name=item["name"], arguments=text)
        self.output.append(done)
        self.current = None
        return out + self.event("response.output_item.done", output_index=i, item=done)

    def _grow(self, kind: str, text: str, **fields) -> bytes:
        """Append to the open item, with its delta event."""
        self.current["text"] += text
        return self.event(kind, item_id=self.current["item"]["id"], output_index=len(self.output), **fields)

    def text(self, text: str) -> bytes:
        out = b"" if self._open_kind("message") else self._open("message", _message_item(f"msg_{_hex()}", None,
                                                                                           "in_progress"))
        return out + self._grow("response.output_text.delta", text, content_index=0, delta=text, logprobs=[])

    def delta(self, ev: Delta) -> bytes:
        """One engine Delta: reasoning, then content, then tool-call pieces."""
        out = b""
        self.choice.reasoning += ev.reasoning
        self.choice.content += ev.content
        if ev.reasoning:
            if not self._open_kind("reasoning"):
                out += self._open("reasoning", _reasoning_item(f"rs_{_hex()}", "", "in_progress"))
            out += self._grow("response.reasoning_text.delta", ev.reasoning, content_index=0, delta=ev.reasoning)
        if ev.content:
            if not self._open_kind("message") and not (self.pending + ev.content).strip():
                self.pending += ev.content  # held: a message, or the space before a tool call
            else:
                out += self.text(self.pending + ev.content)
                self.pending = ""
        merge_tool_deltas(self.choice.tool_calls, ev.tool_calls)  # the kept conversation's calls
        for entry in ev.tool_calls:
            fn = entry.get("function", {})
            if "id" in entry:
                self.pending = ""
                out += self._open("function_call", _call_item(entry["id"], fn.get("name", ""), "", "in_progress"))
            if fn.get("arguments") and self._open_kind("function_call"):
                out += self._grow("response.function_call_arguments.delta", fn["arguments"], delta=fn["arguments"])
        return out

    def finish(self) -> bytes:
        """The end: what is held becomes a message (never a response with no output), all closed."""
        out = b""
        if self.pending or not self.output and self.current is None:
            out += self.text(self.pending)
        return out + self.close()


async def _stream(kept: ResponseStore, meta: dict, chat: ChatRequest, ctx: dict, events, engine):
    """The documented event sequence: response.created and .in_progress, then each output item in
    turn (output_item.added, its content's deltas and .done events, output_item.done), then
    response.completed (.incomplete at max_output_tokens; .failed on an engine error)."""
    s = ResponseEvents()
    head = _response(meta, ctx["echo"], "in_progress", [])
    yield s.event("response.created", response=head) + s.event("response.in_progress", response=head)
    try:
        async for ev in events:
            if isinstance(ev, PromptProgress):  # llama-server's return_progress
                yield s.event("response.in_progress", response=head, **progress_fields(ev, chat))
            elif isinstance(ev, Delta):
                s.timings = delta_timings(ev)
                out = s.delta(ev)
                if out:
                    yield out
            elif isinstance(ev, ChoiceEnd):
                s.choice.end = ev
            elif isinstance(ev, RequestEnd):
                out = s.finish()
                status = "incomplete" if s.choice.finish_reason == "length" else "completed"
                final = _response(meta, ctx["echo"], status, s.output, _usage(ev, _reasoning_tokens(engine, s.choice)))
                _keep(kept, meta, chat, ctx, s.choice, final)
                yield out + s.event(f"response.{status}", response=final, timings=timings(ev))  # llama-server's
            elif isinstance(ev, RequestError):
                error = {"code": ev.type, "message": ev.message}
                failed = _response(meta, ctx["echo"], "failed", s.output, error=error)
                yield s.close() + s.event("response.failed", response=failed)
                return
    finally:
        await events.aclose()
