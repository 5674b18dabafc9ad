"""Tool-call dialects: how tools are described to a model, how it writes calls, how history renders.

Three dialects, chosen per served model by `dialect_for` (never from the GGUF chat template):

* `QwenXmlDialect` (default): Qwen3-Coder's XML calls::

      <tool_call>
      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>
      </tool_call>

  VALUE is raw text for strings (several lines allowed, no quoting or escaping) and JSON for
  numbers, booleans, null, arrays and objects.

* `MiniCpmXmlDialect` (llama-arch models whose chat template adds BOS: MiniCPM5): attribute XML,
  no wrapper tag, several calls simply follow each other::

      <function name="NAME"><param name="KEY">VALUE</param></function>

  A VALUE that contains "<", "&" or a line break is wrapped in `<![CDATA[...]]>`.
  Source: the chat template shipped with openbmb's MiniCPM5 checkpoints (`chat_template` in
  tokenizer_config.json). We read it as quoted by several independent ports, which agree on it
  word for word: the template renders calls with
  `'<function name="' ~ tool_call.name ~ '">'`, `'<param name="' ~ param_name ~ '">' ... '</param>'`,
  `'</function>'`; its tool instructions spell out the syntax above and the CDATA rule; tool
  definitions are JSON lines inside `<tools></tools>` in the system turn (a `<tool_def_sep>`
  marker in the system message says where they go); tool results go back in a user turn as
  `<tool_response>\\n...\\n</tool_response>`. The instruction text below is ours.

* `JsonDialect` (served names starting with "ornith"): a JSON object per call, bare on its own
  line or fenced in ```json ... ```: `{"name": NAME, "arguments": {...}}` ("function" is accepted
  for "name", "parameters" for "arguments"; a `<tool_call>...</tool_call>` wrapper is tolerated).

Tool specs come from the OpenAI `tools` list (`normalize_tools`). `apply_dialect` rewrites an
OpenAI conversation (system merge, assistant `tool_calls`, `tool` messages) into plain
`{role, content}` messages in the dialect, for chat templates that know nothing about tools.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

JSON_SEPARATORS = (", ", ": ")


class ToolSpecError(ValueError):
    """A `tools` entry is not a usable function definition."""


@dataclass(frozen=True)
class ToolSpec:
    """One offered function: its name, description and JSON-schema parameters."""
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    @property
    def properties(self) -> dict:
        props = self.parameters.get("properties") if isinstance(self.parameters, dict) else None
        return props if isinstance(props, dict) else {}

    @property
    def required(self) -> list[str]:
        req = self.parameters.get("required") if isinstance(self.parameters, dict) else None
        return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []

    @property
    def additional_allowed(self) -> bool:
        return not (isinstance(self.parameters, dict) and self.parameters.get("additionalProperties") is False)

    def openai(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


def normalize_tools(tools: Iterable[Any] | None) -> list[ToolSpec]:
    """OpenAI `tools` (`{"type": "function", "function": {...}}`, or the bare function object) ->
    ToolSpecs. Entries of another type are skipped; a function without a name raises."""
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for t in tools or ():
        if isinstance(t, ToolSpec):
            spec = t
        else:
            if not isinstance(t, Mapping):
                raise ToolSpecError(f"tool entries must be objects, got {type(t).__name__}")
            if t.get("type", "function") != "function":
                continue
            fn = t.get("function", t)
            if not isinstance(fn, Mapping):
                raise ToolSpecError("tool 'function' must be an object")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ToolSpecError("every tool function needs a non-empty string 'name'")
            params = fn.get("parameters")
            if params is None:
                params = {"type": "object", "properties": {}}
            if not isinstance(params, Mapping):
                raise ToolSpecError(f"tool {name!r}: 'parameters' must be a JSON schema object")
            desc = fn.get("description")
            spec = ToolSpec(name, desc if isinstance(desc, str) else "", dict(params))
        if spec.name in seen:  # a later duplicate adds nothing callable
            continue
        seen.add(spec.name)
        out.append(spec)
    return out


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=JSON_SEPARATORS)


def call_arguments(call: Mapping) -> tuple[str, dict]:
    """(name, arguments dict) of an OpenAI assistant `tool_calls` entry (arguments may be a JSON
    string, the wire form; a string that is not a JSON object is kept under "arguments")."""
    fn = call.get("function", call) if isinstance(call, Mapping) else {}
    name = fn.get("name", "") if isinstance(fn, Mapping) else ""
    args = fn.get("arguments", {}) if isinstance(fn, Mapping) else {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"arguments": args}
    if not isinstance(args, Mapping):
        args = {"arguments": args}
    return str(name), dict(args)


def _value_text(v: Any) -> str:
    """A parameter value as XML-dialect text: strings raw, everything else JSON."""
    return v if isinstance(v, str) else _dumps(v)


def _tool_lines(specs: list[ToolSpec]) -> str:
    return "\n".join(_dumps(s.openai()) for s in specs)


class Dialect:
    """Base class. Subclasses set `name` and `call_instructions` and implement `render_call`; the
    streaming scanner (`scan_*`) lives in parse.py and is looked up by `name`."""
    name = "base"
    # literal text the server may see starting a call, used by the `auto` grammar trigger
    call_openers: tuple[str, ...] = ()

    # what follows the tool list in the system prompt: how to write a call in this dialect
    call_instructions: str = ""
    # what stands between two calls of one assistant turn
    call_separator = "\n"

    def render_tools_system(self, tools, existing_system: str | None) -> str:
        if not self.call_instructions:
            raise NotImplementedError
        block = (
            "# Tools\n\n"
            "You can call the functions described below. Each line inside <tools></tools> is one "
            "function, given as a JSON schema:\n"
            f"<tools>\n{_tool_lines(normalize_tools(tools))}\n</tools>\n\n"
            + self.call_instructions
        )
        return self._merge_system(block, existing_system)

    def render_call(self, name: str, args: Mapping) -> str:
        raise NotImplementedError

    def render_assistant_tool_calls(self, tool_calls) -> str:
        return self.call_separator.join(self.render_call(*call_arguments(c)) for c in tool_calls or ())

    def render_tool_result(self, message: Mapping) -> str:
        content = message.get("content", "")
        if not isinstance(content, str):
            content = "" if content is None else _dumps(content)
        return f"<tool_response>\n{content}\n</tool_response>"

    @staticmethod
    def _merge_system(block: str, existing_system: str | None) -> str:
        if existing_system and "<tool_def_sep>" in existing_system:
            return existing_system.replace("<tool_def_sep>", block, 1)
        if existing_system and existing_system.strip():
            return existing_system.rstrip() + "\n\n" + block
        return block

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class QwenXmlDialect(Dialect):
    name = "qwen_xml"
    call_openers = ("<tool_call>",)

    call_instructions = (
        "To call a function, write this block, and nothing after it:\n\n"
        "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n"
        "</function>\n</tool_call>\n\n"
        "Rules for calls:\n"
        "- One <parameter=...> block per argument. Put the value on its own lines between the "
        "tags: plain text for strings (no quotes, no escaping, several lines are fine), JSON for "
        "numbers, booleans, null, arrays and objects.\n"
        "- Always give every required parameter, and only parameters the function defines.\n"
        "- To call several functions, write one <tool_call> block per call, one after another.\n"
        "- You may explain what you are about to do before the first call, never after the last.\n"
        "- If no function fits the request, answer the user directly without any <tool_call>."
    )

    def render_call(self, name: str, args: Mapping) -> str:
        parts = [f"<tool_call>\n<function={name}>\n"]
        for k, v in args.items():
            parts.append(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n")
        parts.append("</function>\n</tool_call>")
        return "".join(parts)


def _cdata_if_needed(text: str) -> str:
    if any(c in text for c in "<&\n"):
        # "]]>" cannot appear inside one CDATA section: split it across two
        return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"
    return text


def xml_attr(text: str) -> str:
    """Text escaped for a double-quoted XML attribute (names are normally plain identifiers)."""
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


class MiniCpmXmlDialect(Dialect):
    name = "minicpm_xml"
    call_openers = ('<function name="',)
    call_separator = ""

    call_instructions = (
        "How to call functions:\n"
        "- Write the call as <function name=\"FUNCTION_NAME\"><param name=\"PARAMETER_NAME\">"
        "value</param></function>, with one <param> per argument. Several calls simply follow "
        "each other.\n"
        "- Strings are written as plain text; numbers, booleans, null, arrays and objects as "
        "JSON.\n"
        "- If a value contains <, & or a line break, wrap it in a CDATA block: "
        "<param name=\"PARAMETER_NAME\"><![CDATA[...value...]]></param>\n"
        "- Always give every required parameter.\n"
        "- If no function is needed, answer normally and do not write any <function> tag."
    )

    def render_call(self, name: str, args: Mapping) -> str:
        parts = [f'<function name="{xml_attr(name)}">']
        for k, v in args.items():
            parts.append(f'<param name="{xml_attr(k)}">{_cdata_if_needed(_value_text(v))}</param>')
        parts.append("</function>")
        return "".join(parts)


class JsonDialect(Dialect):
    name = "json"
    call_openers = ('{"name": "',)

    call_instructions = (
        "To call a function, reply with one JSON object on its own line, exactly in this form:\n"
        "{\"name\": \"FUNCTION_NAME\", \"arguments\": {\"PARAMETER_NAME\": value}}\n\n"
        "Rules for calls:\n"
        "- \"arguments\" is a JSON object that matches the function's parameter schema; give "
        "every required parameter.\n"
        "- To call several functions, write one object per line.\n"
        "- You may explain what you are about to do before the first call, never after the last.\n"
        "- If no function is needed, answer normally without such an object."
    )

    def render_call(self, name: str, args: Mapping) -> str:
        return _dumps({"name": name, "arguments": dict(args)})


QWEN_XML = QwenXmlDialect()
MINICPM_XML = MiniCpmXmlDialect()
JSON_CALLS = JsonDialect()
DIALECTS: dict[str, Dialect] = {d.name: d for d in (QWEN_XML, MINICPM_XML, JSON_CALLS)}


def dialect_for(served_name: str, arch: str, template_adds_bos: bool) -> Dialect:
    """The dialect a served model emits: JSON for served names starting with "ornith", MiniCPM
    attribute XML for llama-arch models whose chat template adds BOS (MiniCPM5), Qwen3-Coder XML
    otherwise."""
    if (served_name or "").lower().startswith("ornith"):
        return JSON_CALLS
    if (arch or "").lower() == "llama" and template_adds_bos:
        return MINICPM_XML
    return QWEN_XML


def get_dialect(d: Dialect | str) -> Dialect:
    if isinstance(d, Dialect):
        return d
    try:
        return DIALECTS[d]
    except KeyError:
        raise ValueError(f"unknown tool dialect {d!r} (known: {', '.join(DIALECTS)})") from None


def apply_dialect(dialect: Dialect | str, messages: list[Mapping], tools) -> list[dict]:
    """Rewrite an OpenAI conversation into plain `{role, content}` messages in `dialect`.

    * The tool instructions are merged into the leading system message (one is added if absent).
    * An assistant turn's `tool_calls` are appended to its content in the dialect's call syntax
      (other keys, e.g. `reasoning_content`, are kept).
    * Consecutive `tool` messages become one `user` message of `<tool_response>` blocks.
    Messages are copied; the input is not modified. With no tools, only assistant calls and tool
    results are rewritten."""
    d = get_dialect(dialect)
    specs = normalize_tools(tools)
    out: list[dict] = []
    msgs = [dict(m) for m in messages]
    if specs:
        if msgs and msgs[0].get("role") == "system":
            sys_content = msgs[0].get("content")
            msgs[0]["content"] = d.render_tools_system(specs, sys_content if isinstance(sys_content, str) else None)
        else:
            msgs.insert(0, {"role": "system", "content": d.render_tools_system(specs, None)})
    for m in msgs:
        role = m.get("role") or "user"
        if role == "tool":
            block = d.render_tool_result(m)
            if out and out[-1].get("_tool_block"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_block": True})
            continue
        m = dict(m)
        if role == "assistant" and m.get("tool_calls"):
            calls_text = d.render_assistant_tool_calls(m.pop("tool_calls"))
            content = m.get("content")
            content = content if isinstance(content, str) else ""
            m["content"] = (content.rstrip() + "\n\n" + calls_text) if content.strip() else calls_text
        m["role"] = role
        out.append(m)
    for m in out:
        m.pop("_tool_block", None)
    return out
