"""Lark building blocks (llguidance's dialect) shared by the dialects' call grammars and by
response_format: literals and regex escapes, JSON values with bounded numbers (`BoundedJson`),
typed parameter values, and the per-tool rule layout. Pure text: nothing here compiles.

Numbers are bounded everywhere (llguidance's JSON numbers are not: a model could write digits until
max_tokens): schemas with numbers are translated to Lark down to the number leaves (`BoundedJson`),
integers `-?(0|[1-9][0-9]{0,19})`, numbers with at most 20 fraction digits and a 3-digit exponent;
ranges with whole bounds get a regex of their own (`range_regex`, no exponent), other ranges and
multipleOf stay llguidance's (whose fraction digits are unbounded);
strings, enums, booleans and nodes with keywords the translation does not know stay `%json`
(maxLength, enum, pattern... enforced there). Objects translated this way take only their listed
properties, in order; json_object and `{}` values get a generic JSON grammar with bounded numbers.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pantheon.text.tools.arguments import schema_types
from pantheon.text.tools.spec import ToolSpec

# JSON values inside calls: compact, json.dumps-like separators, no free whitespace (a model trained
# on json.dumps output writes exactly this, and random sampling cannot pad with whitespace forever)
X_GUIDANCE_ARGS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                    "lenient": True}
# response_format: whitespace allowed (models pretty-print) but bounded per gap
X_GUIDANCE_RF = {"whitespace_pattern": r"[ \t\n\r]{0,16}", "lenient": True}

# whitespace between calls, and after the last one
GAP = r"/[ \t\r\n]{1,8}/"


def _max_length(sch) -> int | None:
    """A string schema's maxLength: the grammar bounds the value, so a model that never closes a
    string on its own is still moved on to the next parameter."""
    n = sch.get("maxLength") if isinstance(sch, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def lit(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


_RX_META = set("\\.^$|?*+()[]{}/-#&~")


def rx(s: str) -> str:
    """Escape text for use inside a Lark /regex/."""
    out = []
    for c in s:
        if c in _RX_META:
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        else:
            out.append(c)
    return "".join(out)


# -- bounded numbers -----------------------------------------------------------------------------
# llguidance's JSON schema numbers are unbounded (`[1-9][0-9]*`): a model that keeps writing digits
# is never stopped. Schemas with numbers are therefore compiled to Lark here down to the number
# leaves, which get bounded regexes; every other leaf (strings, enums, booleans...) and any node
# using keywords this translation does not know stays `%json` (llguidance enforces maxLength,
# enum, pattern, ... there).
INT_DIGITS, FRAC_DIGITS, EXP_DIGITS = 20, 20, 3
_RX_INT = f"-?(0|[1-9][0-9]{{0,{INT_DIGITS - 1}}})"
_RX_NUM = f"{_RX_INT}(\\.[0-9]{{1,{FRAC_DIGITS}}})?([eE][+-]?[0-9]{{1,{EXP_DIGITS}}})?"
_RX_RANGED = f"/{_RX_INT}(\\.[0-9]{{1,{FRAC_DIGITS}}})?/"   # a range's lexeme: no exponent
_NOTE_KEYS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
              "writeOnly", "$schema", "$id", "x-guidance", "$defs", "definitions", "format"}


def digit_range(lo: int, hi: int) -> str:
    """A regex for the decimal integers lo..hi (0 <= lo <= hi), written without leading zeros."""
    parts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):   # one alternative per digit count
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        parts.append(_same_length_range(str(a), str(b)))
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def _same_length_range(a: str, b: str) -> str:
    if a == b:
        return a
    n = len(a)
    if n == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _same_length_range(a[1:], b[1:])
    if a[1:] == "0" * (n - 1) and b[1:] == "9" * (n - 1):
        return f"[{a[0]}-{b[0]}]" + _digits(n - 1)
    parts = [a[0] + _same_length_range(a[1:], "9" * (n - 1))]
    if int(b[0]) - int(a[0]) > 1:
        parts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + _digits(n - 1))
    parts.append(b[0] + _same_length_range("0" * (n - 1), b[1:]))
    return "(" + "|".join(parts) + ")"


def _digits(n: int) -> str:
    return "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def range_regex(bounds: dict, fraction: bool) -> str | None:
    """A bounded Lark lexeme (two regexes intersected) for the integers (or numbers, when
    `fraction`) within JSON-schema bounds whose values are whole; None when the range is empty. At
    most INT_DIGITS integer digits and FRAC_DIGITS fraction digits, no exponent.

    A number I.F with F not all zeros lies strictly between I and I+1, so with whole bounds it is
    in range exactly when [I, I+1] is; the negative side is the positive one mirrored."""
    cap = 10 ** INT_DIGITS - 1
    lo, hi = -cap, cap
    if "minimum" in bounds:
        lo = max(lo, math.ceil(bounds["minimum"]))
    if "exclusiveMinimum" in bounds:
        lo = max(lo, math.floor(bounds["exclusiveMinimum"]) + 1)
    if "maximum" in bounds:
        hi = min(hi, math.floor(bounds["maximum"]))
    if "exclusiveMaximum" in bounds:
        hi = min(hi, math.ceil(bounds["exclusiveMaximum"]) - 1)
    # bounds on the fractional values: whole bounds, so exclusive ones are one step in
    flo = int(max([bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds], default=-cap - 1))
    fhi = int(min([bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds], default=cap + 1))
    flo, fhi = max(flo, -cap - 1), min(fhi, cap + 1)
    # digit counts are bounded by the intersection with _RX_RANGED
    frac_any, frac_zero = "\\.[0-9]*[1-9][0-9]*", "(\\.0+)?" if fraction else ""
    alts = []

    def side(a: int, b: int, sign: str) -> None:   # whole magnitudes a..b (numbers: optional ".000")
        if a <= b:
            alts.append(sign + digit_range(a, b) + frac_zero)

    def side_frac(a: int, b: int, sign: str) -> None:   # I.F, F nonzero, for I in a..b
        if fraction and a <= b:
            alts.append(sign + digit_range(a, b) + frac_any)

    if hi >= 0:
        side(max(lo, 0), hi, "")
    if lo < 0:
        side(max(-hi, 1), -lo, "-")
    if fraction:   # I.F in (I, I+1): needs flo <= I and I + 1 <= fhi (positive side)
        side_frac(max(flo, 0), fhi - 1, "")
        side_frac(max(-fhi, 0), -flo - 1, "-")   # -(I.F) in (-(I+1), -I)
    if not alts:
        return None
    return "/" + (alts[0] if len(alts) == 1 else "(" + "|".join(alts) + ")") + "/ & " + _RX_RANGED


class BoundedJson:
    """A JSON schema as Lark rules with bounded integer/number lexemes (see above).

    sep: (item, key) separators, or None for response_format (whitespace around punctuation,
    at most `ws` per gap). Rules are appended to `rules`; expr(schema) gives the expression."""

    def __init__(self, root: dict, rules: list[str], xg: dict, prefix: str, compact: bool):
        self.root, self.rules, self.xg, self.p, self.compact = root, rules, xg, prefix, compact
        self.n = 0
        self.refs: dict[str, str] = {}
        self.delegated: dict[str, str] = {}
        if compact:
            self.item, self.key = lit(xg.get("item_separator", ", ")), lit(xg.get("key_separator", ": "))
            self.ws = ""
        else:
            self.ws = f"{prefix.upper()}WS?"
            rules.append(f"{prefix.upper()}WS: /[ \\t\\n\\r]{{1,16}}/")
            self.item, self.key = f'{self.ws} "," {self.ws}', f'{self.ws} ":" {self.ws}'
        rules.append(f"{prefix.upper()}INT: /{_RX_INT}/")
        rules.append(f"{prefix.upper()}NUM: /{_RX_NUM}/")

    def _name(self) -> str:
        self.n += 1
        return f"{self.p}r{self.n}"

    def _resolve(self, ref: str) -> Any:
        for k in ("#/$defs/", "#/definitions/"):
            if ref.startswith(k):
                d = self.root.get(k[2:-1])
                if isinstance(d, dict) and ref[len(k):] in d:
                    return d[ref[len(k):]]
        return None

    def _has_numbers(self, sch: Any, seen: set | None = None) -> bool:
        seen = set() if seen is None else seen
        if isinstance(sch, dict):
            ref = sch.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                seen.add(ref)
                if self._has_numbers(self._resolve(ref), seen):
                    return True
            t = sch.get("type")
            if t in ("integer", "number") or (isinstance(t, list) and ("integer" in t or "number" in t)):
                return True
            return any(self._has_numbers(v, seen) for k, v in sch.items()
                       if k not in ("enum", "const", "$defs", "definitions"))
        if isinstance(sch, list):
            return any(self._has_numbers(v, seen) for v in sch)
        return False

    def delegate(self, sch: Any) -> str:
        s = copy.deepcopy(sch) if isinstance(sch, dict) else ({} if sch is True else {"not": {}})
        for k in ("$defs", "definitions"):
            if k in self.root and k not in s:
                s[k] = copy.deepcopy(self.root[k])
        s["x-guidance"] = dict(self.xg)
        text = f"%json{json.dumps(s, ensure_ascii=False)}"
        if text not in self.delegated:   # one rule per distinct schema
            name = self._name()
            self.rules.append(f"{name}: {text}")
            self.delegated[text] = name
        return self.delegated[text]

    def _any(self, kind: str = "val") -> str:
        """Any JSON value (kind "val"), object ("obj") or array ("arr"), numbers bounded."""
        p = self.p
        if f"{p}any_val" not in self.refs:
            self.refs[f"{p}any_val"] = "ok"
            s = self.delegate({"type": "string"})
            self.rules += [
                f'{p}any_val: {p}any_obj | {p}any_arr | {s} | {p.upper()}NUM | "true" | "false" | "null"',
                f'{p}any_obj: "{{" {self.ws} ({s} {self.key} {p}any_val ({self.item} {s} {self.key} {p}any_val)*)? '
                f'{self.ws} "}}"',
                f'{p}any_arr: "[" {self.ws} ({p}any_val ({self.item} {p}any_val)*)? {self.ws} "]"']
        return f"{p}any_{kind}"

    def expr(self, sch: Any) -> str:
        keys = set(sch) - _NOTE_KEYS if isinstance(sch, dict) else set()
        if sch is True or isinstance(sch, dict) and not keys:
            return self._any()
        if isinstance(sch, dict) and sch.get("type") in ("object", "array") and \
                (keys == {"type"} or keys == {"type", "additionalProperties"} and sch["additionalProperties"] is True):
            return self._any(sch["type"][:3])
        if not isinstance(sch, dict) or not self._has_numbers(sch):
            return self.delegate(sch)
        if "$ref" in sch:
            ref = sch["$ref"]
            target = self._resolve(ref) if isinstance(ref, str) else None
            if keys != {"$ref"} or target is None:
                return self.delegate(sch)
            if ref not in self.refs:
                self.refs[ref] = name = self._name()
                self.rules.append(f"{name}: {self.expr(target)}")
            return self.refs[ref]
        for k in ("anyOf", "oneOf"):
            if k in sch:
                if keys != {k} or not isinstance(sch[k], list) or not sch[k]:
                    return self.delegate(sch)
                return "(" + " | ".join(self.expr(s) for s in sch[k]) + ")"
        t = sch.get("type")
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                return self.delegate(sch)
            return "(" + " | ".join(self.expr({**sch, "type": x}) for x in t) + ")"
        if t == "integer":
            return self._integer(sch, keys)
        if t == "number":
            if keys == {"type"}:
                return f"{self.p.upper()}NUM"
            return self._ranged(sch, keys, fraction=True)
        if t == "array" and keys <= {"type", "items", "minItems", "maxItems"} and isinstance(sch.get("items"), dict):
            return self._array(sch)
        if t == "object" and keys <= {"type", "properties", "required", "additionalProperties"} \
                and isinstance(sch.get("properties"), dict) and sch["properties"] \
                and sch.get("additionalProperties", False) in (False, True):
            return self._object(sch)
        return self.delegate(sch)

    def _integer(self, sch: dict, keys: set) -> str:
        if keys == {"type"}:
            return f"{self.p.upper()}INT"
        return self._ranged(sch, keys, fraction=False)

    def _ranged(self, sch: dict, keys: set, fraction: bool) -> str:
        """An integer or number with integer-valued bounds, as a bounded lexeme of its own; other
        keywords (multipleOf) or fractional bounds stay llguidance's (fraction digits unbounded)."""
        if not keys <= {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
            return self.delegate(sch)
        bounds = {k: sch[k] for k in keys - {"type"}}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   for v in bounds.values()):
            return self.delegate(sch)
        if fraction and not all(float(v).is_integer() for v in bounds.values()):
            return self.delegate(sch)
        rx = range_regex(bounds, fraction)
        if rx is None:   # an empty range: llguidance says so when the grammar compiles
            return self.delegate(sch)
        name = self._name().upper()   # a terminal: upper case
        self.rules.append(f"{name}: {rx}")
        return name

    def _array(self, sch: dict) -> str:
        item = self.expr(sch["items"])
        lo = sch.get("minItems", 0)
        hi = sch.get("maxItems")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0 else 0
        hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo else None
        if hi == 0:
            body = ""
        else:
            rest_lo = max(lo - 1, 0)
            rest = f"({self.item} {item})" + (f"{{{rest_lo},{hi - 1}}}" if hi is not None else
                                                 (f"{{{rest_lo},}}" if rest_lo else "*"))
            body = f"{item} {rest}"
            if lo == 0:
                body = f"({body})?"
        name = self._name()
        self.rules.append(f'{name}: "[" {self.ws} {body} {self.ws} "]"')
        return name

    def _object(self, sch: dict) -> str:
        props = sch["properties"]
        req = set(sch.get("required") or [])
        names = list(props)
        if not req <= set(names):
            return self.delegate(sch)
        members = [f"{lit(json.dumps(k, ensure_ascii=False))} {self.key} {self.expr(props[k])}" for k in names]
        # tail i: the members from i on, each after a separator (optional ones may be left out)
        tails = [""] * (len(names) + 1)
        for i in range(len(names) - 1, -1, -1):
            tname = self._name()
            opt = "" if names[i] in req else "?"
            self.rules.append(f"{tname}: ({self.item} {members[i]}){opt} {tails[i + 1]}")
            tails[i] = tname
        alts = []
        for f in range(len(names)):   # the first member given
            alts.append(f"{members[f]} {tails[f + 1]}".strip())
            if names[f] in req:
                break
        body = "(" + " | ".join(alts) + ")"
        if not req:
            body += "?"
        name = self._name()
        self.rules.append(f'{name}: "{{" {self.ws} {body} {self.ws} "}}"')
        return name



