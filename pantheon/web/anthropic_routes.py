"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (the `anthropic` SDK,
Claude Code), translated onto the chat request model: `system` becomes a system turn, content blocks
become turns (`tool_use` -> an assistant's tool_calls, `tool_result` -> tool turns, `thinking` ->
reasoning_content), `tools[].input_schema` -> function parameters. Errors on these routes are in
Anthropic's shape (errors.error_response). Headers `x-api-key`, `anthropic-version`,
`anthropic-beta` and the `?beta=true` query Claude Code adds are accepted."""

from __future__ import annotations

import json
import re
import uuid

from quart import Blueprint, request

from pantheon.engine.chat import plan_chat
from pantheon.engine.events import ChoiceEnd, Delta, RequestEnd, RequestError
from pantheon.web.chat_request import ChatRequest, function_tools, joined_text, sampling_fields
from pantheon.web.errors import anthropic_error_body, invalid, json_body, status_of
from pantheon.web import sse
from pantheon.web.generation import Choice, collect_one, count_input_tokens, plan_and_submit

bp = Blueprint("anthropic", __name__)


def _text(where: str, value, sep: str = "") -> str:
    """A string, or an array of text blocks joined (images and documents are refused)."""
    return joined_text(where, value, {"text": "text"}, sep)


_BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(\n+|\Z)")


def _system_text(where: str, value) -> str:
    """A system prompt's text. Claude Code opens it with a billing header (`x-anthropic-billing-
    header: cc_version=2.1.197.c23; ...`) whose version suffix and `cch=` hash change from request
    to request: left out (Anthropic's billing metadata, no instruction), so the prompt's prefix
    stays cached across requests and sessions. llama-server holds the `cch=` hash fixed, which
    leaves the version suffix to change."""
    if isinstance(value, list):  # its own text block
        value = [b for b in value if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                          and _BILLING_HEADER.match(b["text"]))] or ""
    return _BILLING_HEADER.sub("", _text(where, value, "\n\n"))


def _turns(i: int, msg) -> list[dict]:
    """One Anthropic message -> chat turns (a user message with tool results becomes tool turns
    first, then its text)."""
    if not isinstance(msg, dict):
        raise invalid(f"messages[{i}] must be an object with 'role' and 'content'")
    role, content = msg.get("role"), msg.get("content")
    if role == "system":  # Claude Code sends system turns among the messages: kept in their place
        return [{"role": "system", "content": _system_text(f"messages[{i}].content", content)}]
    if role not in ("user", "assistant"):
        raise invalid(f"'messages[{i}].role' must be \"user\", \"assistant\" or \"system\"")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"'messages[{i}].content' must be a string or an array of content blocks")
    text, reasoning, calls, results = [], [], [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise invalid(f"'{where}' (tool_use) needs a string 'name' and an object 'input'")
            calls.append({"id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            body = block.get("content", "")
            result = _text(f"{where}.content", body) if body is not None else ""
            if block.get("is_error") is True:
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
        elif isinstance(kind, str) and kind in ("image", "document", "search_result"):
            raise invalid(f"'{where}' is a {kind!r} block: this model accepts text only")
        else:
            raise invalid(f"'{where}' is not a content block this route reads for role {role!r} (text, "
                          + ("thinking, tool_use)" if role == "assistant" else "tool_result)"))
    if role == "assistant":
        turn = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _tools(value) -> list | None:
    """Anthropic tools -> OpenAI function tools. Server tools (web search, code execution: a `type`
    other than "custom") run on Anthropic's side and are left out."""
    return function_tools(value, "input_schema", lambda t: t.get("type", "custom") == "custom", {"type": "object"})


def _tool_choice(value):
    if value is None:
        return "auto"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}")


def parse_messages_request(body, counting: bool = False) -> ChatRequest:
    """A Messages body -> ChatRequest. `max_tokens` is required, except to count tokens."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not counting and (max_tokens is None or isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                         or max_tokens < 1):
        raise invalid("'max_tokens' is required: a positive integer")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' is required and must be a non-empty array")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system_text("system", body["system"])})
    for i, m in enumerate(raw):
        messages.extend(_turns(i, m))
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid("'stop_sequences' must be an array of strings")
    thinking, budget = body.get("thinking"), None
    enable = None
    if isinstance(thinking, dict):
        # "adaptive" (Claude Code's default): the model decides, as its template does unasked
        enable = {"enabled": True, "disabled": False}.get(thinking.get("type"))
        if enable and isinstance(thinking.get("budget_tokens"), int):
            budget = thinking["budget_tokens"]
    fields = sampling_fields({"model": body.get("model"), "max_tokens": max_tokens or 1,
                              "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                              "top_k": body.get("top_k"), "stop": stops, "stream": body.get("stream", False),
                              "enable_thinking": enable, "reasoning_budget": budget,
                              "chat_template_kwargs": body.get("chat_template_kwargs")},
                             request.headers.get("X-Session-Id"))
    return ChatRequest(messages=messages, tools=_tools(body.get("tools")),
                       tool_choice=_tool_choice(body.get("tool_choice")), **fields)


def _stop_reason(end: ChoiceEnd | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a choice's end."""
    if end is None:
        return "end_turn", None
    if end.finish_reason == "tool_calls":
        return "tool_use", None
    if end.finish_reason == "length":
        return "max_tokens", None
    if end.stop_string is not None:
        return "stop_sequence", end.stop_string
    return "end_turn", None


def _usage(end: RequestEnd) -> dict:
    """Anthropic counts cached prompt tokens apart: input_tokens are the ones prefilled anew."""
    return {"input_tokens": end.prompt_tokens - end.cached_tokens, "output_tokens": end.completion_tokens,
            "cache_read_input_tokens": end.cached_tokens, "cache_creation_input_tokens": 0}


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(c: Choice) -> list[dict]:
    blocks = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if c.content.strip() or not c.tool_calls:  # a text block always, unless the turn is only tool calls
        blocks.append({"type": "text", "text": c.content})
    for call in c.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _arguments(call["function"]["arguments"])})
    return blocks


@bp.route("/v1/messages", methods=["POST"])
async def messages():
    chat = parse_messages_request(await json_body())
    engine, plan, events = await plan_and_submit(chat, plan_chat)
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": engine.name}
    if chat.stream:
        return sse.streaming_response(_stream(message, events, len(plan.request.prompt_ids)))
    choice, end = await collect_one(events)
    reason, sequence = _stop_reason(choice.end)
    return {**message, "content": _blocks(choice), "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(end)}


@bp.route("/v1/messages/count_tokens", methods=["POST"])
async def count_tokens():
    return {"input_tokens": await count_input_tokens(parse_messages_request(await json_body(), counting=True))}


def _event(name: str, payload: dict) -> bytes:
    return sse.event(payload, name)


class MessageBlocks:
    """The content blocks of one streamed message as Anthropic's events: one block open at a time
    (content_block_start, its deltas, content_block_stop)."""

    def __init__(self):
        self.index, self.open_kind = -1, None

    def close(self) -> bytes:
        if self.open_kind is None:
            return b""
        out = self.delta({"type": "signature_delta", "signature": ""}) if self.open_kind == "thinking" else b""
        self.open_kind = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def start(self, kind: str, block: dict) -> bytes:
        out = self.close()
        self.index, self.open_kind = self.index + 1, kind
        return out + _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})

    def delta(self, payload: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": payload})

    def add(self, ev: Delta) -> bytes:
        """One engine Delta: thinking, then text, then tool_use blocks and their input."""
        out = b""
        if ev.reasoning:
            if self.open_kind != "thinking":
                out += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self.delta({"type": "thinking_delta", "thinking": ev.reasoning})
        if ev.content and (self.open_kind == "text" or ev.content.strip() or not ev.tool_calls):
            if self.open_kind != "text":
                out += self.start("text", {"type": "text", "text": ""})
            out += self.delta({"type": "text_delta", "text": ev.content})
        for entry in ev.tool_calls:
            fn = entry.get("function", {})
            if "id" in entry:
                out += self.start("tool_use", {"type": "tool_use", "id": entry["id"], "name": fn.get("name", ""),
                                               "input": {}})
            if fn.get("arguments"):
                out += self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        return out

    def finish(self) -> bytes:
        """Close the last block; a message with none gets an empty text block."""
        opened = b"" if self.index >= 0 else self.start("text", {"type": "text", "text": ""})
        return opened + self.close()


async def _stream(message: dict, events, prompt_tokens: int):
    """message_start, then one content block at a time (thinking, text, tool_use: each opened by
    content_block_start, filled by its deltas, closed by content_block_stop), message_delta with
    the stop reason and usage, message_stop."""
    blocks, end = MessageBlocks(), None
    # The prompt's length is known now; how much of it the cache held is told in message_delta.
    usage0 = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
              "cache_creation_input_tokens": 0}
    yield _event("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage0}})
    yield _event("ping", {"type": "ping"})
    try:
        async for ev in events:
            if isinstance(ev, Delta):
                out = blocks.add(ev)
                if out:
                    yield out
            elif isinstance(ev, ChoiceEnd):
                end = ev
            elif isinstance(ev, RequestEnd):
                reason, sequence = _stop_reason(end)
                stop = {"stop_reason": reason, "stop_sequence": sequence}
                yield blocks.finish() + _event("message_delta", {"type": "message_delta", "delta": stop,
                                                                 "usage": _usage(ev)}) \
                    + _event("message_stop", {"type": "message_stop"})
            elif isinstance(ev, RequestError):
                yield blocks.close() + _event("error", anthropic_error_body(status_of(ev.type), ev.message))
                return
    finally:
        await events.aclose()
