"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings API on the served generative model. Each
input is run from position 0 on the device thread between decode steps (engine.hidden_states), its
final-normed hidden states pooled as the file says (engine/embedding.py) and L2-normalised."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from quart import Blueprint, current_app

from pantheon.engine.embedding import normalize, pool
from pantheon.engine.chat import mixed_prompt_ids
from pantheon.web.chat_request import llama_prompts
from pantheon.web.errors import ApiError, invalid, json_body

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 256


@bp.route("/v1/embeddings", methods=["POST"])
@bp.route("/embeddings", methods=["POST"])  # clients configured with a base URL lacking /v1
async def embeddings():
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    # OpenAI's forms (text, ids, an array of either) and llama-server's (text and ids mixed,
    # {"prompt_string"}); "content" is llama-server's name for the field
    items = llama_prompts("input", body.get("input", body.get("content")), MAX_INPUTS)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("'encoding_format' must be \"float\" or \"base64\"")
    model = body.get("model")
    engine = current_app.pantheon.resolve(model if isinstance(model, str) else None)
    width = engine.spec.n_embd
    dims = body.get("dimensions")
    if dims is not None and dims != width:
        raise invalid(f"'dimensions' {dims!r:.20}: this model's embeddings have {width} dimensions and are not "
                      "shortened")
    if engine.pooling == "none":
        raise invalid("this model's file says pooling 'none' (one vector per token), which the OpenAI embeddings "
                      "API cannot return")
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
