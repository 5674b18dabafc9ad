"""POST /v1/completions: OpenAI's legacy text completions (llama-server's /completions is its native
/completion: native_routes). The prompt is raw text
or token ids, no chat template, on the same engine, sampler and sessions as chat; several prompts
run as concurrent requests, their choices numbered prompt-major (prompt i, choice j -> i * n + j).
`echo` with `logprobs` scores the prompt too (each prompt token's log-probability given those
before it, as OpenAI's legacy API and vLLM do: what lm-evaluation-harness reads for log-likelihoods);
with `echo` and `max_tokens: 0`, only the prompt comes back."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from quart import Blueprint

from pantheon.engine.chat import plan_chat
from pantheon.engine.events import ChoiceEnd, Delta, PromptLogprobs, PromptProgress, RequestEnd, RequestError
from pantheon.web import sse
from pantheon.web.chat_request import MAX_N, ChatRequest, _number, operator_defaults, prompt_list, sampling_fields
from pantheon.web.errors import error_body, invalid, json_body
from pantheon.web.generation import collect, delta_timings, plan_and_submit, progress_fields, system_fingerprint

bp = Blueprint("completions", __name__)

MAX_PROMPTS = 16  # prompts in one request (each takes a slot while it decodes)
MAX_TOKENS_DEFAULT = 16  # OpenAI's documented default for this API
MAX_LOGPROBS = 20


def parse_completion_request(body) -> tuple[list[ChatRequest], dict]:
    """The body -> one ChatRequest per prompt, and the legacy-only options (echo, logprobs, best_of)."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    prompts = prompt_list("prompt", body.get("prompt"), MAX_PROMPTS)
    # n_predict, or the serve's -n: sampling_fields reads them
    default = MAX_TOKENS_DEFAULT if body.get("n_predict") is None and operator_defaults().max_tokens is None else None
    fields = sampling_fields({**body, "max_tokens": body.get("max_tokens", default),
                              "logprobs": None, "top_logprobs": None})
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise invalid("'logprobs' must be a non-negative integer (the alternatives per token) or null")
    logprobs = None if logprobs is None else min(logprobs, MAX_LOGPROBS)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise invalid("'echo' must be a boolean")
    # echo with max_tokens 0 asks for the prompt alone (scored, with logprobs): one token is
    # generated underneath, never shown
    score_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    if score_only:
        fields["max_tokens"] = 1
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise invalid("'suffix' must be a string")
    n = fields["n"]
    best_of = _number(body, "best_of", n, int)
    if best_of < n:
        raise invalid(f"'best_of' ({best_of}) must be at least 'n' ({n})")
    if best_of > MAX_N:
        raise invalid(f"'best_of' may be at most {MAX_N}")
    if best_of > n and fields["stream"]:
        raise invalid("'best_of' greater than 'n' cannot be streamed")
    fields.update(n=best_of, logprobs=logprobs is not None or best_of > n, top_logprobs=logprobs or 0)
    scored = logprobs if echo else None
    reqs = [ChatRequest(messages=[], prompt=p, suffix=suffix, prompt_logprobs=scored, **fields) for p in prompts]
    return reqs, {"echo": echo, "logprobs": logprobs, "n": n, "best_of": best_of, "score_only": score_only}


