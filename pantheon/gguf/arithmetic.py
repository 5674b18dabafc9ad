"""ggml's arithmetic, as its CPU backend computes it: the rounding of activations to 8-bit blocks
before a quantized dot product (Q8_0/Q8_1 with an fp16 scale per 32 values, Q8_K with an f32 scale
per 256), the integer dot products against a weight's integer parts (`IntBlocks`, from
`quants.integer_parts`), and the elementwise functions whose last bit decides those roundings
(silu, GELU's f16 table, IEEE division). The ground floor beside the block formats (quants.py):
the model (`model/numerics.py` chooses per weight whether to round), the Pallas kernels and the
native kernels' references import it; it imports nothing of theirs.

llama.cpp's CPU matmuls against quantized weights first quantize the *activations* to 8-bit blocks
and compute integer dot products. On SmolLM2-135M Q4_1 that shifts the logits by up to ~1 and flips
close argmaxes (the first token of "What is the capital of France?": llama.cpp 'L' by 0.24 over
'The'). Rounding the activations the same way reproduces the integer dot exactly up to f32
summation order."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from jax import lax

from pantheon.gguf.quants import SCALE_FIELDS, dequantize, integer_parts

# ggml's vec_dot_type per weight type on the CPU backend.
Q8_0, Q8_K, F16, BF16, NONE = "q8_0", "q8_k", "f16", "bf16", "none"
_ACT_SCHEME = {Q.Q4_0: Q8_0, Q.Q4_1: Q8_0, Q.Q5_0: Q8_0, Q.Q5_1: Q8_0, Q.Q8_0: Q8_0,
               Q.Q2_K: Q8_K, Q.Q3_K: Q8_K, Q.Q4_K: Q8_K, Q.Q5_K: Q8_K, Q.Q6_K: Q8_K,
               Q.IQ4_NL: Q8_0, Q.IQ4_XS: Q8_K, Q.F16: F16, Q.BF16: BF16, Q.F32: NONE}
# (Q8_1, used against Q4_1/Q5_1, rounds values exactly as Q8_0 does; its extra block sum only
# serves the weight minimum term.)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) the way ggml computes it, x / (1 + exp(-x)): one rounding in the division
    where jax.nn.silu's x * sigmoid(x) has two. That last bit decides 8-bit activation roundings
    downstream (the tiny qwen35moe Q3_K_M file's 33-token run: a flip at position 19 with
    jax.nn.silu, none with this)."""
    return x / (1 + jnp.exp(-x))


def gelu(x: jax.Array, ggml_table: bool = False) -> jax.Array:
    """GELU, tanh form (ggml_gelu_f32). ggml_table: as ggml-cpu computes it (GGML_GELU_FP16): x
    rounded to f16 and the f16 table entry of its GELU, except x <= -10 -> 0 and x >= 10 -> x."""
    if not ggml_table:
        return jax.nn.gelu(x, approximate=True)
    x16 = x.astype(jnp.float16).astype(jnp.float32)
    g = jax.nn.gelu(x16, approximate=True).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10.0, 0.0, jnp.where(x >= 10.0, x, g))


def scheme_for(ggml_type) -> str:
    return _ACT_SCHEME.get(ggml_type, NONE)


def divide(a: jax.Array, divisor: float) -> jax.Array:
    """a / divisor, an IEEE division as ggml's C computes it. XLA turns a division by a constant into
    a multiplication by its reciprocal, which rounds ~4 % of quotients differently (amax / 127:
    then and again after the fp16 rounding of a Q8_0 scale, a block's every code moves)."""
    return a / lax.optimization_barrier(jnp.full_like(a, divisor))


