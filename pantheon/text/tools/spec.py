"""What a request offers: tool specs from the OpenAI `tools` list, and assistant calls read back."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

JSON_SEPARATORS = (", ", ": ")


def dumps(x: Any) -> str:
    """JSON as calls are written everywhere (prompts, wire arguments): compact, json.dumps-like."""
    return json.dumps(x, ensure_ascii=False, separators=JSON_SEPARATORS)


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


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (for messages: "null", not "NoneType")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, Mapping) else "a value"


def normalize_tools(tools: Iterable[Any] | None) -> list[ToolSpec]:
    """OpenAI `tools` (`{"type": "function", "function": {...}}`, or the bare function object) ->
    ToolSpecs. Entries of another type are skipped; a function without a name raises."""
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or ()):
        if isinstance(t, ToolSpec):
            spec = t
        else:
            if not isinstance(t, Mapping):
                raise ToolSpecError(f"'tools[{i}]' must be an object such as "
                                    '{"type": "function", "function": {"name": ...}}, got ' + json_kind(t))
            if t.get("type", "function") != "function":
                continue
            fn = t.get("function", t)
            if not isinstance(fn, Mapping):
                raise ToolSpecError(f"'tools[{i}].function' must be an object, got {json_kind(fn)}")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ToolSpecError(f"'tools[{i}].function.name' must be a non-empty string")
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
