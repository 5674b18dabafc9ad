"""The chat-completion request body -> `ChatRequest`, with every default, clamp and alias of the
contract applied in this one place. Anything malformed raises a 400 `invalid_request_error`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

from quart import current_app, has_app_context

from pantheon.config import SamplingDefaults
from pantheon.engine.sampler import MAX_TEMPERATURE, REPETITION_RANGE
from pantheon.text.chat_template import ChatTemplate
from pantheon.web.errors import invalid

MAX_TOKENS_DEFAULT, MAX_TOKENS_NONPOSITIVE, MAX_TOKENS_CAP = 1024, 512, 1048576
MAX_N = 8
INT32_MAX = 2**31 - 1
ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    model: str | None = None
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int = MAX_TOKENS_DEFAULT
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # vLLM's and llama-server's: candidates under min_p x the likeliest dropped
    repetition_penalty: float = 1.0  # vLLM's (llama-server's repeat_penalty)
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    n_status: str | None = None
    response_format: dict | None = None
    grammar: str | None = None  # llama-server's GBNF constraint
    enable_thinking: bool | None = None
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs (vLLM's, llama-server's)
    reasoning_format: str = "auto"  # llama-server's: "none" leaves a think model's thoughts in the content
    reasoning_budget: int | None = None  # None -> the model's; <= 0 -> off
    tools: list | None = None
    tool_choice: Any = "auto"
    session_id: str | None = None
    return_progress: bool = False  # llama-server's: stream the prompt's prefill progress
    timings_per_token: bool = False  # llama-server's: timings on every streamed chunk
    # A raw completion (POST /v1/completions): the prompt as text or token ids, no chat template;
    # with a suffix, a fill-in-the-middle prompt. add_special: BOS as the model says.
    prompt: str | list[int] | None = None
    suffix: str | None = None
    add_special: bool = True
    prompt_logprobs: int | None = None  # score the prompt too (echo with logprobs): alternatives per token
    # vLLM's and llama-server's: the assistant's opening after the messages (a final assistant turn
    # is continued whatever this says), or the final message continued where it ends.
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def _number(body: dict, key: str, default, kind=float):
    """body[key] as `kind`; absent/null -> default; not a finite number -> 400 naming the field. An
    integer past what a float holds (10**400) reads as the largest float of its sign (float fields
    clamp it); an int field keeps Python's unbounded int for its own clamp."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{key}' must be a finite number, got {value!r:.40}")
    if isinstance(value, int):
        if kind is int:
            return value
        try:
            return float(value)
        except OverflowError:
            return sys.float_info.max if value > 0 else -sys.float_info.max
    if not math.isfinite(value):
        raise invalid(f"'{key}' must be a finite number, got {value!r}")
    return kind(value)


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def _tool_calls(i: int, calls) -> None:
    """An assistant turn's `tool_calls`: an array of objects whose `function` (if given) is an object
    with a string `name` and string-or-object `arguments`. Anything else is refused, not guessed."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise invalid(f"'{where}' must be an array of tool call objects")
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise invalid(f"'{where}[{j}]' must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise invalid(f"'{where}[{j}].function' must be an object")
        if "name" in fn and not isinstance(fn["name"], str):
            raise invalid(f"'{where}[{j}].function.name' must be a string")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise invalid(f"'{where}[{j}].function.arguments' must be a JSON string or an object")


TEXT_PARTS = {"text", "input_text"}  # "input_text": what newer OpenAI SDKs (Responses-style) send


def _content(i: int, content) -> str:
    """A message's content as the template's string. A string is itself; null, missing (an assistant
    turn with tool_calls) or any other non-array reads as "" as the contract says. An array of
    content parts (OpenAI SDKs, opencode) is its text parts joined in order, as llama-server does: a
    deliberate, additive departure from the contract, which reads it as empty. A part of another
    type (image_url, input_audio, file, ...) is refused: this server is text only; a malformed part
    is refused naming the field."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""  # the contract's leniency, kept for every non-array type
    where = f"messages[{i}].content"
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"'{where}[{j}]' must be a content part object such as {{\"type\": \"text\", "
                          f"\"text\": \"...\"}}")
        kind = part.get("type")
        if kind is None and "text" in part:
            kind = "text"  # a bare {"text": "..."}: the only reading it has
        if not isinstance(kind, str):
            raise invalid(f"'{where}[{j}].type' must be a string such as \"text\"")
        if kind not in TEXT_PARTS:
            raise invalid(f"'{where}[{j}]' is a {kind!r:.40} part: this model accepts text only")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{where}[{j}].text' must be a string")
        texts.append(text)
    return "".join(texts)


