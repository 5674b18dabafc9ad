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


def _round_half_away(x):
    # C's roundf, which ggml's Q8_0 quantizer uses (jnp.round would round half to even).
    return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)


def quantize_activations(x: jax.Array, scheme: str) -> jax.Array:
    """Round x (last axis = the contraction) the way ggml does before a quantized dot product."""
    if scheme == NONE:
        return x
    if scheme == F16:
        return x.astype(jnp.float16).astype(x.dtype)
    if scheme == BF16:
        return x.astype(jnp.bfloat16).astype(x.dtype)
    block = 32 if scheme == Q8_0 else 256
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    if scheme == Q8_0:
        d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 127
        q = _round_half_away(xb * jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d)))
        d = d.astype(jnp.float16).astype(x.dtype)  # the scale is stored as fp16
    else:  # Q8_K: scale from the signed extreme value, f32 scale, round to nearest even
        idx = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)
        vmax = jnp.take_along_axis(xb, idx, axis=-1)
        iscale = jnp.where(vmax == 0, 0, -127 / jnp.where(vmax == 0, 1, vmax))
        q = jnp.minimum(jnp.round(xb * iscale), 127)
        d = jnp.where(iscale == 0, 0, 1 / jnp.where(iscale == 0, 1, iscale))
    return (q * d).reshape(shape)