def quantize_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., K] as ggml-cpu's x86 quantizer rounds it to Q8_0/Q8_1 blocks of 32: (q [..., K/32, 32],
    d [..., K/32, 1], s [..., K/32, 1]), with d = amax / 127 stored as fp16, q = x * (127 / amax)
    rounded to nearest even, and Q8_1's block sum s = d * sum(q) (the unrounded d) stored as fp16.
    The native kernel (qmatmul.cc) rounds the same way."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    d = divide(amax, 127)
    q = jnp.round(xb * jnp.where(amax == 0, 0, 127 / jnp.where(amax == 0, 1, amax)))

    def fp16(v):
        return v.astype(jnp.float16).astype(x.dtype)

    return q, fp16(d), fp16(d * jnp.sum(q, axis=-1, keepdims=True))


def q8_0_blocks(x: jax.Array) -> jax.Array:
    """x [..., K] (K % 32 == 0) -> ggml's Q8_0 blocks as bytes, uint8 [..., K / 32 * 34]: per 32
    values the fp16 scale d (little-endian), then 32 int8 codes, rounded as quantize_q8_0 (ggml-cpu's
    x86 quantizer, which llama.cpp's q8_0 KV cache is written with). The q8_0 KV cache's rows."""
    q, d, _ = quantize_q8_0(x.astype(jnp.float32))
    d_bytes = lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint8).reshape(*q.shape[:-1], 2)
    codes = lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([d_bytes, codes], axis=-1).reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def q8_0_values(b: jax.Array) -> jax.Array:
    """Q8_0 bytes uint8 [..., n * 34] -> f32 [..., n * 32]: d * code, as ggml dequantizes them."""
    return dequantize(b, Q.Q8_0)


def kv_values(block: jax.Array) -> jax.Array:
    """Keys or values read from a KV cache, as f32: a q8_0 cache's bytes (uint8: q8_0_blocks)
    decoded, a float cache's widened."""
    return q8_0_values(block) if block.dtype == jnp.uint8 else block.astype(jnp.float32)


def quantize_q8_k(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] as ggml rounds it to Q8_K blocks of 256 (quantize_row_q8_K_ref): (q [..., K/256, 256],
    d [..., K/256, 1]), the scale from the signed extreme value (iscale = -127 / max, d = 1 / iscale,
    both f32), q = x * iscale rounded to nearest even, capped at 127."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 256)
    idx = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)
    vmax = jnp.take_along_axis(xb, idx, axis=-1)
    iscale = jnp.where(vmax == 0, 0, -127 / jnp.where(vmax == 0, 1, vmax))
    q = jnp.minimum(jnp.round(xb * iscale), 127)
    return q, jnp.where(iscale == 0, 0, 1 / jnp.where(iscale == 0, 1, iscale))


def quantize_activations(x: jax.Array, scheme: str) -> jax.Array:
    """Round x (last axis = the contraction) the way ggml does before a quantized dot product."""
    if scheme == NONE:
        return x
    if scheme == F16:
        return x.astype(jnp.float16).astype(x.dtype)
    if scheme == BF16:
        return x.astype(jnp.bfloat16).astype(x.dtype)
    q, d = quantize_q8_0(x)[:2] if scheme == Q8_0 else quantize_q8_k(x)
    return (q * d).reshape(x.shape)


@partial(jax.tree_util.register_dataclass, data_fields=("c", "d", "mn", "dmin"), meta_fields=("group",))
@dataclass(frozen=True)
class IntBlocks:
    """A quantized weight [..., in, out] split as ggml's integer dot products use it (`quants.
    integer_parts`, transposed): per block of `block` inputs w = d * c + dmin * mn. c: f32 [..., in,
    out] integer codes times integer sub-block scales; d: f32 [..., in/block, out]; mn: f32 [...,
    in/group, out] integer mins, dmin [..., in/block, out] (both None without a min). Loaded for
    `llamacpp` numerics, where `int_linear` reproduces llama.cpp's CPU arithmetic."""

    c: jax.Array
    d: jax.Array
    mn: jax.Array | None = None
    dmin: jax.Array | None = None
    group: int = 0

    @property
    def block(self) -> int:
        return self.c.shape[-2] // self.d.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.c.shape)

    def __getitem__(self, index) -> "IntBlocks":
        """One expert of a stacked [X, in, out] weight (works with a traced index)."""
        return jax.tree_util.tree_map(lambda a: a[index], self)

    @classmethod
    def from_gguf(cls, data, ggml_type, n_in: int) -> "IntBlocks":
        """Raw GGUF blocks [..., out, row bytes] of a matrix with n_in inputs -> IntBlocks [..., in, out]
        (host numpy)."""
        parts = integer_parts(np.asarray(data), ggml_type)
        c, d, mn, dmin = (None if a is None else np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2))
                          for a in parts)
        if c.shape[-2] != n_in:
            raise ValueError(f"IntBlocks: {c.shape[-2]} inputs decoded, expected {n_in}")
        return cls(c, d, mn, dmin, SCALE_FIELDS[ggml_type][2])