@dataclass(frozen=True)
class CallRules:
    """A dialect's call grammar, as the tool grammar assembles it: `rules` (Lark), `call` (one
    whole call: required/named modes), and for `auto` mode `opener` (the call opener, the lazy
    trigger), `after_open` (a call after its opener), `between` (what closes a call before the next
    one's opener) and `tail` (what may close the last call)."""
    rules: list
    opener: str
    after_open: str
    call: str
    between: str
    tail: str


# a tag as grammar: its special token if the vocabulary has one, else the literal text
Tag = Callable[[str], str]


def args_schema(spec: ToolSpec, sub: Any) -> dict:
    """A parameter's schema made standalone for %json: root $defs copied in, our options set."""
    s = copy.deepcopy(sub) if isinstance(sub, dict) else {}
    root = spec.parameters if isinstance(spec.parameters, dict) else {}
    for k in ("$defs", "definitions"):
        if k in root and k not in s:
            s[k] = copy.deepcopy(root[k])
    s["x-guidance"] = dict(X_GUIDANCE_ARGS)
    return s


def json_value(rules: list[str], sch: dict, typed) -> str:
    """A JSON value typed by sch (made standalone by args_schema): `%json`, or with typed ==
    "bounded" (bounded numbers) an expression over rules appended to `rules`."""
    if typed != "bounded":
        return f"%json{json.dumps(sch, ensure_ascii=False)}"
    xg = sch.get("x-guidance") if isinstance(sch.get("x-guidance"), dict) else dict(X_GUIDANCE_ARGS)
    return BoundedJson(sch, rules, xg, f"v{len(rules)}_", compact=True).expr(sch)


