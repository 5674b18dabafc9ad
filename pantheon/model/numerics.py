"""How closely the forward follows llama.cpp's arithmetic.

llama.cpp's CPU matmuls against quantized weights first quantize the *activations* to 8-bit blocks
(Q8_0/Q8_1 with an fp16 scale per 32 values, Q8_K with an f32 scale per 256) and compute integer dot
products. On SmolLM2-135M Q4_1 that shifts the logits by up to ~1 and flips close argmaxes (the first
token of "What is the capital of France?": llama.cpp 'L' by 0.24 over 'The'). Rounding the activations
the same way ("llamacpp" numerics) reproduces the integer dot exactly up to f32 summation order and
halves the gap to llama.cpp (last-prompt max |Δ| 1.05 -> 0.69, mean 0.29 -> 0.12). "exact" keeps f32
activations: the mathematically exact product of the dequantized weights."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from gguf.constants import GGMLQuantizationType as Q

# ggml's vec_dot_type per weight type on the CPU backend.
Q8_0, Q8_K, F16, BF16, NONE = "q8_0", "q8_k", "f16", "bf16", "none"
_ACT_SCHEME = {Q.Q4_0: Q8_0, Q.Q4_1: Q8_0, Q.Q5_0: Q8_0, Q.Q5_1: Q8_0, Q.Q8_0: Q8_0,
               Q.Q2_K: Q8_K, Q.Q3_K: Q8_K, Q.Q4_K: Q8_K, Q.Q5_K: Q8_K, Q.Q6_K: Q8_K,
               Q.F16: F16, Q.BF16: BF16, Q.F32: NONE}
# (Q8_1, used against Q4_1/Q5_1, rounds values exactly as Q8_0 does; its extra block sum only
# serves the weight minimum term.)


@dataclass(frozen=True)
class Numerics:
    mode: str = "llamacpp"  # or "exact"
    schemes: tuple[tuple[str, str], ...] = ()  # (weight key, activation scheme)

    def scheme(self, key: str) -> str:
        if self.mode == "exact":
            return NONE
        return dict(self.schemes).get(key, NONE)


def scheme_for(ggml_type) -> str:
    return _ACT_SCHEME.get(ggml_type, NONE)


def quantize_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., K] as ggml-cpu's x86 quantizer rounds it to Q8_0/Q8_1 blocks of 32: (q [..., K/32, 32],
    d [..., K/32, 1], s [..., K/32, 1]), with d = amax / 127 stored as fp16, q = x * (127 / amax)
    rounded to nearest even, and Q8_1's block sum s = d * sum(q) (the unrounded d) stored as fp16.
    The native kernel (qmatmul.cc) rounds the same way."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    d = amax / 127
    q = jnp.round(xb * jnp.where(amax == 0, 0, 127 / jnp.where(amax == 0, 1, amax)))

    def fp16(v):
        return v.astype(jnp.float16).astype(x.dtype)

    return q, fp16(d), fp16(d * jnp.sum(q, axis=-1, keepdims=True))


def quantize_activations(x: jax.Array, scheme: str) -> jax.Array:
    """Round x (last axis = the contraction) the way ggml does before a quantized dot product."""
    if scheme == NONE:
        return x
    if scheme == F16:
        return x.astype(jnp.float16).astype(x.dtype)
    if scheme == BF16:
        return x.astype(jnp.bfloat16).astype(x.dtype)
    if scheme == Q8_0:
        q, d, _ = quantize_q8_0(x)
        return (q * d).reshape(x.shape)
    # Q8_K: blocks of 256, scale from the signed extreme value, f32 scale, round to nearest even
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 256)
    idx = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)
    vmax = jnp.take_along_axis(xb, idx, axis=-1)
    iscale = jnp.where(vmax == 0, 0, -127 / jnp.where(vmax == 0, 1, vmax))
    q = jnp.minimum(jnp.round(xb * iscale), 127)
    d = jnp.where(iscale == 0, 0, 1 / jnp.where(iscale == 0, 1, iscale))
    return (q * d).reshape(x.shape)
