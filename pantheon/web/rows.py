"""Model rows as `/v1/models` (client) and `/admin/models` (operator) show them."""

from __future__ import annotations

import math

from pantheon.engine.chat import tool_choice_required_with_thinking
from pantheon.engine.pool import ModelEntry

def graphs_object(engine, operator: bool) -> dict | None:
    reg = engine.registry
    total = reg.counters()
    if not total["total"]:
        return None
    out = dict(total)
    if not operator:
        out.pop("gave_up", None)
        return out
    out.setdefault("gave_up", 0)
    out["captures"], out["capture_failures"] = reg.captures, reg.capture_failures
    for cls in reg.classes():
        out[cls] = reg.counters(cls)
    return out


def attention_object(engine, operator: bool) -> dict | None:
    """Omitted until the forward has reached an attention layer (see residency.AttentionResidency)."""
    attention = engine.runner.attention
    return attention.counters(operator) if attention.reached() else None


# llama.cpp's llama_vocab_type by the file's tokenizer.ggml.model
VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


def model_meta(engine) -> dict:
    """llama-server's `meta` of a /v1/models row (what its web UI and some clients read the
    training context from): the vocabulary's type and size, n_ctx_train, n_embd, the parameters
    and the tensors' bytes as the file holds them."""
    tensors = engine.gguf.tensors.values()
    return {"vocab_type": VOCAB_TYPES.get(engine.gguf.metadata.get("tokenizer.ggml.model"), 0),
            "n_vocab": engine.spec.n_vocab, "n_ctx_train": engine.spec.ctx_train, "n_embd": engine.spec.n_embd,
            "n_params": sum(math.prod(t.shape) for t in tensors), "size": sum(t.nbytes for t in tensors)}


def public_row(entry: ModelEntry) -> dict:
    e, c = entry.engine, entry.config
    row = {"id": c.name, "object": "model", "created": 0, "owned_by": "pantheon",
           "max_sessions": e.max_sessions, "max_concurrent": e.max_concurrent,
           "context_window": e.effective_ctx, "tool_choice_required_with_thinking": tool_choice_required_with_thinking(e),
           "status": e.status, "meta": model_meta(e)}
    if c.aliases:
        row["aliases"] = [c.name, *c.aliases]  # llama-server's list: every name, the id's too
    if c.tags:
        row["tags"] = list(c.tags)
    for key, value in (("graphs", graphs_object(e, False)), ("attention", attention_object(e, False))):
        if value is not None:
            row[key] = value
    return row


def operator_row(entry: ModelEntry) -> dict:
    e, c = entry.engine, entry.config
    row = {"id": c.name, "object": "model", "path": str(c.path), "dies": list(c.dies or [0]),
           "vram_bytes": sum(e.bytes_per_device().values()), "max_sessions": e.max_sessions, "max_concurrent": e.max_concurrent,
           # what vram_bytes is made of: the weights as held (blocks or expanded) and the KV cache in its type
           "weights_bytes": e.weight_bytes, "kv_bytes": e.kv_bytes, "kv_dtype": e.kv_dtype_name,
           "numerics": e.numerics.mode,
           "max_concurrent_configured": e.max_concurrent_configured,
           "context_window": e.effective_ctx, "context_window_configured": e.ctx_configured,
           # max_sessions bounds the ids on the device; idle ones beyond it wait on the host tier
           "sessions": e.table.tiers(), "status": e.status}
    if c.aliases:
        row["aliases"] = [c.name, *c.aliases]
    for key, value in (("graphs", graphs_object(e, True)), ("attention", attention_object(e, True))):
        if value is not None:
            row[key] = value
    return row