def joined_text(where: str, value, kinds: dict[str, str], sep: str = "") -> str:
    """A string, or an array of text parts joined by `sep`: `kinds` maps each accepted part type to
    the key holding its text. A part of any other type is refused (this server is text only), as is
    a malformed one, naming the field (the Responses and Anthropic routes' content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be a string or an array of content parts")
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = kinds.get(kind) if isinstance(kind, str) else None
        if key is not None and isinstance(part.get(key), str):
            out.append(part[key])
        elif isinstance(kind, str) and key is None:
            raise invalid(f"'{where}[{j}]' is a {kind!r:.40} part: this model accepts text only")
        else:
            first = next(iter(kinds))
            raise invalid(f"'{where}[{j}]' must be a text part {{\"type\": \"{first}\", \"{kinds[first]}\": \"...\"}}")
    return sep.join(out)


def function_tools(value, schema_key: str, runs_here, default_schema: dict) -> list | None:
    """An API's tool list -> chat function tools. `runs_here(tool)`: whether this server runs it (a
    tool the API's provider hosts, such as web search, is left out); its schema is under
    `schema_key` (`default_schema` when absent)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'tools' must be an array of tool definitions")
    out = []
    for j, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid(f"'tools[{j}]' must be an object")
        if not runs_here(tool):
            continue
        name, schema = tool.get("name"), tool.get(schema_key) or default_schema
        if not isinstance(name, str) or not name:
            raise invalid(f"'tools[{j}].name' must be a non-empty string")
        if not isinstance(schema, dict):
            raise invalid(f"'tools[{j}].{schema_key}' must be a JSON schema object")
        fn = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def prompt_list(field: str, value, most: int) -> list[str | list[int]]:
    """A prompt field of the completions and embeddings APIs: a string, an array of token ids, or an
    array of either (none empty), at most `most` of them."""
    def ids(v) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        items = list(value)
    else:
        raise invalid(f"'{field}' is required: a string, an array of strings, an array of token ids, or an array of "
                      "token-id arrays (none empty)")
    if len(items) > most:
        raise invalid(f"'{field}' holds {len(items)} items; at most {most} per request")
    return items


def is_token_id(v) -> bool:
    """An integer that is not a bool (JSON's true is no token id)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _object_prompt(field: str, value: dict):
    """llama-server's prompt objects: {"prompt_string": text}, or {"content": [text parts]} (its
    multimodal form; the parts' text joined, and any other part refused: this serves text only)."""
    if value.get("multimodal_data"):  # llama-server's media beside a prompt_string
        raise invalid(f"'{field}' carries multimodal_data: this model accepts text only")
    if "prompt_string" in value:
        return value["prompt_string"]
    parts = value.get("content")
    if not isinstance(parts, list) or not parts:
        raise invalid(f"a prompt object in '{field}' needs \"prompt_string\" or \"content\": [text parts]")
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise invalid(f"'{field}' holds a part other than text: this model accepts text only")
    return "".join(p["text"] for p in parts)


