"""Chat templates (`tokenizer.chat_template`) rendered the way HF transformers' apply_chat_template does.

Environment: jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension and a pass-through `{% generation %}...{% endgeneration %}` tag; globals
`raise_exception`, `strftime_now` and jinja's `namespace`; a `tojson` filter that is plain
`json.dumps(ensure_ascii=False)` (jinja's own HTML-escapes `<>&'`). Render variables: `messages`,
`tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`, any extra special-token
strings, today's `date_string` ("%d %b %Y") and `datetime` ("%b %d %Y") as llama.cpp adds them
(Llama 3.x templates otherwise print their fallback date), plus request kwargs such as
`enable_thinking` (which may set those two as well).

Messages are copied before rendering; an assistant message's `tool_calls[].function.arguments`
given as a JSON string (the OpenAI wire form) is parsed into a dict, because templates such as
Qwen3-Coder iterate `arguments|items`. Everything else (e.g. `reasoning_content`) passes through.

Every template problem (syntax, `raise_exception`, runtime type errors) raises ChatTemplateError.

`ChatTemplate.probe()` (run once at model load) renders a system/user/assistant/user conversation
with a time limit (PROBE_TIMEOUT_S, in a worker thread; `range()` and every call the template makes
check the deadline, so a looping template stops itself) and an output size limit (PROBE_MAX_CHARS):
a template that raises, loops or explodes refuses the model instead of failing every request.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

PROBE_TIMEOUT_S = 3.0
PROBE_MAX_CHARS = 1 << 20
PROBE_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Hi! How can I help?"},
                  {"role": "user", "content": "What is 2 + 2?"}]


class ChatTemplateError(ValueError):
    """The chat template cannot be compiled or rendered for these messages."""


# `--chat-template NAME`: common formats by llama.cpp's names (src/llama-chat.cpp renders them the
# same way), for files that carry no template (base models) or a wrong one; any other value is read
# as Jinja source. Each opens with bos_token, which a builtin gets only where the vocabulary adds a
# BOS to a prompt (tokenizer.ggml.add_bos_token), as llama.cpp tokenizes its builtins' output.
def _system_into_first_turn(trim: bool) -> str:
    return ("{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content']" + (" | trim" if trim else "")
            + " + '\n\n' %}{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}"
            "{% endif %}")


BUILTIN_TEMPLATES = {
    "chatml": "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
              "message['content'] + '<|im_end|>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    # Gemma has no system role: a system message opens the first user turn
    "gemma": "{{ bos_token }}" + _system_into_first_turn(True) + "{% for message in turns %}{{ '<start_of_turn>' + "
             "('model' if message['role'] == 'assistant' else message['role']) + '\n' + (prefix if loop.first "
             "else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
    "phi3": "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
            "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    # Mistral's [INST] turns (llama.cpp's mistral-v1); a system message opens the first one
    "mistral-v1": "{{ bos_token }}" + _system_into_first_turn(False) + "{% for message in turns %}"
                  "{% if message['role'] == 'assistant' %}{{ ' ' + message['content'] + '</s>' }}{% else %}"
                  "{{ ' [INST] ' + (prefix if loop.first else '') + message['content'] + ' [/INST]' }}{% endif %}"
                  "{% endfor %}",
}


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """The template called raise_exception (it refuses these messages on purpose)."""


class _OverLimit(Exception):
    """A limited render ran past its deadline or output size."""


_limits = threading.local()  # .deadline: time.monotonic() bound of a limited render in this thread


def _check_deadline() -> None:
    deadline = getattr(_limits, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _OverLimit("time")


def _limited_range(*args):
    r = safe_range(*args)  # the sandbox's own bound: at most MAX_RANGE items
    if getattr(_limits, "deadline", None) is None:
        return r
    return _deadline_iter(r)


def _deadline_iter(items):
    for i, x in enumerate(items):
        if not i & 255:
            _check_deadline()
        yield x


class _Environment(ImmutableSandboxedEnvironment):
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.globals["range"] = _limited_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Deep-copied messages with JSON-string tool-call arguments parsed to objects (left as the
    string if it is not valid JSON)."""
    out = copy.deepcopy(list(messages))
    for m in out:
        if not isinstance(m, dict):
            raise ChatTemplateError(f"each message must be an object, got {type(m).__name__}")
        calls = m.get("tool_calls")
        if not calls:
            continue
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                except json.JSONDecodeError:
                    pass
    return out


