"""The tool-call dialects: every module here defines `DIALECT`, a `Dialect` (see ../dialect.py).

Adding a dialect is adding a module here; nothing else lists them."""

from __future__ import annotations

import importlib
import pkgutil

from pantheon.text.tools.dialect import Dialect


def _discover() -> dict[str, Dialect]:
    found: dict[str, Dialect] = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        d = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "DIALECT", None)
        if isinstance(d, Dialect):
            if d.name in found:
                raise RuntimeError(f"two dialects are named {d.name!r}")
            found[d.name] = d
    return found


DIALECTS: dict[str, Dialect] = _discover()


def dialect_for(served_name: str, arch: str, template_adds_bos: bool) -> Dialect:
    """The dialect a served model emits (never read from the GGUF chat template): the first, by
    priority, that serves it (JSON for served names starting with "ornith", MiniCPM attribute XML
    for llama-arch models whose chat template adds BOS, Qwen3-Coder XML otherwise)."""
    for d in sorted(DIALECTS.values(), key=lambda d: -d.priority):
        if d.serves(served_name, arch, template_adds_bos):
            return d
    raise LookupError(f"no tool dialect serves {served_name!r} ({arch})")


def get_dialect(d: Dialect | str) -> Dialect:
    if isinstance(d, Dialect):
        return d
    try:
        return DIALECTS[d]
    except KeyError:
        raise ValueError(f"unknown tool dialect {d!r} (known: {', '.join(DIALECTS)})") from None


def apply_dialect(dialect: Dialect | str, messages, tools) -> list[dict]:
    """`Dialect.apply`: an OpenAI conversation as plain `{role, content}` messages in `dialect`."""
    return get_dialect(dialect).apply(messages, tools)
