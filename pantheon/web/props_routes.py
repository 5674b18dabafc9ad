"""llama-server's introspection routes, for its clients and its test suite: GET /props (the model,
its slots and default generation settings, its chat template), GET /slots (each slot's context and
whether it is busy; no prompt or session of anyone's) and POST /apply-template (a chat rendered in
the model's template, tools in its dialect, not run). `?model=` or a body's "model" picks a model
where several are served."""

from __future__ import annotations

import asyncio

from quart import Blueprint, current_app, request

from pantheon.engine.chat import PlanError, render_prompt
from pantheon.web.chat_request import parse_chat_request
from pantheon.web.errors import ApiError, invalid, json_body
from pantheon.web.native_routes import completion_defaults

bp = Blueprint("props", __name__)


def _engine(model=None):
    model = model if isinstance(model, str) else request.args.get("model")
    return current_app.pantheon.resolve(model)


def _file_type(engine) -> str:
    """The file's `general.file_type` as llama.cpp names it (Q4_K_M, Q8_0, ...); without that key,
    as llama.cpp guesses it: the type most of the matrices are stored in."""
    import collections

    import gguf

    try:
        return gguf.LlamaFileType(int(engine.gguf.get("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        counts = collections.Counter(t.ggml_type.name for t in engine.gguf.tensors.values() if len(t.shape) >= 2)
        return counts.most_common(1)[0][0] if counts else ""


def _token(tok, token_id) -> str:
    return tok.token_text(token_id) if token_id is not None else ""


@bp.route("/props", methods=["GET"])
async def props():
    engine = _engine()
    tok = engine.tokenizer
    return {"default_generation_settings": {"params": completion_defaults(engine), "n_ctx": engine.effective_ctx},
            "total_slots": engine.max_concurrent, "model_alias": engine.name, "model_path": str(engine.path),
            "model_ftype": _file_type(engine), "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": current_app.pantheon.config.slots_endpoint, "endpoint_props": False,
            "endpoint_metrics": True,
            "chat_template": engine.template.source if engine.template else "",
            "bos_token": _token(tok, tok.bos_id), "eos_token": _token(tok, tok.eos_id),
            "build_info": f"pantheon {current_app.pantheon.build}"}


@bp.route("/props", methods=["POST"])
async def set_props():
    raise ApiError(501, "not_supported_error", "this server's properties are set at start-up (pantheon serve's "
                                               "flags), not through POST /props")


@bp.route("/slots", methods=["GET"])
async def slots():
    """One entry a decoding slot: its context window and whether a request holds it. With
    `?fail_on_no_slot=1`, 503 when none is free (llama-server's probe for a saturated server)."""
    if not current_app.pantheon.config.slots_endpoint:  # llama-server's answer under --no-slots
        raise ApiError(501, "not_supported_error", "This server does not support slots endpoint. "
                                                   "Start it with `--slots`")
    engine = _engine()
    total, busy = engine.max_concurrent, min(engine.scheduler.load, engine.max_concurrent)
    if request.args.get("fail_on_no_slot") in ("1", "true") and busy >= total:
        raise ApiError(503, "unavailable_error", "no slot available")
    return [{"id": i, "n_ctx": engine.effective_ctx, "speculative": False, "is_processing": i < busy}
            for i in range(total)]


@bp.route("/apply-template", methods=["POST"])
async def apply_template():
    """{"messages", and optionally "tools", "tool_choice", "enable_thinking", "add_generation_prompt"
    (true), "continue_final_message"} -> {"prompt": the text a chat completion would run, the
    assistant's opening included}."""
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    if not isinstance(body.get("messages"), list):
        raise invalid("'messages' must be an array")
    chat = parse_chat_request(body)
    engine = _engine(chat.model)
    try:
        text = (await asyncio.to_thread(render_prompt, engine, chat))[0]
    except PlanError as e:
        raise invalid(str(e)) from None
    except RecursionError:
        raise invalid("request nested too deeply to render (tools or messages)") from None
    return {"prompt": text}
