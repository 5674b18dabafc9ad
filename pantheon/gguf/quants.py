"""ggml tensor formats: jit-able jnp dequantizers and numpy reference quantizers.

`dequantize(data, ggml_type)` turns a tensor's raw bytes, shape (..., row_bytes) as
`GGUFFile.tensor_data` returns them, into float32 of shape (..., row_elements). Every decoder
works on a (..., n_blocks, type_size) uint8 view with broadcast shifts and masks only (no
gathers), so XLA fuses it into whatever consumes the weights. Float fields are multiplied in
ggml's order (sub-block scale `d*sc` first, then the integer code), which makes the result
bit-identical to ggml / gguf-py on backends that do not contract to FMA.

`quantize_np(values, ggml_type)` builds valid blocks for test fixtures. The K-quant encoders are
deliberately simple (one min/max pass, scales rounded *up* so nothing clips); they are not
llama.cpp's error-minimising search.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from jax import lax

QK_K = 256  # weights per K-quant super-block


def _qtype(ggml_type) -> T:
    try:
        return T(ggml_type)
    except ValueError:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None


# ---- jnp bit helpers --------------------------------------------------------------------------
def _f16(b: jax.Array, off: int) -> jax.Array:
    """Little-endian fp16 at byte `off` of each block -> float32 (..., n_blocks, 1); exact."""
    bits = b[..., off].astype(jnp.uint16) | (b[..., off + 1].astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[..., None]


def _fields(x: jax.Array, width: int, count: int) -> jax.Array:
    """(..., k) uint8 -> (..., count, k): field i of every byte, i.e. (x >> width*i) & mask.

    ggml packs "the same bit slot of consecutive bytes" as consecutive weights, so splitting the
    fields onto a new axis *before* the byte axis and flattening gives the weights in order."""
    shifts = (jnp.arange(count, dtype=jnp.uint8) * width)[:, None]
    return (x[..., None, :] >> shifts) & jnp.uint8((1 << width) - 1)


def _flat(x: jax.Array, lead: tuple[int, ...], n: int) -> jax.Array:
    return x.reshape(*lead, n)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def _q32_bits(qh: jax.Array) -> jax.Array:
    """qh (..., 4) read as a little-endian uint32 -> its 32 bits (..., 32), bit i first."""
    u = qh.astype(jnp.uint32)
    word = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
    return ((word[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)


def _nibbles32(qs: jax.Array) -> jax.Array:
    """qs (..., 16) -> (..., 32): weights 0-15 are the low nibbles, 16-31 the high nibbles."""
    return _flat(_fields(qs, 4, 2), qs.shape[:-1], 32)


# ---- 32-weight formats --------------------------------------------------------------------------
def _q8_0(b):
    """Q8_0, 34 B: d fp16 | qs int8[32].  w = q * d."""
    q = lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
    return _f32(q) * _f16(b, 0)


def _q4_0(b):
    """Q4_0, 18 B: d fp16 | qs[16] (byte i holds weights i and i+16).  w = (nibble - 8) * d."""
    return (_f32(_nibbles32(b[..., 2:18])) - 8.0) * _f16(b, 0)


def _q4_1(b):
    """Q4_1, 20 B: d fp16 | m fp16 | qs[16] (nibbles as Q4_0).  w = d * nibble + m."""
    return _f16(b, 0) * _f32(_nibbles32(b[..., 4:20])) + _f16(b, 2)


def _q5_0(b):
    """Q5_0, 22 B: d fp16 | qh u32 (bit i = 5th bit of weight i) | qs[16].  w = (q - 16) * d."""
    q = _nibbles32(b[..., 6:22]) | (_q32_bits(b[..., 2:6]) << 4)
    return (_f32(q) - 16.0) * _f16(b, 0)


def _q5_1(b):
    """Q5_1, 24 B: d fp16 | m fp16 | qh u32 | qs[16].  w = d * q + m, q in 0..31."""
    q = _nibbles32(b[..., 8:24]) | (_q32_bits(b[..., 4:8]) << 4)
    return _f16(b, 0) * _f32(q) + _f16(b, 2)


# ---- K-quants: 256-weight super-blocks ---------------------------------------------------------
def _crumbs256(qs: jax.Array) -> jax.Array:
    """2-bit codes qs (..., 64) -> (..., 256). Each 128-weight half owns 32 bytes; bits 2j..2j+1
    of byte l hold weight 32j + l of that half."""
    lead = qs.shape[:-1]
    return _flat(_fields(qs.reshape(*lead, 2, 32), 2, 4), lead, QK_K)


def _k4_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K scales[12] -> eight 6-bit scales and eight 6-bit mins, (..., 8) each.

    Bytes 0-3 hold sc0-3, bytes 4-7 hold m0-3 (low 6 bits); bytes 8-11 hold the low nibbles of
    sc4-7 (low half) and m4-7 (high half); the top 2 bits of bytes 0-7 give their high bits."""
    a, m, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = jnp.concatenate([m & 63, (c >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _q2_k(b):
    """Q2_K, 84 B: scales[16] (low nibble sc, high nibble m, per 16 weights) | qs[64] 2-bit codes |
    d fp16 | dmin fp16.  w = (d*sc) * q - (dmin*m)."""
    lead = b.shape[:-1]
    s = b[..., 0:16]
    dl = _f16(b, 80) * _f32(s & 15)
    ml = _f16(b, 82) * _f32(s >> 4)
    q = _f32(_crumbs256(b[..., 16:80])).reshape(*lead, 16, 16)
    return _flat(dl[..., None] * q - ml[..., None], lead, QK_K)


def _q3_k(b):
    """Q3_K, 110 B: hmask[32] | qs[64] low 2 bits | scales[12] | d fp16.

    hmask byte l bit j is the 3rd bit of weight 32j + l, and a *clear* bit means "subtract 4", so
    q = low2 + 4*bit - 4 in -4..3. The 16 six-bit scales: low nibbles in bytes 0-7 (sub-blocks
    0-7 low halves, 8-15 high halves), 2-bit high parts in bytes 8-11 (byte 8+i bits 2k..2k+1 =
    sub-block 4k + i). Signed scale = S - 32.  w = (d * (S-32)) * q."""
    lead = b.shape[:-1]
    s = b[..., 96:108]
    low = _flat(_fields(s[..., 0:8], 4, 2), lead, 16)
    high = _flat(_fields(s[..., 8:12], 2, 4), lead, 16)
    scale = _f32(low | (high << 4)) - 32.0
    hbit = _flat(_fields(b[..., 0:32], 1, 8), lead, QK_K)
    q = _f32(_crumbs256(b[..., 32:96])) + 4.0 * _f32(hbit) - 4.0
    dl = _f16(b, 108) * scale
    return _flat(dl[..., None] * q.reshape(*lead, 16, 16), lead, QK_K)


def _q4_k(b):
    """Q4_K, 144 B: d fp16 | dmin fp16 | scales[12] (see _k4_scale_min) | qs[128].

    Eight 32-weight sub-blocks; 64-weight chunk c owns bytes 32c..32c+31, low nibbles for
    sub-block 2c, high nibbles for 2c+1.  w = (d*sc) * q - (dmin*m), q in 0..15."""
    lead = b.shape[:-1]
    sc, mn = _k4_scale_min(b[..., 4:16])
    q = _fields(b[..., 16:144].reshape(*lead, 4, 32), 4, 2).reshape(*lead, 8, 32)
    return _k_minned(b, sc, mn, q)


def _q5_k(b):
    """Q5_K, 176 B: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128] (nibbles as Q4_K).

    qh byte l bit j is the 5th bit of weight l of sub-block j.  w = (d*sc) * q - (dmin*m)."""
    lead = b.shape[:-1]
    sc, mn = _k4_scale_min(b[..., 4:16])
    low = _fields(b[..., 48:176].reshape(*lead, 4, 32), 4, 2).reshape(*lead, 8, 32)
    q = low | (_fields(b[..., 16:48], 1, 8) << 4)
    return _k_minned(b, sc, mn, q)


def _k_minned(b, sc, mn, q):
    dl = _f16(b, 0) * _f32(sc)
    ml = _f16(b, 2) * _f32(mn)
    return _flat(dl[..., None] * _f32(q) - ml[..., None], b.shape[:-1], QK_K)


def _q6_k(b):
    """Q6_K, 210 B: ql[128] low 4 bits | qh[64] high 2 bits | scales int8[16] | d fp16.

    Each 128-weight half owns 64 ql bytes and 32 qh bytes. ql byte k of the half holds weight k
    (low nibble) and weight 64 + k (high nibble); qh byte l bits 2g..2g+1 hold weight 32g + l.
    q = (low | high<<4) - 32, in -32..31;  w = (d*sc) * q with sc the int8 scale of weight//16."""
    lead = b.shape[:-1]
    low = _fields(b[..., 0:128].reshape(*lead, 2, 64), 4, 2).reshape(*lead, QK_K)
    high = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, QK_K)
    q = _f32(low | (high << 4)) - 32.0
    dl = _f16(b, 208) * _f32(lax.bitcast_convert_type(b[..., 192:208], jnp.int8))
    return _flat(dl[..., None] * q.reshape(*lead, 16, 16), lead, QK_K)


# ---- IQ4: 4-bit indices into a fixed non-linear table of 16 int8 values ----------------------------
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _iq4_values(codes: jax.Array) -> jax.Array:
    """4-bit indices -> their table values as f32 (exact)."""
    return jnp.take(jnp.asarray(IQ4_VALUES, jnp.float32), codes.astype(jnp.int32))


def _iq4_nl(b):
    """IQ4_NL, 18 B: d fp16 | qs[16] (nibbles as Q4_0).  w = d * IQ4_VALUES[nibble]."""
    return _f16(b, 0) * _iq4_values(_nibbles32(b[..., 2:18]))


def _iq4_xs(b):
    """IQ4_XS, 136 B: d fp16 | scales_h u16 | scales_l[4] | qs[128]. Eight 32-weight sub-blocks, each
    with 16 bytes of nibbles as IQ4_NL's and a 6-bit scale: low 4 bits from scales_l (sub-block i:
    byte i/2, nibble i%2), high 2 from scales_h (bits 2i..2i+1).  w = (d * (scale - 32)) * value."""
    lead = b.shape[:-1]
    low = _flat(_fields(b[..., 4:8], 4, 2).swapaxes(-1, -2), lead, 8)  # sub-block i: byte i // 2, nibble i % 2
    h = b[..., 2].astype(jnp.uint16) | (b[..., 3].astype(jnp.uint16) << 8)
    high = ((h[..., None] >> (2 * jnp.arange(8, dtype=jnp.uint16))) & 3).astype(jnp.uint8)
    dl = _f16(b, 0) * (_f32(low | (high << 4)) - 32.0)
    q = _iq4_values(_nibbles32(b[..., 8:136].reshape(*lead, 8, 16)))
    return _flat(dl[..., None] * q, lead, QK_K)


_BLOCK_DECODERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
                   T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
                   T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}
_PLAIN = {T.F32: jnp.float32, T.F16: jnp.float16, T.BF16: jnp.bfloat16}
SUPPORTED_TYPES = frozenset(_BLOCK_DECODERS) | frozenset(_PLAIN)


def _plain(x: jax.Array, dtype, qtype: T) -> jax.Array:
    """F32/F16/BF16: typed arrays (as the reader returns them), same-width integer bit patterns
    (BF16 comes as uint16) or raw little-endian bytes (..., n*itemsize)."""
    width = jnp.dtype(dtype).itemsize
    if x.dtype == jnp.uint8 and width > 1:
        if x.shape[-1] % width:
            raise ValueError(f"{qtype.name}: row of {x.shape[-1]} bytes is not a multiple of {width}")
        x = lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, width), dtype)
    elif jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize == width:
        x = lax.bitcast_convert_type(x, dtype)
    elif not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{qtype.name}: cannot interpret {x.dtype} data")
    return x.astype(jnp.float32)


