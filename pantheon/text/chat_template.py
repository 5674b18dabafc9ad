"""Chat templates (`tokenizer.chat_template`) rendered the way HF transformers' apply_chat_template does.

Environment: jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension and a pass-through `{% generation %}...{% endgeneration %}` tag; globals
`raise_exception`, `strftime_now` and jinja's `namespace`; a `tojson` filter that is plain
`json.dumps(ensure_ascii=False)` (jinja's own HTML-escapes `<>&'`). Render variables: `messages`,
`tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`, any extra special-token
strings, plus request kwargs such as `enable_thinking`.

Messages are copied before rendering; an assistant message's `tool_calls[].function.arguments`
given as a JSON string (the OpenAI wire form) is parsed into a dict, because templates such as
Qwen3-Coder iterate `arguments|items`. Everything else (e.g. `reasoning_content`) passes through.

Every template problem (syntax, `raise_exception`, runtime type errors) raises ChatTemplateError.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template cannot be compiled or rendered for these messages."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
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

        def text(tid):
            return tokenizer.token_text(tid) if tid is not None else ""

        extra = {k: text(tid) for k, tid in (("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id))
                 if tid is not None}
        return cls(source, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id), extra_tokens=extra)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **kwargs) -> str:
        ctx: dict[str, Any] = {"documents": None}
        ctx.update(self.extra_tokens)
        ctx.update(kwargs)
        ctx.update(messages=normalize_messages(messages), tools=tools,
                   add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._template.render(**ctx)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
