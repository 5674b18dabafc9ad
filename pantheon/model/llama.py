"""The dense llama family (llama, mistral, minicpm, phi3, qwen2, qwen3, gemma3; qwen3moe and llama
with routed experts) as pure functions.

A step is three compiled programs: `embed`, one `block` program called once per layer (the same
executable for every layer: compiled once, 0.3 s, instead of 5-18 s for an unrolled 30-layer
program), and `head`. Per-layer weights are separate arrays rather than slices of a stacked
[L, ...] array: on XLA:CPU a scan over stacked weights copies each layer's slice every step
(measured 52 ms/token against 23 ms). The same functions serve prefill chunks (B=1, T=chunk) and
batched decode (B=batch, T=1).

`forward` chains them; `call(name, fn, args, static)` lets the runner route every program through
the graph registry (the default just calls it). Attention runs through pantheon.pallas.dispatch
(model/kernels.py): the `block` program's static `kernels` records which implementation it uses."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.model import kernels as kern
from pantheon.model.host_attention import host_attend
from pantheon.model.layers import grouped_experts, linear, rms_norm, rope, swiglu, swiglu_down
from pantheon.pallas.moe import route
from pantheon.gguf.arithmetic import gelu
from pantheon.model.numerics import Numerics
from pantheon.native.qmatmul import QMatrix, embed_rows
from pantheon.pallas.qmatmul import QPlanes
from pantheon.pallas.qmatmul import embed_rows as embed_planes
from pantheon.model.spec import ModelSpec
from pantheon.model.state import KVCache, kv_write
from pantheon.model.step import LayerCall, StepInputs, direct


@partial(jax.jit, static_argnames=("spec", "by_column"))
def embed(table, tokens, *, spec: ModelSpec, by_column: bool = False):
    """tokens int32 [B, T] -> x [B, T, E]. table: [V, E], or the tied head [E, V] with by_column
    (or, quantized, a QMatrix or QPlanes [V, E] either way)."""
    if isinstance(table, QMatrix):
        x = embed_rows(table, tokens)
    elif isinstance(table, QPlanes):  # [V, E] blocks on a GPU, either way
        x = embed_planes(table, tokens)
    else:
        x = jnp.moveaxis(jnp.take(table, tokens, axis=1), 0, -1) if by_column else table[tokens]
    return x.astype(jnp.float32) * spec.embed_scale  # the residual stream is f32 (model/dtypes.py)


def _project(w, x, positions, spec: ModelSpec, num: Numerics, swa: bool = False):
    """Attention inputs: q [B, T, H, D], k and v [B, T, K, D], rotated at their absolute positions.
    swa: a sliding-window layer (gemma3), rotated with its own base and no scaling."""
    b, t, _ = x.shape
    h = rms_norm(x, w["attn_norm"], spec.rms_eps)
    if "wqkv" in w:  # fused at load (weights.FUSED)
        q, k, v = jnp.split(linear(h, w["wqkv"], num.scheme("wq")), [spec.n_head * spec.head_dim,
                                                                      (spec.n_head + spec.n_head_kv) * spec.head_dim], -1)
    elif "wqk" in w:  # q and k fused, v of another type
        q, k = jnp.split(linear(h, w["wqk"], num.scheme("wq")), [spec.n_head * spec.head_dim], -1)
        v = linear(h, w["wv"], num.scheme("wv"))
    else:
        q, k, v = (linear(h, w[key], num.scheme(key)) for key in ("wq", "wk", "wv"))
    q = q.reshape(b, t, spec.n_head, spec.head_dim)
    k = k.reshape(b, t, spec.n_head_kv, spec.head_dim)
    v = v.reshape(b, t, spec.n_head_kv, spec.head_dim)
    if "bq" in w:  # qwen2-style projection biases
        q = q + w["bq"].reshape(spec.n_head, spec.head_dim)
        k = k + w["bk"].reshape(spec.n_head_kv, spec.head_dim)
        v = v + w["bv"].reshape(spec.n_head_kv, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, w["q_norm"], spec.rms_eps)
        k = rms_norm(k, w["k_norm"], spec.rms_eps)
    own = swa and spec.rope_base_swa is not None
    base, scaling = (spec.rope_base_swa, None) if own else (spec.rope_base, spec.rope_scaling)
    q = rope(q, positions, base, spec.rope_dim, spec.rope_style, scaling)
    k = rope(k, positions, base, spec.rope_dim, spec.rope_style, scaling)
    if spec.q_scale != 1.0:  # attention scales by 1/sqrt(head_dim): gemma3's 27B by another factor
        q = q * spec.q_scale
    return q, k, v


def _tail(w, x, attn, spec: ModelSpec, num: Numerics):
    """Attention output projection, residual, and the SwiGLU FFN. attn: [B, T, H, D]."""
    b, t, _ = x.shape
    out = linear(attn.reshape(b, t, -1).astype(x.dtype), w["wo"], num.scheme("wo"))
    if spec.post_norms:
        return _gemma_tail(w, x + rms_norm(out, w["attn_post_norm"], spec.rms_eps), spec, num)
    x = x + spec.residual_scale * out
    h = rms_norm(x, w["ffn_norm"], spec.rms_eps)
    if spec.n_expert:
        return x + _routed_experts(w, h, spec, num)
    if "w_gate_up" in w:  # fused at load (weights.FUSED)
        gate, up = jnp.split(linear(h, w["w_gate_up"], num.scheme("w_gate")), 2, -1)
        return x + spec.residual_scale * swiglu_down(gate, up, w["w_down"], num.scheme("w_down"))
    schemes = tuple(num.scheme(key) for key in ("w_gate", "w_up", "w_down"))
    return x + spec.residual_scale * swiglu(h, w["w_gate"], w["w_up"], w["w_down"], schemes)


def _routed_experts(w, h, spec: ModelSpec, num: Numerics):
    """The routed-expert FFN (qwen3moe, Mixtral), as llama.cpp's build_moe_ffn with softmax gating
    and normalised weights: each token's top n_expert_used experts by the router's softmax, their
    SwiGLU outputs summed by the renormalised probabilities. h: [B, T, E]."""
    flat = h.reshape(-1, h.shape[-1])
    weights, experts = route(flat @ w["router"], spec.n_expert_used)
    schemes = tuple(num.scheme(key) for key in ("w_gate", "w_up", "w_down"))
    out = grouped_experts(flat, experts, w["exp_gate"], w["exp_up"], w["exp_down"], schemes)
    return jnp.einsum("nk,nke->ne", weights, out).reshape(h.shape)


def _gemma_tail(w, x, spec: ModelSpec, num: Numerics):
    """Gemma 3's FFN after the attention's residual: norm, GELU(gate) * up, down, norm, residual."""
    h = rms_norm(x, w["ffn_norm"], spec.rms_eps)
    if "w_gate_up" in w:
        gate, up = jnp.split(linear(h, w["w_gate_up"], num.scheme("w_gate")), 2, -1)
    else:
        gate, up = linear(h, w["w_gate"], num.scheme("w_gate")), linear(h, w["w_up"], num.scheme("w_up"))
    act = gelu(gate, ggml_table=num.mode == "llamacpp") * up
    return x + rms_norm(linear(act, w["w_down"], num.scheme("w_down")), w["ffn_post_norm"], spec.rms_eps)


@partial(jax.jit, static_argnames=("spec", "numerics", "kv_len", "kernels", "swa", "ring"), donate_argnames=("kv",))
def block(w, kv, x, positions, slots, last, *, spec: ModelSpec, numerics: Numerics, kv_len: int,
          kernels: kern.Kernels, swa: bool = False, ring: bool = False):
    """One transformer block. x: [B, T, E]; kv: this layer's (k_cache, v_cache), each [slots+1, C, K, D];
    positions: int32 [B, T] absolute; slots: int32 [B]; last: int32 [B], each row's last real token
    (the rows after it pad a prefill chunk to its bucket). Attends over the first kv_len positions.
    kernels: the attention kernel's mode (`block_kernels`). swa: a sliding-window layer (gemma3);
    ring: its cache is a ring (state.ring_len) and kv_len the model's context."""
    k_cache, v_cache = kv
    # Padding rows held at zero through the block (its input, and its attention output before the
    # projection) reach every matrix as rows of zeros, which the native kernel does not compute
    # (native/common.h: live_rows): a 35-token prompt pays for 35 rows, not its bucket's 48. No real
    # row reads them (attention is causal), so nothing else changes.
    keep = (jnp.arange(x.shape[1])[None, :] <= last[:, None])[..., None]
    x = jnp.where(keep, x, 0.0)
    q, k, v = _project(w, x, positions, spec, numerics, swa)
    # Write this chunk's keys/values at their absolute positions (a ring's: modulo its length),
    # then attend. Positions past the cache (padding of a final chunk) are dropped; a ring's padding
    # lands on positions more than a window behind every query (R >= window + T).
    rows = slots[:, None]
    at = positions % k_cache.shape[1] if ring else positions
    k_cache = k_cache.at[rows, at].set(kv_write(k, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, at].set(kv_write(v, v_cache.dtype), mode="drop")
    # A window no shorter than the cache is plain causal attention: the layer keeps the fast kernels.
    window = spec.swa_window if swa and (ring or k_cache.shape[1] > spec.swa_window) else 0
    attn = kern.attend(q, k_cache, v_cache, positions, slots, kv_len, kernels, window, ring)
    return _tail(w, x, jnp.where(keep[..., None], attn, 0), spec, numerics), k_cache, v_cache


# The host fallback: a layer whose KV buffers could not be allocated on the device keeps them in host
# memory (numpy); its block runs as project (device) -> attention (host) -> tail (device).
@partial(jax.jit, static_argnames=("spec", "numerics", "swa"))
def attn_project(w, x, positions, *, spec: ModelSpec, numerics: Numerics, swa: bool = False):
    return _project(w, x, positions, spec, numerics, swa)


@partial(jax.jit, static_argnames=("spec", "numerics"))
def attn_tail(w, x, attn, *, spec: ModelSpec, numerics: Numerics):
    return _tail(w, x, attn, spec, numerics)


@partial(jax.jit, static_argnames=("spec", "numerics", "all_logits", "hidden"))
def head(table, output_norm, x, logit_index, *, spec: ModelSpec, numerics: Numerics, all_logits: bool,
         hidden: bool = False):
    """x [B, T, E] -> logits [B, V] at logit_index per row (or [B, T, V] with all_logits). table: [E, V]
    (or a QMatrix [V, E]). hidden: the final-normed hidden states [B, T, E] instead (embeddings)."""
    if hidden:
        return rms_norm(x, output_norm, spec.rms_eps).astype(jnp.float32)
    if not all_logits:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]  # [B, E]
    x = rms_norm(x, output_norm, spec.rms_eps)
    logits = (linear(x, table, numerics.scheme("head")) / spec.logit_scale).astype(jnp.float32)
    if spec.logit_softcap:
        logits = jnp.tanh(logits / spec.logit_softcap) * spec.logit_softcap
    return logits


