"""POST /tokenize and POST /detokenize, shaped as llama-server shapes them."""

from __future__ import annotations

from quart import Blueprint, current_app

from pantheon.web.errors import invalid, json_body

bp = Blueprint("tokenize", __name__)


def _engine(body: dict):
    model = body.get("model")
    return current_app.pantheon.resolve(model if isinstance(model, str) else None)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean")
    return value


@bp.route("/tokenize", methods=["POST"])
async def tokenize():
    """{"content" (text, or text and token ids mixed), "add_special" (false), "parse_special" (true),
    "with_pieces" (false)} ->
    {"tokens": [id, ...]}, or with pieces [{"id", "piece"}]: the piece as text, or as its bytes
    where they are not valid UTF-8 on their own (part of a character)."""
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    content = body.get("content", "")
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
                                              for p in parts):
        raise invalid("'content' must be a string, or an array of strings and token ids")
    add_special, parse_special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    tok = _engine(body).tokenizer
    ids = []
    for k, part in enumerate(parts):  # BOS (add_special) only before a leading string, as llama-server
        if isinstance(part, int):
            if not 0 <= part < tok.vocab_size:
                raise invalid(f"token id {part} is outside the vocabulary [0, {tok.vocab_size})")
            ids.append(part)
        else:
            ids += tok.encode(part, parse_special=parse_special, add_bos=None if add_special and k == 0 else False)
    if not with_pieces:
        return {"tokens": ids}
    out = []
    for i in ids:
        raw = tok.token_bytes(i)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": i, "piece": piece})
    return {"tokens": out}


@bp.route("/detokenize", methods=["POST"])
async def detokenize():
    """{"tokens": [id, ...]} -> {"content": text}; an id outside the vocabulary is refused."""
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    ids = body.get("tokens", [])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise invalid("'tokens' must be an array of token ids")
    tok = _engine(body).tokenizer
    bad = next((i for i in ids if not 0 <= i < tok.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})")
    return {"content": tok.decode(ids)}