def dequantize(data, ggml_type) -> jax.Array:
    """Raw tensor data -> float32 (..., row_elements). jit-able with `ggml_type` static."""
    qtype = _qtype(ggml_type)
    x = jnp.asarray(data)
    if qtype in _PLAIN:
        return _plain(x, _PLAIN[qtype], qtype)
    if qtype not in _BLOCK_DECODERS:
        raise ValueError(f"unsupported ggml type {qtype.name} (supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
    block, tsize = GGML_QUANT_SIZES[qtype]
    if x.dtype != jnp.uint8 or x.ndim == 0 or x.shape[-1] % tsize:
        raise ValueError(f"{qtype.name}: expected uint8 rows whose length is a multiple of {tsize} "
                         f"bytes, got {x.dtype} {x.shape}")
    lead = x.shape[:-1]
    n_blocks = x.shape[-1] // tsize
    out = _BLOCK_DECODERS[qtype](x.reshape(*lead, n_blocks, tsize))
    return out.reshape(*lead, n_blocks * block)


_dequantize_jit = jax.jit(dequantize, static_argnums=1)


def dequantize_np(data, ggml_type) -> np.ndarray:
    """`dequantize` compiled with jit, returned as a numpy float32 array (for loading weights)."""
    return np.asarray(_dequantize_jit(data, _qtype(ggml_type)))


# ---- integer parts (ggml's integer dot products) -------------------------------------------------
# Byte offsets of each block type's fp16 scale `d` and of its second fp16 field (the K-quants'
# `dmin`, Q4_1/Q5_1's `m`), and the weights per min: every format is w = d * c + dmin * mn with c
# the integer code times its integer sub-block scale and mn an integer per `group` weights
# (K-quants: -m; Q4_1/Q5_1: 1, i.e. the block's m itself).
SCALE_FIELDS = {T.Q8_0: (0, None, 0), T.Q4_0: (0, None, 0), T.Q5_0: (0, None, 0), T.Q4_1: (0, 2, 32),
                T.Q5_1: (0, 2, 32), T.Q2_K: (80, 82, 16), T.Q3_K: (108, None, 0), T.Q4_K: (0, 2, 32),
                T.Q5_K: (0, 2, 32), T.Q6_K: (208, None, 0), T.IQ4_NL: (0, None, 0), T.IQ4_XS: (0, None, 0)}
_FP16_ONE = (0x00, 0x3C)


def _with_fields(b: jax.Array, values: dict[int, tuple[int, int]]) -> jax.Array:
    """Blocks b (..., n_blocks, type_size) with the fp16 fields at the given offsets overwritten."""
    for off, (lo, hi) in values.items():
        b = b.at[..., off].set(jnp.uint8(lo)).at[..., off + 1].set(jnp.uint8(hi))
    return b


def integer_parts(data, ggml_type):
    """Raw tensor data (..., row_bytes) -> (c, d, mn, dmin) with w = d * c + dmin * mn per block, the
    split ggml's integer dot products use (llama.cpp multiplies the float scales onto exact integer
    sums). c float32 (..., n) holds integers (code times integer sub-block scale, |c| < 2**13);
    d float32 (..., n / block); mn float32 (..., n / group) integers and dmin (..., n / block), both
    None for formats without a min. Found by decoding the blocks with d = 1, dmin = 0 and with
    d = 0, dmin = 1, so it shares the dequantizers' bit layouts. jit-able, ggml_type static."""
    qtype = _qtype(ggml_type)
    if qtype not in SCALE_FIELDS:
        raise ValueError(f"integer_parts: {qtype.name} has no integer dot product here "
                         f"(types: {', '.join(sorted(t.name for t in SCALE_FIELDS))})")
    d_off, m_off, group = SCALE_FIELDS[qtype]
    block, tsize = GGML_QUANT_SIZES[qtype]
    x = jnp.asarray(data)
    lead, n_blocks = x.shape[:-1], x.shape[-1] // tsize
    b = x.reshape(*lead, n_blocks, tsize)
    decode = _BLOCK_DECODERS[qtype]
    flat = lambda v: v.reshape(*lead, n_blocks * v.shape[-1])  # noqa: E731
    d = _f16(b, d_off)[..., 0]
    if m_off is None:
        return flat(decode(_with_fields(b, {d_off: _FP16_ONE}))), d, None, None
    c = flat(decode(_with_fields(b, {d_off: _FP16_ONE, m_off: (0, 0)})))
    mn = flat(decode(_with_fields(b, {d_off: (0, 0), m_off: _FP16_ONE})))[..., ::group]
    return c, d, mn, _f16(b, m_off)[..., 0]


# ---- numpy reference quantizers -----------------------------------------------------------------
def _f16_up(x: np.ndarray) -> np.ndarray:
    """Round non-negative float32 up to the next fp16, so that a scale derived from it is never too
    small to reach the largest code (rounding down would clip the extreme weight)."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b == 0 (an all-zero sub-block gets scale 0 and code 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b)).astype(np.float32)


def _super_scale(s: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales s >= 0 (nb, k) -> fp16 super-scale d (nb, 1) and integers ceil(s/d) in
    0..levels, so that d*int >= s (up to float rounding, which the final clip absorbs)."""
    d = _f16_up(s.max(axis=-1, keepdims=True) / levels)
    return d, np.clip(np.ceil(_div(s, d.astype(np.float32))), 0, levels).astype(np.uint8)


def _pack(parts: np.ndarray, width: int) -> np.ndarray:
    """Inverse of `_fields`: (nb, count, k) small ints -> (nb, k) bytes, part i at bits width*i."""
    shifts = (np.arange(parts.shape[-2], dtype=np.uint8) * width)[:, None]
    return np.bitwise_or.reduce(parts.astype(np.uint8) << shifts, axis=-2)


def _fp16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quant_minned(x: np.ndarray, sub: int, max_sc: int, max_q: int):
    """Shared K-quant "scale + min" encoder: x (nb, 256) -> d, dmin, sc, m, codes (nb, n_sub, sub).

    Each sub-block covers [-dmin*m, d*sc*max_q - dmin*m]; m is rounded up first so the low end
    reaches the sub-block minimum (clamped to <= 0, as ggml stores m >= 0), then sc is rounded
    up so the high end reaches the maximum."""
    xs = x.reshape(x.shape[0], -1, sub)
    m_need = np.maximum(-xs.min(axis=-1), 0)
    dmin, m = _super_scale(m_need, max_sc)
    offset = dmin.astype(np.float32) * m
    d, sc = _super_scale((xs.max(axis=-1) + offset) / max_q, max_sc)
    step = d.astype(np.float32) * sc
    q = np.clip(np.rint(_div(xs + offset[..., None], step[..., None])), 0, max_q).astype(np.uint8)
    return d, dmin, sc, m, q


def _quant_q2_k(x):
    d, dmin, sc, m, q = _quant_minned(x, 16, 15, 3)
    qs = _pack(q.reshape(-1, 2, 4, 32), 2).reshape(-1, 64)
    return np.concatenate([sc | (m << 4), qs, _fp16_bytes(d), _fp16_bytes(dmin)], axis=-1)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `_k4_scale_min`: two (nb, 8) 6-bit arrays -> (nb, 12) bytes."""
    a = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1)


def _quant_q4_k(x):
    d, dmin, sc, m, q = _quant_minned(x, 32, 63, 15)
    qs = _pack(q.reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_k4_scales(sc, m), qs], axis=-1)


def _quant_q5_k(x):
    d, dmin, sc, m, q = _quant_minned(x, 32, 63, 31)
    qs = _pack((q & 15).reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    qh = _pack(q >> 4, 1)  # (nb, 8 sub-blocks, 32) -> bit j of byte l
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_k4_scales(sc, m), qh, qs], axis=-1)


def _quant_q3_k(x):
    """Signed codes -4..3: a positive scale s reaches [-4s, 3s], a negative one [-3|s|, 4|s|];
    pick the sign that needs the smaller |s| for this sub-block's negative and positive extents."""
    xs = x.reshape(x.shape[0], 16, 16)
    neg, pos = np.maximum(-xs.min(axis=-1), 0), np.maximum(xs.max(axis=-1), 0)
    s_pos, s_neg = np.maximum(neg / 4, pos / 3), np.maximum(pos / 4, neg / 3)
    sign = np.where(s_pos <= s_neg, 1, -1).astype(np.int8)
    d, mag = _super_scale(np.minimum(s_pos, s_neg), 31)
    sc = sign * mag.astype(np.int8)
    step = d.astype(np.float32) * sc
    q = np.clip(np.rint(_div(xs, step[..., None])), -4, 3).astype(np.int8)
    u = (q + 4).astype(np.uint8).reshape(-1, QK_K)   # 0..7: low 2 bits | 3rd bit << 2
    qs = _pack((u & 3).reshape(-1, 2, 4, 32), 2).reshape(-1, 64)
    hmask = _pack((u >> 2).reshape(-1, 8, 32), 1)
    S = (sc + 32).astype(np.uint8)
    scales = np.concatenate([_pack(S.reshape(-1, 2, 8) & 15, 4), _pack((S >> 4).reshape(-1, 4, 4), 2)], -1)
    return np.concatenate([hmask, qs, scales, _fp16_bytes(d)], axis=-1)


def _quant_q6_k(x):
    """Codes -32..31 with a positive scale s = amax/31 (reaches [-32s, 31s] >= [-amax, amax])."""
    xs = x.reshape(x.shape[0], 16, 16)
    d, sc = _super_scale(np.abs(xs).max(axis=-1) / 31, 127)
    step = d.astype(np.float32) * sc
    q = np.clip(np.rint(_div(xs, step[..., None])), -32, 31).astype(np.int8)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (block, half, group g, lane l)
    ql = _pack((u & 15).reshape(-1, 2, 2, 64), 4)  # groups 0,1 -> low nibbles, 2,3 -> high
    qh = _pack(u >> 4, 2)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _fp16_bytes(d)], -1)


