"""The dense llama family (llama, mistral, minicpm, phi3, qwen2, qwen3) as pure functions.

forward(params, cache, tokens, positions, slots) -> (logits, cache), with a `lax.scan` over the
stacked layers (one layer program, compiled once: 0.3 s instead of 5-18 s for an unrolled stack).
One function serves prefill chunks (B=1, T=chunk) and batched decode (B=batch, T=1)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pantheon.model.layers import gqa_attention, linear, rms_norm, rope, swiglu
from pantheon.model.numerics import Numerics
from pantheon.model.spec import ModelSpec
from pantheon.model.state import KVCache


def _block(spec: ModelSpec, num: Numerics, kv_len: int, x, k_cache, v_cache, layer, w, positions, slots):
    """One transformer block. x: [B, T, E]; k_cache/v_cache: [L, slots+1, C, K, D]."""
    b, t, _ = x.shape
    h = rms_norm(x, w["attn_norm"], spec.rms_eps)
    q = linear(h, w["wq"], num.scheme("wq")).reshape(b, t, spec.n_head, spec.head_dim)
    k = linear(h, w["wk"], num.scheme("wk")).reshape(b, t, spec.n_head_kv, spec.head_dim)
    v = linear(h, w["wv"], num.scheme("wv")).reshape(b, t, spec.n_head_kv, spec.head_dim)
    if "bq" in w:  # qwen2-style projection biases
        q = q + w["bq"].reshape(spec.n_head, spec.head_dim)
        k = k + w["bk"].reshape(spec.n_head_kv, spec.head_dim)
        v = v + w["bv"].reshape(spec.n_head_kv, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, w["q_norm"], spec.rms_eps)
        k = rms_norm(k, w["k_norm"], spec.rms_eps)
    q = rope(q, positions, spec.rope_base, spec.rope_dim, spec.rope_style)
    k = rope(k, positions, spec.rope_base, spec.rope_dim, spec.rope_style)

    # Write this chunk's keys/values at their absolute positions, then attend over the first kv_len.
    # Positions past the cache (padding of a final chunk) are dropped.
    rows = slots[:, None]
    k_cache = k_cache.at[layer, rows, positions].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, rows, positions].set(v.astype(v_cache.dtype), mode="drop")
    keys = k_cache[layer, slots, :kv_len]  # [B, S, K, D]
    values = v_cache[layer, slots, :kv_len]
    attn = gqa_attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions)
    x = x + spec.residual_scale * linear(attn.reshape(b, t, -1), w["wo"], num.scheme("wo"))

    h = rms_norm(x, w["ffn_norm"], spec.rms_eps)
    x = x + spec.residual_scale * swiglu(h, w["w_gate"], w["w_up"], w["w_down"],
                                             tuple(num.scheme(k) for k in ("w_gate", "w_up", "w_down")))
    return x, k_cache, v_cache


@partial(jax.jit, static_argnames=("spec", "numerics", "kv_len", "all_logits"), donate_argnames=("cache",))
def forward(params, cache: KVCache, tokens, positions, slots, logit_index, *, spec: ModelSpec,
            numerics: Numerics, kv_len: int, all_logits: bool = False):
    """tokens, positions: int32 [B, T]; slots: int32 [B]; logit_index: int32 [B], the position in T
    whose logits are returned (the last real token of each row). kv_len: static number of cache
    positions attended, >= max(positions) + 1. numerics: activation rounding (numerics.py).

    Returns (logits [B, V] — or [B, T, V] when all_logits — and the updated cache)."""
    x = params["embed"][tokens] * spec.embed_scale  # [B, T, E]

    def step(carry, layer_in):
        x, k_cache, v_cache = carry
        layer, w = layer_in
        x, k_cache, v_cache = _block(spec, numerics, kv_len, x, k_cache, v_cache, layer, w, positions, slots)
        return (x, k_cache, v_cache), None

    layers = jnp.arange(spec.n_layer, dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(step, (x, cache.k, cache.v), (layers, params["layers"]))
    if not all_logits:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]  # [B, E]
    x = rms_norm(x, params["output_norm"], spec.rms_eps)
    head = params["embed"] if spec.tied_embeddings else params["output"]
    logits = linear(x, head, numerics.scheme("head")) / spec.logit_scale
    return logits.astype(jnp.float32), KVCache(k_cache, v_cache)
