"""POST /completion: llama-server's own (non-OpenAI) completion API, for its clients and its test
suite, on the same request model: the prompt raw (text, token ids, text and ids mixed, or several
prompts: a JSON list of results), `n_predict`, sampling, `n_probs` (`completion_probabilities`),
`return_tokens`, `response_fields`; the response as llama-server shapes it (`content`, `tokens`,
`stop_type`, `timings`, `generation_settings`, ...). Streamed: one `data:` object per token and a
final one with `stop: true`, no `[DONE]` (as llama-server)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

from quart import Blueprint, Response, current_app

from pantheon.engine.chat import infill_ids, missing_fim_tokens, mixed_prompt_ids, plan_chat
from pantheon.engine.events import ChoiceEnd, Delta, PromptProgress, RequestEnd, RequestError
from pantheon.web import sse
from pantheon.web.chat_request import (MAX_TOKENS_CAP, ChatRequest, is_token_id, llama_prompts, operator_defaults,
                                       sampling_fields)
from pantheon.web.errors import ApiError, invalid, json_body, status_of
from pantheon.web.generation import collect_one, delta_timings, plan_and_submit, progress_fields, timings

bp = Blueprint("native", __name__)

MAX_PROMPTS = 16
MAX_EXTRA_CHUNKS = 256  # /infill's input_extra files
LLAMA_BATCH = 2048  # llama-server's default batch, which its infill prompt is fitted to
MIN_P_DEFAULT = 0.05  # llama-server's default min-p on its own routes


def _logit_bias(value, engine) -> dict:
    """[[id or text, bias or false], ...] or {id or text: bias}; false bans (-100)."""
    pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else []
    out = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            continue
        key, bias = pair
        bias = -100.0 if bias is False else bias
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            continue
        if isinstance(key, str) and not key.strip().lstrip("-").isdigit():
            ids = engine.tokenizer.encode(key, parse_special=False, add_bos=False)
        else:
            try:
                ids = [int(key)]
            except (TypeError, ValueError):
                continue
        for i in ids:
            out[str(i)] = bias
    return out


def _request(body: dict, engine, prompt) -> ChatRequest:
    ops = operator_defaults().given()  # the serve's defaults (--temp, -n, ...) before llama-server's own
    n_predict = body.get("n_predict", body.get("max_tokens", ops.get("max_tokens", -1)))
    if isinstance(n_predict, bool) or not isinstance(n_predict, int):
        raise invalid("'n_predict' must be an integer")
    n_probs = body.get("n_probs", 0)
    if isinstance(n_probs, bool) or not isinstance(n_probs, int) or n_probs < 0:
        raise invalid("'n_probs' must be a non-negative integer")
    bias = _logit_bias(body.get("logit_bias"), engine)
    if body.get("ignore_eos") is True:
        bias.update({str(t): -100.0 for t in engine.tokenizer.eog_ids})
    seed = body.get("seed")
    fields = sampling_fields({
        "model": engine.name, "temperature": body.get("temperature", ops.get("temperature", 0.8)), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
        "max_tokens": MAX_TOKENS_CAP if n_predict < 0 else max(n_predict, 1), "stop": body.get("stop"),
        "stream": body.get("stream", False), "seed": None if seed in (None, -1) else seed,
        "presence_penalty": body.get("presence_penalty"), "frequency_penalty": body.get("frequency_penalty"),
        "min_p": body.get("min_p", ops.get("min_p", MIN_P_DEFAULT)), "repeat_penalty": body.get("repeat_penalty"), "logit_bias": bias,
        "logprobs": True, "top_logprobs": min(n_probs, 20), "grammar": body.get("grammar"),
        "json_schema": body.get("json_schema"), "response_format": body.get("response_format"),
        "return_progress": body.get("return_progress"), "timings_per_token": body.get("timings_per_token")})
    return ChatRequest(messages=[], prompt=mixed_prompt_ids(engine.tokenizer, prompt), **fields)


def completion_defaults(engine) -> dict:
    """What POST /completion does with a request that sets nothing (GET /props says it): `n_predict`
    -1 runs to the end of generation or the window, `seed` -1 is a fresh one (unless serve set them)."""
    chat = _request({}, engine, [])
    n_predict = -1 if chat.max_tokens == MAX_TOKENS_CAP else chat.max_tokens
    return {"seed": -1 if chat.seed is None else chat.seed, "temperature": chat.temperature, "top_k": chat.top_k,
            "top_p": chat.top_p, "min_p": chat.min_p, "repeat_penalty": chat.repetition_penalty,
            "presence_penalty": chat.presence_penalty, "frequency_penalty": chat.frequency_penalty,
            "n_predict": n_predict, "max_tokens": n_predict, "stream": chat.stream, "n_probs": 0, "ignore_eos": False,
            "samplers": ["penalties", "temperature", "top_k", "top_p", "min_p"]}


def _probs(engine, tokens, body: dict) -> list[dict]:
    """`completion_probabilities`: per token its log-probability and its n_probs likeliest
    alternatives under the model, or with `post_sampling_probs` the probabilities under the
    sampler's own distribution (after bias, penalties, temperature, top-k and top-p; a greedy
    sampler keeps its argmax alone), as `prob` and `top_probs`: as llama-server, the list ends at
    the first token the sampler could not draw (probability 0), so it may hold fewer than n_probs."""
    tok = engine.tokenizer

    def entry(i: int, value: float, key: str) -> dict:
        raw = tok.token_bytes(i)
        return {"id": i, "token": raw.decode("utf-8", errors="ignore"), "bytes": list(raw),
                key: max(value, -3.4028234663852886e38)}

    if body.get("post_sampling_probs") is True:
        return [{**entry(t.token, t.prob, "prob"),
                 "top_probs": [entry(i, p, "prob") for i, p in itertools.takewhile(lambda c: c[1] > 0.0, t.post)]}
                for t in tokens]
    return [{**entry(t.token, t.logprob, "logprob"), "top_logprobs": [entry(i, lp, "logprob") for i, lp in t.top]}
            for t in tokens]


def _bias_list(engine, chat: ChatRequest, body: dict) -> list[dict]:
    """generation_settings' `logit_bias` as llama-server lists it: {token, bias} pairs, the end-of-
    generation tokens `ignore_eos` bans with a null bias (its -infinity)."""
    banned = set(engine.tokenizer.eog_ids) if body.get("ignore_eos") is True else set()
    return [{"token": t, "bias": None if t in banned else b} for t, b in chat.logit_bias]


def _final(engine, chat: ChatRequest, body: dict, content: str, tokens: list, end: ChoiceEnd | None,
           req_end: RequestEnd, index: int) -> dict:
    finish = end.finish_reason if end else "stop"
    stop_type = "limit" if finish == "length" else "word" if end and end.stop_string else "eos"
    n_probs = int(body.get("n_probs", 0) or 0)
    out = {"index": index, "content": content, "tokens": [t.token for t in tokens] if body.get("return_tokens") else [],
           "id_slot": 0, "stop": True, "model": engine.name, "tokens_predicted": req_end.completion_tokens,
           "tokens_evaluated": req_end.prompt_tokens,
           "generation_settings": {"n_predict": -1 if chat.max_tokens == MAX_TOKENS_CAP else chat.max_tokens,
                                   "seed": chat.seed if chat.seed is not None else -1, "temperature": chat.temperature,
                                   "top_k": chat.top_k, "top_p": chat.top_p, "min_p": chat.min_p,
                                   "repeat_penalty": chat.repetition_penalty, "stop": chat.stop, "stream": chat.stream,
                                   "n_probs": n_probs, "max_tokens": chat.max_tokens,
                                   "ignore_eos": body.get("ignore_eos") is True, "logit_bias": _bias_list(engine, chat, body)},
           "prompt": engine.tokenizer.decode(chat.prompt), "has_new_line": "\n" in content, "truncated": False,
           "stop_type": stop_type, "stopping_word": (end.stop_string or "") if end else "",
           "tokens_cached": req_end.prompt_tokens + req_end.completion_tokens,
           "timings": timings(req_end)}
    if n_probs and not chat.stream:
        out["completion_probabilities"] = _probs(engine, tokens, body)
    fields = body.get("response_fields")
    if isinstance(fields, list) and fields:  # only these (a "/"-path reads inside), flat keys
        picked = {}
        for f in fields:
            value, found = out, True
            for part in str(f).split("/"):
                if isinstance(value, dict) and part in value:
                    value = value[part]
                else:
                    found = False
                    break
            if found:
                picked[str(f)] = value
        out = picked
    return out


async def _submit(chat: ChatRequest):
    try:
        return await plan_and_submit(chat, plan_chat)
    except ApiError as e:
        if e.type == "context_over_budget":  # llama-server's own type and status for it
            raise ApiError(400, "exceed_context_size_error", e.message, n_prompt_tokens=e.fields.get("kv_used"),
                           n_ctx=e.fields.get("kv_cap")) from None
        raise


async def _body_and_engine():
    """The request's JSON object and the model its "model" names (any, where one is served)."""
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    model = body.get("model")
    return body, current_app.pantheon.resolve(model if isinstance(model, str) else None)