def _iq4_codes(xs: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest table index of each x / step (xs (..., 32), step (...)) as packed bytes (..., 16)."""
    v = _div(xs, step[..., None])
    q = np.abs(v[..., None] - IQ4_VALUES.astype(np.float32)).argmin(axis=-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _signed_extreme_scale(xs: np.ndarray) -> np.ndarray:
    """Per row of xs (..., 32): the scale that maps its largest-magnitude value to -127, the table's
    widest end (the other end is +113)."""
    idx = np.abs(xs).argmax(axis=-1)[..., None]
    return -np.take_along_axis(xs, idx, axis=-1)[..., 0] / 127


def _quant_iq4_nl(x):
    d = _signed_extreme_scale(x).astype(np.float16)
    return np.concatenate([_fp16_bytes(d), _iq4_codes(x, d.astype(np.float32))], axis=-1)


def _quant_iq4_xs(x):
    xs = x.reshape(x.shape[0], 8, 32)
    s = _signed_extreme_scale(xs)
    d = _f16_up(np.abs(s).max(axis=-1, keepdims=True) / 31)
    ls = np.clip(np.rint(_div(s, d.astype(np.float32))) + 32, 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * (ls.astype(np.float32) - 32)
    qs = _iq4_codes(xs, step).reshape(-1, 128)
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = np.bitwise_or.reduce(high, axis=-1).astype("<u2").reshape(-1, 1).view(np.uint8)
    scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return np.concatenate([_fp16_bytes(d), scales_h, scales_l, qs], axis=-1)


_K_ENCODERS = {T.Q2_K: _quant_q2_k, T.Q3_K: _quant_q3_k, T.Q4_K: _quant_q4_k, T.Q5_K: _quant_q5_k,
               T.Q6_K: _quant_q6_k, T.IQ4_NL: _quant_iq4_nl, T.IQ4_XS: _quant_iq4_xs}
_GGUF_PY_ENCODED = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})  # gguf-py quantizes these
QUANTIZE_TYPES = frozenset(_K_ENCODERS) | _GGUF_PY_ENCODED


def quantize_np(values, ggml_type) -> np.ndarray:
    """float values (..., n) -> uint8 blocks (..., n / block_size * type_size)."""
    qtype = _qtype(ggml_type)
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"no quantizer for ggml type {qtype.name} "
                         f"(have: {', '.join(sorted(t.name for t in QUANTIZE_TYPES))})")
    x = np.asarray(values, dtype=np.float32)
    block, tsize = GGML_QUANT_SIZES[qtype]
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"{qtype.name}: row length {x.shape[-1:]} is not a multiple of {block}")
    if not np.isfinite(x).all():
        raise ValueError(f"{qtype.name}: cannot quantize non-finite values")
    if qtype in _GGUF_PY_ENCODED:
        from gguf.quants import quantize
        return quantize(x, qtype)
    blocks = _K_ENCODERS[qtype](x.reshape(-1, block))
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // block * tsize)
