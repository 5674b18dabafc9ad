"""What a tool-call dialect is: one class per dialect, in one module of `dialects/` each.

A dialect is everything about how one model family writes tool calls:

* rendering: how the offered tools are described in the system turn (`call_instructions`), how
  an assistant turn's calls and the tool results render into history (`render_call`,
  `render_tool_result`), for chat templates that know nothing about tools (`apply`);
* scanning: `Scanner`, which reads a call out of the output as it streams (see scanning.py);
* grammar: `call_rules`, the Lark rules that constrain a call (tool_choice, see grammar.py), and
  `closers`, the texts that can close a call cut short at a point where it is complete;
* selection: `serves(served_name, arch, template_adds_bos)`; `dialects.dialect_for` asks every
  dialect, highest `priority` first.

Adding a dialect is adding one module to `dialects/` that defines `DIALECT`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pantheon.text.tools.rules import CallRules, Tag
from pantheon.text.tools.scanning import Scanner
from pantheon.text.tools.spec import ToolSpec, call_arguments, dumps, normalize_tools


def value_text(v: Any) -> str:
    """A parameter value as XML-dialect text: strings raw, everything else JSON."""
    return v if isinstance(v, str) else dumps(v)


class Dialect:
    """Base class: subclasses set the attributes and implement render_call, Scanner, call_rules."""
    name = "base"
    # dialect_for asks the dialects in this order, highest first; the default serves anything
    priority = 0
    # literal text the server may see starting a call, used by the `auto` grammar trigger
    call_openers: tuple[str, ...] = ()
    # a call counts only at the start of a line (the `auto` trigger must agree with the scanner)
    call_at_line_start = False
    # what follows the tool list in the system prompt: how to write a call in this dialect
    call_instructions: str = ""
    # what stands between two calls of one assistant turn
    call_separator = "\n"
    # texts that close a call which the grammar says can be completed (grammar.closing_text)
    closers: tuple[str, ...] = ()
    Scanner: type[Scanner] = Scanner

    def serves(self, served_name: str, arch: str, template_adds_bos: bool) -> bool:
        raise NotImplementedError

    def render_call(self, name: str, args: Mapping) -> str:
        raise NotImplementedError

    def call_rules(self, tag: Tag, specs: list[ToolSpec], typed: bool | str) -> CallRules:
        """The Lark rules of one call to any of specs; typed: False (untyped values), True (values
        typed by their schemas, llguidance's %json) or "bounded" (typed, numbers bounded)."""
        raise NotImplementedError

    def scanner(self, known: set[str]) -> Scanner:
        return self.Scanner(known)

    # -- rendering ------------------------------------------------------------------------------
    def render_tools_system(self, tools, existing_system: str | None) -> str:
        lines = "\n".join(dumps(s.openai()) for s in normalize_tools(tools))
        block = (
            "# Tools\n\n"
            "You can call the functions described below. Each line inside <tools></tools> is one "
            "function, given as a JSON schema:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            + self.call_instructions
        )
        if existing_system and "<tool_def_sep>" in existing_system:
            return existing_system.replace("<tool_def_sep>", block, 1)
        if existing_system and existing_system.strip():
            return existing_system.rstrip() + "\n\n" + block
        return block

    def render_assistant_tool_calls(self, tool_calls) -> str:
        return self.call_separator.join(self.render_call(*call_arguments(c)) for c in tool_calls or ())

    def render_tool_result(self, message: Mapping) -> str:
        content = message.get("content", "")
        if not isinstance(content, str):
            content = "" if content is None else dumps(content)
        return f"<tool_response>\n{content}\n</tool_response>"

    def apply(self, messages: list[Mapping], tools) -> list[dict]:
        """Rewrite an OpenAI conversation into plain `{role, content}` messages in this dialect.

        * The tool instructions are merged into the leading system message (one is added if absent).
        * An assistant turn's `tool_calls` are appended to its content in the call syntax (other
          keys, e.g. `reasoning_content`, are kept).
        * Consecutive `tool` messages become one `user` message of `<tool_response>` blocks.
        Messages are copied; the input is not modified. With no tools, only assistant calls and
        tool results are rewritten."""
        specs = normalize_tools(tools)
        out: list[dict] = []
        msgs = [dict(m) for m in messages]
        if specs:
            if msgs and msgs[0].get("role") == "system":
                sys_content = msgs[0].get("content")
                msgs[0]["content"] = self.render_tools_system(specs, sys_content if isinstance(sys_content, str) else None)
            else:
                msgs.insert(0, {"role": "system", "content": self.render_tools_system(specs, None)})
        tool_block = False  # the last message out is a block of tool results
        for m in msgs:
            role = m.get("role") or "user"
            if role == "tool":
                block = self.render_tool_result(m)
                if tool_block:
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block})
                tool_block = True
                continue
            tool_block = False
            if role == "assistant" and m.get("tool_calls"):
                calls_text = self.render_assistant_tool_calls(m.pop("tool_calls"))
                content = m.get("content")
                content = content if isinstance(content, str) else ""
                m["content"] = (content.rstrip() + "\n\n" + calls_text) if content.strip() else calls_text
            m["role"] = role
            out.append(m)
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"