@bp.route("/completion", methods=["POST"])
@bp.route("/completions", methods=["POST"])  # llama-server's twin of /completion (its OpenAI one is /v1/completions)
async def completion():
    body, engine = await _body_and_engine()
    prompts = llama_prompts("prompt", body.get("prompt"), MAX_PROMPTS)
    return await _answer(engine, body, [_request(body, engine, p) for p in prompts])


@bp.route("/infill", methods=["POST"])
async def infill():
    """llama-server's code infill: {"input_prefix", "input_suffix", "input_extra": [{"filename",
    "text"}], "prompt" (the start of the middle)} and /completion's options -> the middle, shaped
    as /completion answers. The prompt is llama-server's repository-level FIM layout
    (engine/chat.infill_ids); a model whose vocabulary has no FIM tokens gets 501."""
    body, engine = await _body_and_engine()
    tok = engine.tokenizer
    if missing := missing_fim_tokens(tok):
        raise ApiError(501, "not_supported_error", "infill is not supported by this model: its vocabulary has no "
                                                   f"fill-in-the-middle {', '.join(missing)} token")
    prefix, suffix = body.get("input_prefix", ""), body.get("input_suffix", "")
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise invalid("'input_prefix' and 'input_suffix' must be strings")
    extra = body.get("input_extra", [])
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_CHUNKS:
        raise invalid(f"'input_extra' must be an array of at most {MAX_EXTRA_CHUNKS} {{\"filename\", \"text\"}} objects")
    chunks = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) \
                or not isinstance(chunk.get("filename", "tmp"), str):
            raise invalid(f"'input_extra[{i}]' must be {{\"filename\": string, \"text\": string}} (text required)")
        chunks.append((chunk.get("filename", "tmp"), chunk["text"]))
    middle = body.get("prompt", "")
    if not (isinstance(middle, str) or (isinstance(middle, list) and all(is_token_id(t) or isinstance(t, str)
                                                                           for t in middle))):
        raise invalid("'prompt' must be text, or text and token ids")
    middle_ids = mixed_prompt_ids(tok, middle, add_bos=False)
    n_predict = body.get("n_predict", -1)
    window = engine.effective_ctx
    batch = min(LLAMA_BATCH, window)  # llama-server fits prefix, middle and suffix in one batch
    room = window - batch - 2 * (n_predict if is_token_id(n_predict) else -1)
    ids = await asyncio.to_thread(infill_ids, tok, prefix, suffix, chunks, middle_ids, batch, room)
    return await _answer(engine, body, [_request(body, engine, ids)])