def block_kernels(spec: ModelSpec, cache: KVCache, t: int) -> kern.Kernels:
    """The static `kernels` of `block` for t tokens per row (model/kernels.py)."""
    return kern.choose(kern.attention_modes(t, spec.head_dim, cache.layer_shape), cache.k[0].dtype)


def forward(params, cache: KVCache, inputs: StepInputs, *, spec: ModelSpec, numerics: Numerics, kv_len: int,
            all_logits: bool = False, hidden: bool = False, call: LayerCall = direct):
    """inputs: the rows (step.StepInputs). kv_len: static number of cache positions attended,
    >= max(positions) + 1. numerics: activation rounding (numerics.py). call: how each program runs
    (step.LayerCall: the runner's registry, or directly).

    Returns (logits [B, V] — or [B, T, V] when all_logits, the final-normed hidden states [B, T, E]
    when hidden — and the updated cache). The cache's
    per-layer buffers are donated and replaced in `cache`'s own lists as each layer runs."""
    tokens, positions, slots, logit_index = inputs
    tied = "embed" not in params  # the embedding is the head [E, V] (weights.load_params)
    x = call("embed", -1, embed, (params["head"] if tied else params["embed"], tokens), dict(spec=spec, by_column=tied))
    # The cache's per-layer lists are updated in place, layer by layer: if a later layer fails,
    # the caller's cache still names every live buffer (the donated ones are already replaced).
    ks, vs = cache.k, cache.v
    kernels = kern.for_numerics(block_kernels(spec, cache, tokens.shape[1]), numerics.mode)
    static = dict(spec=spec, numerics=numerics, kv_len=kern.program_kv_len(kernels, kv_len, cache.ctx), kernels=kernels)
    plain = dict(spec=spec, numerics=numerics)
    # A sliding-window layer (gemma3) is its own executable: its rope base, its window (the native
    # kernels and the jnp path take it; a GPU's flash prefill kernel does not: kernels.windowed).
    windowed = dict(static, swa=True)
    if spec.swa_layers and cache.ctx > spec.swa_window:
        wk = kern.windowed(kernels)
        windowed.update(kernels=wk, kv_len=kern.program_kv_len(wk, kv_len, cache.ctx))
    for i, w in enumerate(params["layers"]):
        swa = bool(spec.swa_layers) and spec.swa_layers[i]
        ring = cache.is_ring(i)
        if isinstance(ks[i], np.ndarray):  # this layer's KV lives on the host
            q, k, v = call("attn_project", i, attn_project, (w, x, positions), dict(plain, swa=True) if swa else plain)
            attn = host_attend(q, k, v, ks[i], vs[i], positions, slots, spec.swa_window if swa else 0, ring)
            x = call("attn_tail", i, attn_tail, (w, x, attn), plain)
        else:
            x, ks[i], vs[i] = call("block", i, block, (w, (ks[i], vs[i]), x, positions, slots, logit_index),
                                   dict(windowed, ring=True) if ring else windowed if swa else static)
    logits = call("head", -1, head, (params["head"], params["output_norm"], x, logit_index),
                  dict(spec=spec, numerics=numerics, all_logits=all_logits, hidden=hidden))
    return logits, KVCache(ks, vs, cache.ctx)