def _string_enum(sch: Any, root: dict) -> list[str] | None:
    if not isinstance(sch, dict):
        return None
    if "const" in sch and isinstance(sch["const"], str):
        return [sch["const"]]
    if isinstance(sch.get("enum"), list) and sch["enum"] and all(isinstance(v, str) for v in sch["enum"]):
        return list(sch["enum"])
    return None


def value_kind(spec: ToolSpec, sch: Any) -> tuple[str, Any]:
    """("enum", values) | ("text", None) | ("json", schema)."""
    root = spec.parameters if isinstance(spec.parameters, dict) else {}
    types = schema_types(sch, root)
    enum = _string_enum(sch, root)
    if enum is not None:
        return "enum", enum
    if types is None or "string" in types:
        return "text", None
    return "json", args_schema(spec, sch)


def function_rules(rules: list[str], specs: list[ToolSpec], name: str, fn_head, param_rule) -> None:
    """Append to `rules`, per tool i, its parameter rules `p_{i}_{j}` and `{name}_{i}: fn_head(spec)
    params` (optional parameters marked `?`), then `{name}`, the choice among the tools.
    param_rule(spec, key, schema) -> a parameter's rule body; it may append rules of its own to
    `rules` first."""
    alts = []
    for i, spec in enumerate(specs):
        prules, parts = [], []
        req = set(spec.required)
        props = spec.properties
        # required parameters the schema does not list under properties still have to be given
        names = list(props) + [r for r in spec.required if r not in props]
        for j, key in enumerate(names):
            rname = f"p_{i}_{j}"
            prules.append(f"{rname}: {param_rule(spec, key, props.get(key))}")
            parts.append(rname if key in req else f"{rname}?")
        rules += prules
        rules.append(f"{name}_{i}: {fn_head(spec)} {' '.join(parts)}")
        alts.append(f"{name}_{i}")
    rules.append(f"{name}: {' | '.join(alts)}")


def string_value(rules: list[str], sch: Any, bounded) -> str:
    """The rule a string value matches: "sval", or under a maxLength n the rule named by
    bounded(n) -> (name, rule text), appended to `rules` the first time."""
    n = _max_length(sch)
    if n is None:
        return "sval"
    name, rule = bounded(n)
    if rule not in rules:
        rules.append(rule)
    return name


def rename_rule(lark: str, old: str, new: str) -> str:
    """`old` renamed `new` wherever it is a name in Lark text: not inside "strings" or /regexes/
    or after a % directive."""
    out, i, n = [], 0, len(lark)
    while i < n:
        c = lark[i]
        if c in "\"/" or (c == "%" and (i == 0 or lark[i - 1] == "\n")):
            end = "\n" if c == "%" else c
            j = i + 1
            while j < n and lark[j] != end:
                j += 2 if lark[j] == "\\" and c != "%" else 1
            out.append(lark[i:j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (lark[j].isalnum() or lark[j] == "_"):
                j += 1
            word = lark[i:j]
            out.append(new if word == old else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