def _legacy_logprobs(engine, tokens, offset: int) -> dict:
    """OpenAI's legacy shape: parallel arrays, and each token's text offset in the choice's text."""
    tok = engine.tokenizer
    text = lambda t: tok.token_bytes(t).decode("utf-8", errors="replace")
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        piece = text(t.token)
        out["tokens"].append(piece)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({text(i): lp for i, lp in t.top})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def _prompt_logprobs(engine, scored: PromptLogprobs) -> dict:
    """The echoed prompt's entries in the legacy shape: its first token has no context, so no
    log-probability and no alternatives (null, as OpenAI and vLLM give it); offsets from 0."""
    first = engine.tokenizer.token_bytes(scored.first_token).decode("utf-8", errors="replace")
    rest = _legacy_logprobs(engine, scored.tokens, len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def _joined(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


async def _taking_scores(events, into: list):
    """The events with the prompt's scores (PromptLogprobs) taken out into `into`."""
    async for ev in events:
        if isinstance(ev, PromptLogprobs):
            into.append(ev)
        else:
            yield ev


def _usage(ends: list[RequestEnd], score_only: bool = False) -> dict:
    prompt = sum(e.prompt_tokens for e in ends)
    completion = 0 if score_only else sum(e.completion_tokens for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(e.cached_tokens for e in ends)}}


def _echo_text(engine, req: ChatRequest) -> str:
    return req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(req.prompt)


@bp.route("/v1/completions", methods=["POST"])
async def completions():
    reqs, opts = parse_completion_request(await json_body())
    submitted = []
    try:
        for req in reqs:
            if submitted:  # every prompt on the model the first one resolved to
                req = replace(req, model=submitted[0][0].name)
            submitted.append((*await plan_and_submit(req, plan_chat), req))
    except BaseException:
        for _, _, events, _ in submitted:
            await events.aclose()
        raise
    engine = submitted[0][0]
    meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": engine.name, "system_fingerprint": system_fingerprint()}
    if reqs[0].stream:
        return sse.streaming_response(_stream(submitted, opts, meta, reqs[0].include_usage))
    try:
        choices, ends = [], []
        for i, (engine, _, events, req) in enumerate(submitted):
            scored = []
            got, end = await collect(_taking_scores(events, scored), req.n)
            ends.append(end)
            if opts["best_of"] > opts["n"]:  # the n most likely of best_of, by their summed log-probability
                got = sorted(got, key=lambda c: -sum(t.logprob for t in c.tokens))[:opts["n"]]
            prefix = _echo_text(engine, req) if opts["echo"] else ""
            echoed = _prompt_logprobs(engine, scored[0]) if scored else None
            for j, c in enumerate(got):
                if opts["score_only"]:
                    choices.append({"index": i * opts["n"] + j, "text": prefix, "logprobs": echoed,
                                    "finish_reason": "length"})
                    continue
                choices.append({"index": i * opts["n"] + j, "text": prefix + c.content,
                                "logprobs": None if opts["logprobs"] is None else
                                _joined(echoed, _legacy_logprobs(engine, c.tokens, len(prefix))),
                                "finish_reason": c.finish_reason})
    finally:
        for _, _, events, _ in submitted:
            await events.aclose()
    return {**meta, "choices": choices, "usage": _usage(ends, opts["score_only"])}


async def _stream(submitted, opts: dict, meta: dict, include_usage: bool):
    """Each prompt's choices in turn (later prompts decode meanwhile; their events wait)."""
    def chunk(index: int, text: str, finish=None, logprobs=None, top=None) -> bytes:
        return sse.event({**meta, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                               "finish_reason": finish}], **(top or {})})

    ends = []
    try:
        for i, (engine, _, events, req) in enumerate(submitted):
            base = i * opts["n"]
            offsets = [0] * req.n
            if opts["echo"]:
                prefix = _echo_text(engine, req)
                offsets = [len(prefix)] * req.n
                if req.prompt_logprobs is None:  # else with its scores, which come before any token
                    yield b"".join(chunk(base + j, prefix) for j in range(req.n))
            async for ev in events:
                if isinstance(ev, PromptLogprobs):
                    lp = _prompt_logprobs(engine, ev)
                    yield b"".join(chunk(base + j, prefix, logprobs=lp) for j in range(req.n))
                elif isinstance(ev, PromptProgress):
                    yield chunk(base, "", top=progress_fields(ev, req))
                elif opts["score_only"] and isinstance(ev, (Delta, ChoiceEnd)):
                    if isinstance(ev, ChoiceEnd):  # the token generated underneath is not shown
                        yield chunk(base + ev.index, "", finish="length")
                elif isinstance(ev, Delta) and (ev.content or ev.tokens):
                    lp = None
                    if opts["logprobs"] is not None:
                        lp = _legacy_logprobs(engine, ev.tokens, offsets[ev.index])
                    offsets[ev.index] += len(ev.content)
                    yield chunk(base + ev.index, ev.content, logprobs=lp, top=delta_timings(ev))
                elif isinstance(ev, ChoiceEnd):
                    yield chunk(base + ev.index, "", finish=ev.finish_reason)
                elif isinstance(ev, RequestEnd):
                    ends.append(ev)
                elif isinstance(ev, RequestError):
                    yield sse.event(error_body(ev.type, ev.message, **ev.fields)) + sse.DONE
                    return
        if include_usage:
            yield sse.event({**meta, "choices": [], "usage": _usage(ends, opts["score_only"])})
        yield sse.DONE
    finally:
        for _, _, events, _ in submitted:
            await events.aclose()
