"""Tool-call arguments: typed from the tool's JSON schema, then validated by `jsonschema`.

Typing turns what a model wrote into the JSON value its schema asks for (`coerce_text` for an XML
dialect's raw text, `coerce_value` for a JSON dialect's value): the schema's `type` (a list is
tried in order; `enum`/`const`/`anyOf`/`oneOf`/local `$ref` are followed) decides: integer ("3",
"3.0"), number, boolean ("true"/"false", any case), null ("null"/"None"), array/object (JSON,
then a Python literal as fallback), string (raw text). "null" is read as null whenever null is
allowed. Without a schema, a value that is a JSON object or array is parsed, anything else stays a
string. Whether the typed value is valid is then jsonschema's verdict (enum, ranges, lengths,
nested objects, required, additionalProperties: the whole schema), never a hand-written check.

`ArgumentChecker(spec)` applies both to one call, argument by argument (streaming) and whole.
`schema_problem` checks a schema itself against its draft's meta-schema (requests are refused
before any decoding when a tool's or response_format's schema is not a schema).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError, best_match

from pantheon.text.tools.spec import ToolSpec, dumps

_DEFAULT_DRAFT = jsonschema.Draft202012Validator


def _validator(root: Any) -> jsonschema.protocols.Validator | None:
    """A validator rooted at `root` (refs resolve against it), or None for a non-schema."""
    if not isinstance(root, (dict, bool)):
        return None
    try:
        return jsonschema.validators.validator_for(root, default=_DEFAULT_DRAFT)(root)
    except Exception:  # an unknown $schema URI, ...: no validation rather than a crash
        return None


def _where(path, head: str = "") -> str:
    """A JSON path as text: head.key[3].key"""
    out = head
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _first_error(validator, schema: Any, value: Any) -> ValidationError | None:
    """The most relevant error of `value` against `schema` (a part of validator's root), or None.
    A schema jsonschema cannot evaluate (an unresolvable $ref, an unknown type) validates nothing."""
    try:
        v = validator if schema is validator.schema else validator.evolve(schema=schema)
        return best_match(v.iter_errors(value))
    except ValidationError as e:
        return e
    except Exception:
        return None


def schema_problem(schema: Any, where: str) -> str | None:
    """What makes `schema` not a JSON schema (checked against its draft's meta-schema, 2020-12
    unless it names another in `$schema`), or None."""
    if not isinstance(schema, (dict, bool)):
        return f"'{where}' must be a schema object"
    try:
        cls = jsonschema.validators.validator_for(schema, default=_DEFAULT_DRAFT)
    except Exception as e:
        return f"'{where}': {e}"
    try:
        err = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except RecursionError:
        return f"'{where}' is nested too deeply"
    if err is None:
        return None
    return f"'{_where(err.absolute_path, where)}': {err.message}"


# ---- typing -------------------------------------------------------------------------------------

class _CoerceError(ValueError):
    pass


_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")


def _json_type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _resolve_ref(schema: dict, root: dict | None) -> dict | None:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#") or root is None:
        return None
    node: Any = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def schema_types(schema: Any, root: dict | None = None, _depth: int = 0) -> list[str] | None:
    """The JSON types a schema allows, in the order to try them; None = anything."""
    if not isinstance(schema, dict) or _depth > 16:
        return None
    if "$ref" in schema:
        target = _resolve_ref(schema, root)
        return schema_types(target, root, _depth + 1) if target is not None else None
    t = schema.get("type")
    if isinstance(t, str) and t in _JSON_TYPES:
        return [t]
    if isinstance(t, list):
        ts = [x for x in t if x in _JSON_TYPES]
        return ts or None
    if "const" in schema:
        return [_json_type_of(schema["const"])]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        out: list[str] = []
        for v in schema["enum"]:
            jt = _json_type_of(v)
            if jt not in out:
                out.append(jt)
        return out
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out = []
            for sub in schema[key]:
                ts = schema_types(sub, root, _depth + 1)
                if ts is None:
                    return None
                out += [x for x in ts if x not in out]
            return out or None
    if isinstance(schema.get("allOf"), list):
        for sub in schema["allOf"]:
            ts = schema_types(sub, root, _depth + 1)
            if ts is not None:
                return ts
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return None


_INT_RE = re.compile(r"[-+]?\d+")


def _as_type(raw: str, t: str) -> Any:
    """Convert stripped text to JSON type t, or raise _CoerceError."""
    s = raw.strip()
    if t == "string":
        return raw
    if t == "null":
        if s in ("null", "None"):
            return None
        raise _CoerceError("not null")
    if t == "boolean":
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
        raise _CoerceError("not a boolean")
    if t in ("integer", "number"):
        if _INT_RE.fullmatch(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            raise _CoerceError(f"not a {t}") from None
        if not math.isfinite(f) or (t == "integer" and not f.is_integer()):
            raise _CoerceError(f"not a {t}")
        return int(f) if t == "integer" else f
    if t in ("array", "object"):
        want = list if t == "array" else dict
        try:
            v = json.loads(s)
        except (json.JSONDecodeError, RecursionError):
            try:  # Python literal (single quotes, True/False/None): some models write those
                v = ast.literal_eval(s)
                json.dumps(v)
            except Exception:
                raise _CoerceError(f"not a JSON {t}") from None
        if isinstance(v, tuple) and want is list:
            v = list(v)
        if not isinstance(v, want):
            raise _CoerceError(f"not a JSON {t}")
        return v
    raise _CoerceError(f"unknown type {t}")


def _typed_text(raw: str, types: list[str] | None) -> Any:
    """An XML value as the first of `types` it converts to (the raw text when none does)."""
    if types is None:
        s = raw.strip()
        if s[:1] in ("{", "["):
            try:
                v = json.loads(s)
                if isinstance(v, (dict, list)):
                    return v
            except (json.JSONDecodeError, RecursionError):
                pass
        return raw
    if "null" in types and raw.strip() in ("null", "None"):
        return None
    for t in types:
        try:
            return _as_type(raw, t)
        except _CoerceError:
            pass
    return raw


def _typed_value(v: Any, types: list[str] | None) -> Any:
    """A JSON value converted to one of `types` where it is not already one (a string holding a
    number or JSON; a number or boolean for a string parameter); unchanged when nothing fits."""
    if types is None:
        return v
    jt = _json_type_of(v)
    if jt in types or (jt == "integer" and "number" in types):
        return v
    if jt == "number" and "integer" in types and math.isfinite(v) and float(v).is_integer():
        return int(v)
    if isinstance(v, str):
        if "null" in types and v.strip() in ("null", "None"):
            return None
        for t in types:
            if t != "string":
                try:
                    return _as_type(v, t)
                except _CoerceError:
                    pass
    elif "string" in types and jt in ("integer", "number", "boolean"):
        return dumps(v)
    return v


def _short(s: str, n: int = 40) -> str:
    s = repr(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def _checked(value: Any, schema: Any, root: dict | None) -> Any:
    err = _first_error(_validator(root if root is not None else schema), schema, value) \
        if isinstance(schema, (dict, bool)) else None
    if err is not None:
        where = _where(err.absolute_path)
        raise ValueError(f"{err.message}{' at ' + where if where else ''} (got {_short(dumps(value))})")
    return value


def coerce_text(raw: str, schema: Any, root: dict | None = None) -> Any:
    """Type an XML parameter value (raw text) from its schema and validate it; raises ValueError."""
    return _checked(_typed_text(raw, schema_types(schema, root)), schema, root)


def coerce_value(v: Any, schema: Any, root: dict | None = None) -> Any:
    """Type a JSON argument value from its schema (kept when already valid) and validate it;
    raises ValueError."""
    return _checked(_typed_value(v, schema_types(schema, root)), schema, root)


# ---- one call's arguments -----------------------------------------------------------------------

@dataclass
class ArgumentError(Exception):
    """A call's arguments are not what its schema asks for; `code` is the contract's."""
    code: str          # invalid_argument | missing_argument | unknown_argument
    message: str
    parameter: str | None = None


class ArgumentChecker:
    """Types and validates the arguments of calls to one tool. `typed(key, value, is_text)` takes
    one argument (as soon as its value is complete, when streaming); `check(args)` the whole
    object once the call ends (required parameters, and what spans arguments)."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        root = spec.parameters if isinstance(spec.parameters, dict) else {}
        self.root = root
        self.validator = _validator(root)
        addl = root.get("additionalProperties")
        self.extra_schema = addl if isinstance(addl, (dict, bool)) else None

    def string_only(self, key: str) -> bool:
        """The parameter's schema allows a string and nothing else (its typed value is the text)."""
        sch = self.spec.properties.get(key, self.extra_schema if self.spec.additional_allowed else None)
        return schema_types(sch, self.root) == ["string"]

    def typed(self, key: str, value: Any, is_text: bool) -> Any:
        props = self.spec.properties
        if key in props:
            sch = props[key]
        elif not self.spec.additional_allowed:
            raise ArgumentError("unknown_argument", f"{self.spec.name} has no parameter {key!r}", key)
        else:
            sch = self.extra_schema
        types = schema_types(sch, self.root)
        v = _typed_text(value, types) if is_text else _typed_value(value, types)
        if self.validator is not None and isinstance(sch, (dict, bool)):
            err = _first_error(self.validator, sch, v)
            if err is not None:
                raise ArgumentError("invalid_argument", f"{self.spec.name}.{_where(err.absolute_path, key)}: "
                                    f"{err.message}", key)
        return v

    def check(self, args: dict) -> None:
        missing = [r for r in self.spec.required if r not in args]
        if missing:
            raise ArgumentError("missing_argument",
                                f"{self.spec.name}: missing required parameter(s) {', '.join(missing)}", missing[0])
        if self.validator is None:
            return
        err = _first_error(self.validator, self.root, args)
        if err is None:
            return
        path = list(err.absolute_path)
        key = path[0] if path and isinstance(path[0], str) else None
        code = "unknown_argument" if err.validator in ("additionalProperties", "unevaluatedProperties") \
            else "invalid_argument"
        raise ArgumentError(code, f"{_where(path, self.spec.name)}: {err.message}", key)