def int_linear(x: jax.Array, w: IntBlocks, group_sizes: jax.Array | None = None) -> jax.Array:
    """y = x W as llama.cpp's CPU computes it: x rounded per row to Q8_K (256-blocks) or Q8_0
    (32-blocks), then `int_product`. f32 [..., out].

    group_sizes: a grouped product instead — x [M, in] rows sorted by expert, group e the next
    group_sizes[e] rows, w stacked [E, in, out]; rows past the groups give 0."""
    if w.block == 256:
        q, dx = quantize_q8_k(x.astype(jnp.float32))
        s = None
    else:
        q, dx, s = quantize_q8_0(x.astype(jnp.float32))
    return int_product(q, dx, s, w, group_sizes)


def int_product(q: jax.Array, dx: jax.Array, s: jax.Array | None, w: IntBlocks,
                group_sizes: jax.Array | None = None) -> jax.Array:
    """llama.cpp's product of rounded activations with w: q [..., nb, block] integer codes, dx
    [..., nb, 1] their scales (s: Q8_1's fp16 block sums, for Q4_1/Q5_1). Each block's dot is an
    exact integer sum (integers in f32: exact below 2**24, and ~6e-8 relative past it, as ggml's
    own f32 lanes), scaled by d_x * d_w and added block after block; a min term adds (d_x * dmin) *
    sum(mins * block sums of q), or for Q8_1 m * s. f32 [..., out]; group_sizes as `int_linear`."""
    block = w.block
    nb = w.d.shape[-2]
    hp = lax.Precision.HIGHEST
    if group_sizes is None:
        def dot(a, m):
            return jnp.einsum("...k,ko->...o", a, m, precision=hp)

        def of_rows(a):  # [nb, out]: every row's scales
            return a
    else:
        sizes = group_sizes.astype(jnp.int32)
        ends = jnp.cumsum(sizes)
        row_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(q.shape[0]), side="right"), sizes.shape[0] - 1)

        def dot(a, m):
            return lax.ragged_dot(a, m, sizes, precision=hp, preferred_element_type=jnp.float32)

        def of_rows(a):  # [E, nb, out] -> each row's expert's [M, nb, out]
            return a[row_expert]
    d = of_rows(w.d)
    dmin = None if w.dmin is None else of_rows(w.dmin)
    per = 0 if w.mn is None else block // w.group  # mins per block
    y = 0.0
    for b in range(nb):
        term = (dx[..., b, :] * d[..., b, :]) * dot(q[..., b, :], w.c[..., b * block:(b + 1) * block, :])
        if w.mn is not None and w.group == block:  # Q8_1: the activation block sum, stored fp16
            term = term + dmin[..., b, :] * s[..., b, :]
        elif w.mn is not None:
            sums = jnp.sum(q[..., b, :].reshape(*q.shape[:-2], per, w.group), axis=-1)  # exact
            term = term + (dx[..., b, :] * dmin[..., b, :]) * dot(sums, w.mn[..., b * per:(b + 1) * per, :])
        y = y + term
    if group_sizes is not None:
        y = jnp.where((jnp.arange(q.shape[0]) < ends[-1])[:, None], y, 0)
    return y