async def _answer(engine, body: dict, chats: list[ChatRequest]):
    """Run /completion's (or /infill's) requests one after another: a JSON result per prompt (a list
    when there are several), or one prompt streamed."""
    if chats[0].stream:
        if len(chats) > 1:
            raise invalid("streaming takes one prompt")
        _, _, events = await _submit(chats[0])
        return sse.streaming_response(_stream(engine, chats[0], body, events))
    results = []
    for i, chat in enumerate(chats):
        _, _, events = await _submit(chat)
        choice, end = await collect_one(events)
        results.append(_final(engine, chat, body, choice.content, choice.tokens, choice.end, end, i))
    return Response(json.dumps(results if len(results) > 1 else results[0]), content_type="application/json")


async def _stream(engine, chat: ChatRequest, body: dict, events):
    n_probs, produced, choice_end = int(body.get("n_probs", 0) or 0), 0, None
    try:
        async for ev in events:
            if isinstance(ev, PromptProgress):
                yield sse.event({"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": 0,
                                 "tokens_predicted": 0, "tokens_evaluated": ev.total, **progress_fields(ev, chat)})
            elif isinstance(ev, Delta) and (ev.content or ev.tokens):
                produced += len(ev.tokens)
                part = {"index": 0, "content": ev.content, "tokens": [t.token for t in ev.tokens], "stop": False,
                        "id_slot": 0, "tokens_predicted": produced, "tokens_evaluated": len(chat.prompt)}
                if n_probs:
                    part["completion_probabilities"] = _probs(engine, ev.tokens, body)
                yield sse.event({**part, **delta_timings(ev)})
            elif isinstance(ev, ChoiceEnd):
                choice_end = ev
            elif isinstance(ev, RequestEnd):
                yield sse.event(_final(engine, chat, body, "", [], choice_end, ev, 0))
            elif isinstance(ev, RequestError):
                yield sse.event({"error": {"code": status_of(ev.type), "message": ev.message, "type": ev.type}})
                return
    finally:
        await events.aclose()