def fold_system_turns(messages: list[dict], keep_first: bool = True) -> list[dict]:
    """The messages with every system turn after the first (or every one: keep_first=False) folded
    into a user turn beside it (appended to the user turn before it, else opening the next one,
    else a user turn of its own): for templates that refuse a system turn anywhere but first, which
    clients such as Claude Code send, or anywhere (Gemma 2's; llama.cpp merges the system prompt
    into the next turn the same way). The messages themselves where there is none to fold."""
    start = 1 if keep_first else 0
    if not any(isinstance(m, dict) and m.get("role") == "system" for m in messages[start:]):
        return messages
    out, waiting = [], []
    for i, m in enumerate(messages):
        if i >= start and m.get("role") == "system":
            if out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{m.get('content') or ''}"}
            else:
                waiting.append(m.get("content") or "")
            continue
        if waiting and m.get("role") == "user":
            m, waiting = {**m, "content": "\n\n".join(waiting + [m.get("content") or ""])}, []
        out.append(m)
    if waiting:
        out.append({"role": "user", "content": "\n\n".join(waiting)})
    return out


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 extra_tokens: dict[str, str] | None = None):
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("empty chat template")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.extra_tokens = dict(extra_tokens or {})
        try:
            self._template = _make_env().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_gguf(cls, g, tokenizer, name: str | None = None) -> ChatTemplate:
        """The GGUF's `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`), with bos/eos
        (and unk/pad, which HF also passes) rendered as their vocabulary text."""
        meta = g.metadata if hasattr(g, "metadata") else g
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        source = meta.get(key)
        if not source:
            raise ChatTemplateError(f"GGUF has no {key}")
        return cls.for_vocabulary(source, tokenizer)

    @classmethod
    def given(cls, value: str, tokenizer) -> ChatTemplate:
        """`--chat-template`'s value: a builtin's name (BUILTIN_TEMPLATES), else Jinja source."""
        builtin = BUILTIN_TEMPLATES.get(value.strip().lower())
        if builtin is None:
            return cls.for_vocabulary(value, tokenizer)
        template = cls.for_vocabulary(builtin, tokenizer)
        if not tokenizer.add_bos:
            template.bos_token = ""
        return template

    @classmethod
    def for_vocabulary(cls, source: str, tokenizer) -> ChatTemplate:
        """`source` (a template's Jinja text) with the vocabulary's bos/eos/unk/pad text."""

        def text(tid):
            return tokenizer.token_text(tid) if tid is not None else ""

        extra = {k: text(tid) for k, tid in (("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id))
                 if tid is not None}
        return cls(source, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id), extra_tokens=extra)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **kwargs) -> str:
        return self._render(self._context(messages, add_generation_prompt, tools, kwargs))

    # what _context sets itself, over any kwargs: a request cannot give these as template arguments
    OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")

    def _context(self, messages, add_generation_prompt, tools, kwargs) -> dict[str, Any]:
        now = datetime.now()
        ctx: dict[str, Any] = {"documents": None, "date_string": now.strftime("%d %b %Y"),
                               "datetime": now.strftime("%b %d %Y")}
        ctx.update(self.extra_tokens)
        ctx.update(kwargs)
        ctx.update(messages=normalize_messages(messages), tools=tools,
                   add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        return ctx

    def _render(self, ctx: dict[str, Any], max_chars: int | None = None) -> str:
        try:
            if max_chars is None:
                return self._template.render(**ctx)
            out, n = [], 0
            for chunk in self._template.generate(**ctx):
                out.append(chunk)
                n += len(chunk)
                if n > max_chars:
                    raise _OverLimit("size")
                _check_deadline()
            return "".join(out)
        except _OverLimit:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError, RecursionError,
                MemoryError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S, max_chars: int = PROBE_MAX_CHARS) -> str:
        """Render PROBE_MESSAGES with add_generation_prompt once, within `timeout_s` seconds and
        `max_chars` characters, or raise ChatTemplateError saying why. A template that refuses a
        system message on purpose (raise_exception, e.g. Gemma's) is probed without it."""
        result: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s

        def work():
            _limits.deadline = deadline
            try:
                for messages in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):
                    try:
                        result["text"] = self._render(self._context(messages, True, None, {}), max_chars)
                        return
                    except ChatTemplateError as e:
                        result["error"] = e
                        if not isinstance(e.__cause__, _TemplateRaised):
                            return
            except _OverLimit as e:
                result["final"] = (f"chat template output exceeds {max_chars} characters for a 4-message "
                                   f"conversation" if str(e) == "size" else self._too_slow(timeout_s))
            except Exception as e:  # noqa: BLE001 - anything a template does wrong refuses it
                result["error"] = ChatTemplateError(f"{type(e).__name__}: {e}")
            finally:
                _limits.deadline = None

        worker = threading.Thread(target=work, name="chat-template-probe", daemon=True)
        worker.start()
        worker.join(timeout_s + 0.5)  # the deadline checks inside normally end it in time
        if worker.is_alive():
            raise ChatTemplateError(self._too_slow(timeout_s))
        if "text" in result:
            return result["text"]
        if "final" in result:
            raise ChatTemplateError(result["final"])
        e = result["error"]
        cause = e.__cause__
        detail = str(e) if cause is None else str(cause) if isinstance(cause, jinja2.exceptions.TemplateError) \
            else f"{type(cause).__name__}: {cause}"
        raise ChatTemplateError(f"chat template fails on a system/user/assistant/user conversation: "
                                f"{' '.join(detail.split())}") from cause

    @staticmethod
    def _too_slow(timeout_s: float) -> str:
        return f"chat template did not finish rendering a 4-message conversation in {timeout_s:g} s (a loop?)"