def llama_prompts(field: str, value, most: int) -> list[str | list]:
    """llama-server's prompt forms (its /completion, its embeddings' input): text, token ids, or text
    and ids mixed in one array (a top-level array holding any number is one prompt); otherwise each
    element of an array is a prompt (text, ids, mixed, or an object: {"prompt_string": text},
    {"content": [text parts]}); at most `most`."""
    if isinstance(value, dict):
        value = _object_prompt(field, value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if any(is_token_id(v) for v in value):
            if not all(is_token_id(v) or isinstance(v, str) for v in value):
                raise invalid(f"'{field}' mixes token ids with something that is neither text nor an id")
            return [value]
        out = []
        for p in value:
            if isinstance(p, dict):
                p = _object_prompt(field, p)
            if not (isinstance(p, str) or (isinstance(p, list) and p and all(is_token_id(v) or isinstance(v, str)
                                                                              for v in p))):
                raise invalid(f"each of '{field}' must be text, token ids, or a prompt object")
            out.append(p)
        if len(out) > most:
            raise invalid(f"'{field}' holds {len(out)} prompts; at most {most} per request")
        return out
    raise invalid(f"'{field}' is required: text, token ids, or an array of prompts")


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' is required and must be a non-empty array")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object with 'role' and 'content'")
        msg = dict(m)
        role = msg.get("role")
        if role is not None and not isinstance(role, str):
            raise invalid(f"'messages[{i}].role' must be a string")
        msg["role"] = role or "user"  # missing role -> user
        msg["content"] = _content(i, msg.get("content"))
        if not isinstance(msg.get("reasoning_content"), str):
            msg.pop("reasoning_content", None)
        if msg.get("tool_calls") is not None:
            _tool_calls(i, msg["tool_calls"])
        out.append(msg)
    return out


def _with_defaults(body: dict, ops: SamplingDefaults) -> dict:
    """body with the operator's default for each sampling field it leaves out (null counts as out;
    a field's aliases count as given)."""
    aliases = {"max_tokens": ("max_tokens", "max_completion_tokens", "n_predict"),
               "repetition_penalty": ("repetition_penalty", "repeat_penalty")}
    out = dict(body)
    for key, value in ops.given().items():
        if all(body.get(k) is None for k in aliases.get(key, (key,))):
            out[key] = MAX_TOKENS_CAP if key == "max_tokens" and value < 0 else value
    return out


# llama-server's reasoning formats served: auto and deepseek split thoughts into reasoning_content
REASONING_FORMATS = ("auto", "deepseek", "none")


def _template_kwargs(value, server: dict) -> dict:
    """chat_template_kwargs: more arguments for the chat template (Qwen3's enable_thinking,
    reasoning_effort, Command-R's documents, ...) over the serve's --chat-template-kwargs."""
    if value is None:
        return dict(server)
    if not isinstance(value, dict):
        raise invalid("'chat_template_kwargs' must be an object of the chat template's arguments")
    for key in value:
        if key in ChatTemplate.OWN_VARIABLES:
            raise invalid(f"'chat_template_kwargs.{key}' is set by the server: give it in its own field")
    thinking = value.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("'chat_template_kwargs.enable_thinking' must be a boolean")
    return {**server, **value}


def _stop(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid("'stop' must be a string or an array of strings")


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases")
    out = []
    for k, v in value.items():
        try:
            token = int(str(k).strip())
        except ValueError:
            continue  # non-numeric keys are skipped
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            continue  # non-numeric values are skipped
        out.append((token, float(_clamp(v, -100, 100))))  # clamped first: an int past a float's range
    return tuple(out)


def _session_id(body: dict, header: str | None) -> str | None:
    for key in ("session_id", "prompt_cache_key", "promptCacheKey"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    return header or None


def parse_chat_request(body: Any, session_header: str | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be an array of tool definitions")
    messages = _messages(body.get("messages"))
    return ChatRequest(messages=messages, tools=tools, tool_choice=body.get("tool_choice", "auto"),
                       **_continuation(body, messages), **sampling_fields(body, session_header))


def _continuation(body: dict, messages: list[dict]) -> dict:
    """add_generation_prompt and continue_final_message, checked as llama-server checks them (vLLM
    refuses the same pair): both true is a 400, and so is continuing a turn of tool calls."""
    opening = body.get("add_generation_prompt")
    if opening is None:
        opening = True
    elif not isinstance(opening, bool):
        raise invalid("'add_generation_prompt' must be a boolean")
    go_on = body.get("continue_final_message")
    if go_on == "reasoning_content":
        raise invalid("'continue_final_message': continuing the final message's reasoning_content is not "
                      "supported here; true (or \"content\") continues its content")
    if go_on is not None and not isinstance(go_on, bool) and go_on != "content":
        raise invalid("'continue_final_message' must be a boolean (or \"content\")")
    go_on = go_on is True or go_on == "content"
    if go_on and opening:
        raise invalid("Cannot set both add_generation_prompt and continue_final_message to true "
                      "(add_generation_prompt defaults to true: give it as false)")
    if go_on and messages[-1].get("tool_calls"):
        raise invalid("Cannot continue an assistant message that contains tool calls")
    return {"add_generation_prompt": opening, "continue_final_message": go_on}


def operator_defaults() -> SamplingDefaults:
    """The serve's sampling defaults (--temp, ..., -n), within a request to the app; else none."""
    state = getattr(current_app, "pantheon", None) if has_app_context() else None
    return state.config.sampling if state is not None else SamplingDefaults()


def sampling_fields(body: dict, session_header: str | None = None) -> dict:
    """The fields every generating API shares (sampling, limits, stops, logprobs, n, format,
    thinking, session), with the contract's defaults and clamps: ChatRequest's keyword arguments.
    A field the body leaves out takes the operator's default where serve set one."""
    ops = operator_defaults()
    if ops.given():
        body = _with_defaults(body, ops)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None and body.get("n_predict") is not None:  # llama-server's name; -1: to the window
        max_tokens = _number(body, "n_predict", 0, int)
        max_tokens = MAX_TOKENS_CAP if max_tokens < 0 else max_tokens
    max_tokens = MAX_TOKENS_DEFAULT if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", 0, int)
    max_tokens = MAX_TOKENS_NONPOSITIVE if max_tokens <= 0 else min(max_tokens, MAX_TOKENS_CAP)
    n = _number(body, "n", 1, int)
    n_status = None
    if n > MAX_N:
        n, n_status = MAX_N, "capped_to_8"
    n = max(n, 1)
    budget = body.get("reasoning_budget", body.get("max_reasoning_tokens"))
    if budget is not None:
        budget = min(_number({"reasoning_budget": budget}, "reasoning_budget", 0, int), INT32_MAX)
    template_kwargs = _template_kwargs(body.get("chat_template_kwargs"), ops.template_kwargs or {})
    reasoning_format = body.get("reasoning_format")
    if reasoning_format not in (None,) + REASONING_FORMATS:
        raise invalid(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)} (llama-server's "
                      f"deepseek-legacy is not served here), got {reasoning_format!r:.40}")
    thinking = body.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("'enable_thinking' must be a boolean")
    if thinking is None:  # the template's own switch, however it came (a request's kwargs, --reasoning)
        thinking = template_kwargs.pop("enable_thinking", None)
    template_kwargs.pop("enable_thinking", None)
    stream_options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, int)
    model = body.get("model")
    rf = body.get("response_format")
    schema = body.get("json_schema")  # llama-server's top-level form of a json_schema response_format
    if rf is None and schema is not None:
        if not isinstance(schema, dict):
            raise invalid("'json_schema' must be a JSON schema object")
        rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise invalid("'grammar' must be a GBNF grammar as a string")
    return dict(
        model=model if isinstance(model, str) else None,
        # Sampling fields are clamped into what the sampler's device arrays hold, here, at parse
        # time: no value of one request can overflow the batch it decodes in.
        temperature=_clamp(_number(body, "temperature", 0.7), 0.0, MAX_TEMPERATURE),
        top_p=_clamp(_number(body, "top_p", 0.95), 0.0, 1.0),
        top_k=_clamp(_number(body, "top_k", 40, int), 0, INT32_MAX),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=seed,
        presence_penalty=_clamp(_number(body, "presence_penalty", 0.0), -2.0, 2.0),
        frequency_penalty=_clamp(_number(body, "frequency_penalty", 0.0), -2.0, 2.0),
        min_p=_clamp(_number(body, "min_p", 0.0), 0.0, 1.0),
        repetition_penalty=_clamp(_number(body, "repetition_penalty", _number(body, "repeat_penalty", 1.0)),
                                  *REPETITION_RANGE),
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=bool(body.get("logprobs", False)),
        top_logprobs=_clamp(_number(body, "top_logprobs", 0, int), 0, 20),
        n=n, n_status=n_status,
        response_format=rf if isinstance(rf, dict) else None,
        grammar=grammar or None,
        enable_thinking=thinking,
        template_kwargs=template_kwargs,
        reasoning_format=reasoning_format or "auto",
        reasoning_budget=budget,
        session_id=_session_id(body, session_header),
        return_progress=body.get("return_progress") is True,
        timings_per_token=body.get("timings_per_token") is True,
    )
