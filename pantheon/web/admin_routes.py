"""Operator routes: /admin/models, /admin/models/load, /admin/models/unload, /admin/dies."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from quart import Blueprint, current_app

from pantheon.config import KV_DTYPE_CHOICES, MAX_MODEL_DIES, ModelConfig
from pantheon.engine.dies import die_budget, visible_dies
from pantheon.web.errors import ApiError, invalid, json_body
from pantheon.web.rows import operator_row

bp = Blueprint("admin", __name__)
INT32_MAX = 2**31 - 1


@bp.route("/admin/models", methods=["GET"])
async def admin_models():
    return {"object": "list", "data": [operator_row(e) for e in current_app.pantheon.pool.ready()]}


def _opt_int(body: dict, key: str) -> int:
    value = body.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{key}' must be an integer")
    if value > INT32_MAX:
        raise invalid(f"'{key}' must be at most {INT32_MAX}")
    return value


def confined_path(path: str, models_dir: str | None) -> str:
    """With PANTHEON_MODELS_DIR set, the file to load must resolve (symlinks followed) under it; a
    relative path is taken relative to it. Otherwise -> 403 load_failed. Unset: `path` as given."""
    if not models_dir:
        return path
    try:
        base = Path(models_dir).resolve()
        resolved = (base / path).resolve()
    except (OSError, ValueError, RuntimeError):  # NUL bytes, symlink loops
        raise ApiError(403, "load_failed", "path is not under the models directory (PANTHEON_MODELS_DIR)") from None
    if not resolved.is_relative_to(base):
        raise ApiError(403, "load_failed", "path is not under the models directory (PANTHEON_MODELS_DIR)")
    return str(resolved)


def load_config(body) -> ModelConfig:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise invalid("'path' is required")
    opened = confined_path(path, current_app.pantheon.config.models_dir)
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise invalid("'name' must be a non-empty string")
    dies = body.get("dies")
    if dies is not None:
        if not isinstance(dies, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dies):
            raise invalid("'dies' must be an array of device ordinals")
        if len(dies) > MAX_MODEL_DIES:
            raise invalid(f"too many dies ({len(dies)}; at most {MAX_MODEL_DIES})")
    # Every per-model option the serve was started with is inherited (numerics and KV type
    # included); the body overrides what it names.
    defaults = current_app.pantheon.config.model_config(path, name)
    numerics, kv_dtype = body.get("numerics", defaults.numerics), body.get("kv_dtype", defaults.kv_dtype)
    if numerics not in ("exact", "llamacpp"):
        raise invalid("'numerics' must be \"exact\" or \"llamacpp\"")
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise invalid(f"'kv_dtype' must be one of {', '.join(KV_DTYPE_CHOICES)}")
    template = body.get("chat_template", defaults.chat_template)
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise invalid("'chat_template' must be a builtin template's name (chatml, llama3, ...) or Jinja text")
    ctx_cap, max_sessions = _opt_int(body, "ctx_cap"), _opt_int(body, "max_sessions")
    max_concurrent, budget = _opt_int(body, "max_concurrent"), _opt_int(body, "reasoning_budget")
    return replace(defaults, path=opened, ctx_cap=ctx_cap if ctx_cap > 0 else defaults.ctx_cap,
                   max_sessions=max_sessions if max_sessions > 0 else defaults.max_sessions,
                   max_concurrent=max_concurrent if max_concurrent > 0 else defaults.max_concurrent,
                   reasoning_budget=budget if budget > 0 else defaults.reasoning_budget,
                   dies=tuple(dies) if dies else defaults.dies, quantize=bool(body.get("quantize", False)),
                   numerics=numerics, kv_dtype=kv_dtype, chat_template=template)


@bp.route("/admin/models/load", methods=["POST"])
async def admin_load():
    state = current_app.pantheon
    state.refuse_if_shutting_down()
    config = load_config(await json_body())
    if config.quantize:
        raise ApiError(400, "invalid_request_error", "'quantize' (INT8 at load) is not supported by this serve")
    entry = await asyncio.to_thread(state.pool.load, config)
    return operator_row(entry)


@bp.route("/admin/models/unload", methods=["POST"])
async def admin_unload():
    body = await json_body()
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise invalid("'name' is required")
    await asyncio.to_thread(current_app.pantheon.pool.unload, name)
    return {"unloaded": name}


@bp.route("/admin/drain", methods=["POST"])
async def admin_drain():
    """Take this instance out of service without losing a session: new chat requests get 503
    server_shutting_down (a router retries them elsewhere), the turns in flight finish, and with
    --router the idle sessions move to another replica (export -> restore) before it deregisters.
    The process keeps running (stop it afterwards)."""
    from pantheon.web.serve import drain

    state = current_app.pantheon
    await drain(state)
    result = getattr(state, "drained", None) or {}
    return {"drained": True, "router": state.config.router, "moved": result.get("moved", []),
            "failed": result.get("failed", [])}


@bp.route("/admin/dies", methods=["GET"])
async def admin_dies():
    dies = visible_dies()
    usage = [(e, e.engine.bytes_per_device()) for e in current_app.pantheon.pool.ready()]
    data = []
    for d in dies:
        here = [(e, per) for e, per in usage if per.get(d.device_id)]
        data.append({"die": d.index, "card": d.card, "model": here[0][0].config.name if here else "",
                     "n_models": len(here), "vram_budget": die_budget(d),
                     "vram_used": sum(per[d.device_id] for _, per in here)})
    return {"object": "list", "n_dies": len(dies), "data": data}
