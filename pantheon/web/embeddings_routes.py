"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings API on the served generative model. Each
input is run from position 0 on the device thread between decode steps (engine.hidden_states), its
final-normed hidden states pooled as the file says (engine/embedding.py) and L2-normalised.
POST /embedding: llama-server's own (legacy) shape of the same, `[{"index", "embedding": [[...]]}]`:
the pooled vector normalised as `embd_normalize` says, or every token's vector where the file's
pooling is none."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from quart import Blueprint, current_app

from pantheon.engine.embedding import normalize, p_normalize, pool
from pantheon.engine.chat import mixed_prompt_ids
from pantheon.web.chat_request import llama_prompts
from pantheon.web.errors import ApiError, invalid, json_body

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 256


async def _request():
    """The body, the model's engine and each input's token ids (validated)."""
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    # OpenAI's forms (text, ids, an array of either) and llama-server's (text and ids mixed,
    # {"prompt_string"}); "content" is llama-server's name for the field
    items = llama_prompts("input", body.get("input", body.get("content")), MAX_INPUTS)
    model = body.get("model")
    engine = current_app.pantheon.resolve(model if isinstance(model, str) else None)
    return body, engine, await _token_lists(engine, items)


async def _token_lists(engine, items) -> list[list[int]]:
    tok, cap = engine.tokenizer, engine.effective_ctx
    vocab = tok.vocab_size
    token_lists = []
    for i, item in enumerate(items):
        ids = await asyncio.to_thread(mixed_prompt_ids, tok, item)
        if any(not 0 <= t < vocab for t in ids):
            raise invalid(f"'input[{i}]' holds a token id outside the vocabulary [0, {vocab})")
        if not ids:
            raise invalid(f"'input[{i}]' is empty: nothing to embed")
        if len(ids) > cap:
            raise ApiError(400, "invalid_request_error", f"'input[{i}]' of {len(ids)} tokens is too large to "
                                                         f"process: at most {cap} tokens (the context window)")
        token_lists.append(ids)
    return token_lists


@bp.route("/v1/embeddings", methods=["POST"])
@bp.route("/embeddings", methods=["POST"])  # clients configured with a base URL lacking /v1
async def embeddings():
    body, engine, token_lists = await _request()
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("'encoding_format' must be \"float\" or \"base64\"")
    width = engine.spec.n_embd
    dims = body.get("dimensions")
    if dims is not None and dims != width:
        raise invalid(f"'dimensions' {dims!r:.20}: this model's embeddings have {width} dimensions and are not "
                      "shortened")
    if engine.pooling == "none":
        raise invalid("this model's file says pooling 'none' (one vector per token), which the OpenAI embeddings "
                      "API cannot return")
    data = []
    for i, ids in enumerate(token_lists):
        vector = normalize(pool(await engine.hidden_states(ids), engine.pooling))
        if fmt == "base64":
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            value = vector.astype(np.float64).tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    n = sum(map(len, token_lists))
    return {"object": "list", "model": engine.name, "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}


@bp.route("/embedding", methods=["POST"])
async def embedding_legacy():
    """llama-server's /embedding: a list of {"index", "embedding"}, each embedding a list of vectors:
    one, pooled and normalised by `embd_normalize` (-1 none, 0 max-abs to the int16 range, 1
    taxicab, 2 Euclidean: the default, p > 2 the p-norm), or one per token, unnormalised, where the
    file's pooling is none."""
    body, engine, token_lists = await _request()
    norm = body.get("embd_normalize", 2)
    if isinstance(norm, bool) or not isinstance(norm, int) or not -1 <= norm < 2**31:  # llama.cpp's int
        raise invalid("'embd_normalize' must be an integer: -1 (none), 0 (max absolute), 1 (taxicab), "
                      "2 (Euclidean) or a larger p (p-norm)")
    out = []
    for i, ids in enumerate(token_lists):
        hidden = await engine.hidden_states(ids)
        rows = hidden if engine.pooling == "none" else p_normalize(pool(hidden, engine.pooling), norm)[None]
        out.append({"index": i, "embedding": rows.astype(np.float64).tolist()})
    return out
