"""Q3_K expert weights kept quantised on the device, and the grouped matmul kernel that reads them.

Shapes: E experts, N output features, K input features (a multiple of 256), nb = K / 256 Q3_K
super-blocks per weight row, M routed rows, T tokens, D hidden size, F expert FFN size.

* `Q3KPlanes` / `q3k_planes_from_blocks(raw)`: GGUF Q3_K blocks (110-byte AoS, ggml layout, see
  shared/reference/qwen35moe/Q3_K.md) -> structure-of-arrays planes, per expert e and row n:
      qs [E, N, nb*64] uint8  low 2 bits of the codes (the block's `qs` bytes, unchanged)
      hm [E, N, nb*32] uint8  high bits (`hmask`, unchanged)
      sc [E, N, nb*16] uint8  the 12 packed 6-bit scale bytes, zero-padded to 16 (power of 2)
      d  [E, N, nb]    f16    super-block scale
  114 device bytes per 110 GGUF bytes (+3.6%). The planes are a byte re-arrangement: putting the
  fields back together gives the original blocks (`q3k_planes_to_blocks`), and decoding them in
  the kernel is bit-exact with `quants.dequantize`.
* `grouped_matmul_q3k(x, group_sizes, planes)`: rows of x sorted by expert, group e of
  group_sizes[e] rows -> x_g @ W_e^T. A Pallas kernel that decodes Q3_K in registers.
* `grouped_matmul_q3k_reference`: dequantize (quants.dequantize) + `jax.lax.ragged_dot`.
* the MoE FFN around them (routing, SwiGLU, the weighted sum): pantheon/pallas/moe.py.

Kernel layout. Rows are padded per expert to a multiple of the row tile `block_m`, so every row
tile belongs to one expert; a tile -> expert map (-1 for unused tiles) is an ordinary kernel input
(Triton has no scalar prefetch). Grid (row tiles, N / block_n); each program loops over the K
super-blocks, decodes the [block_n, 256] weights of one super-block in registers (broadcast shifts
and reshapes, no gathers) and accumulates x[:, block] . W^T in float32. Unused tiles run zero iterations and write zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from jax import lax
from jax.experimental import pallas as pl

from pantheon.gguf.quants import dequantize, integer_parts
from pantheon.gguf.arithmetic import IntBlocks, int_product
from pantheon.pallas.lowering import triton_params

QK = 256  # weights per Q3_K super-block
BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q3_K][1]  # 110
PLANE_BYTES = 64 + 32 + 16 + 2  # qs + hm + padded scales + d per super-block on the device


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Q3KPlanes:
    """Q3_K expert weights [E, N, K] as device planes (see the module docstring).

    qs: uint8 [E, N, nb*64]; hm: uint8 [E, N, nb*32]; sc: uint8 [E, N, nb*16]; d: float16 [E, N, nb].
    A pytree: jit/device_put/tree_map see the four arrays."""

    qs: jax.Array
    hm: jax.Array
    sc: jax.Array
    d: jax.Array

    @property
    def n_experts(self) -> int:
        return self.qs.shape[0]

    @property
    def n_out(self) -> int:
        return self.qs.shape[1]

    @property
    def n_blocks(self) -> int:
        return self.d.shape[2]

    @property
    def n_in(self) -> int:
        return self.n_blocks * QK

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the dequantised weight."""
        return (self.n_experts, self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        """Device bytes of the four planes."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (self.qs, self.hm, self.sc, self.d))

    @property
    def gguf_nbytes(self) -> int:
        """Bytes the same weights take as GGUF Q3_K blocks."""
        e, n, _ = self.shape
        return e * n * self.n_blocks * BLOCK_BYTES

    def validate(self, what: str = "Q3KPlanes"):
        e, n, nb = self.d.shape if self.d.ndim == 3 else (None, None, None)
        want = {"qs": ((e, n, nb * 64) if e else None, np.uint8), "hm": ((e, n, nb * 32) if e else None, np.uint8),
                "sc": ((e, n, nb * 16) if e else None, np.uint8), "d": ((e, n, nb) if e else None, np.float16)}
        for name, (shape, dtype) in want.items():
            a = getattr(self, name)
            if shape is None or tuple(a.shape) != shape or np.dtype(a.dtype) != dtype:
                raise ValueError(f"{what}: plane {name} is {np.dtype(a.dtype).name}{tuple(a.shape)}, expected "
                                 f"{np.dtype(dtype).name}{shape if shape else '[E, N, ...]'} (d: float16 [E, N, nb])")
        if nb == 0 or n == 0 or e == 0:
            raise ValueError(f"{what}: empty weight {self.shape}")


def block_rows(raw, size: int, what: str, type_name: str) -> np.ndarray:
    """GGUF rows uint8 [E, N, nb * size] (or [N, ...]: E = 1) -> their blocks [E, N, nb, size]."""
    raw = np.asarray(raw)
    if raw.ndim == 2:
        raw = raw[None]
    if raw.dtype != np.uint8 or raw.ndim != 3 or raw.shape[-1] == 0 or raw.shape[-1] % size:
        raise ValueError(f"{what}: expected uint8 [E, N, blocks * {size}] {type_name} rows, got {raw.dtype}{raw.shape}")
    e, n, row = raw.shape
    return raw.reshape(e, n, row // size, size)


def q3k_planes_from_blocks(raw) -> Q3KPlanes:
    """GGUF Q3_K tensor data -> Q3KPlanes (numpy arrays; `jax.device_put` the result).

    raw: uint8 [E, N, row_bytes], row_bytes = nb * 110, as `GGUFFile.tensor_data` returns an expert
    tensor (numpy view (n_expert, out, in_bytes)). A 2-D [N, row_bytes] weight gives E = 1."""
    b = block_rows(raw, BLOCK_BYTES, "q3k_planes_from_blocks", "Q3_K")
    e, n, nb, _ = b.shape
    sc = np.zeros((e, n, nb, 16), np.uint8)
    sc[..., :12] = b[..., 96:108]
    d = np.ascontiguousarray(b[..., 108:110]).view(np.float16)[..., 0]
    return Q3KPlanes(qs=np.ascontiguousarray(b[..., 32:96]).reshape(e, n, nb * 64),
                     hm=np.ascontiguousarray(b[..., 0:32]).reshape(e, n, nb * 32),
                     sc=sc.reshape(e, n, nb * 16), d=np.ascontiguousarray(d))


def q3k_planes_to_blocks(planes: Q3KPlanes) -> jax.Array:
    """Inverse of `q3k_planes_from_blocks` (jnp, jit-able): uint8 [E, N, nb*110] GGUF Q3_K rows."""
    e, n, _ = planes.shape
    nb = planes.n_blocks
    d = lax.bitcast_convert_type(jnp.asarray(planes.d), jnp.uint16)
    d_bytes = jnp.stack([(d & 0xFF).astype(jnp.uint8), (d >> 8).astype(jnp.uint8)], axis=-1)
    blocks = jnp.concatenate([jnp.asarray(planes.hm).reshape(e, n, nb, 32), jnp.asarray(planes.qs).reshape(e, n, nb, 64),
                              jnp.asarray(planes.sc).reshape(e, n, nb, 16)[..., :12], d_bytes], axis=-1)
    return blocks.reshape(e, n, nb * BLOCK_BYTES)


@jax.jit
def dequantize_planes(planes: Q3KPlanes) -> jax.Array:
    """float32 [E, N, K] weights via `quants.dequantize` of the reassembled GGUF blocks."""
    return dequantize(q3k_planes_to_blocks(planes), GGMLQuantizationType.Q3_K)


# ---- the kernel -------------------------------------------------------------------------------------
def _gmm_kernel(tile_ref, x_ref, *refs, n_blocks: int, n_experts: int, int_dot: bool):
    """One (row tile, column tile): tile_ref [1] int32 expert (-1: unused); x_ref [bm, K]; with
    int_dot an xs_ref [bm, nb] of per-block activation scales follows; qs/hm/sc/d refs [E, bn, ...]
    (every expert's rows of this column tile); o_ref [bm, bn].

    Per super-block the [bn, 256] weights are decoded with broadcasts and reshapes in the natural
    weight order n = 128*half + 32*j + l (Q3_K.md), then one [bm, 256] x [256, bn] dot. int_dot
    (Q8_K activations, llama.cpp's arithmetic): x holds integer codes, the dot runs against the
    integer weights (S - 32) * q, exact in f32 accumulation (|sum| <= 256*127*128 < 2**24), and
    is then scaled by d_x * d_w, as ggml_vec_dot_q3_K_q8_K does."""
    xs_ref, (qs_ref, hm_ref, sc_ref, d_ref, o_ref) = (refs[0], refs[1:]) if int_dot else (None, refs)
    expert = tile_ref[0]
    e = jnp.clip(expert, 0, n_experts - 1)
    trips = jnp.where(expert >= 0, n_blocks, 0)
    bm = x_ref.shape[0]
    bn = o_ref.shape[1]
    cdt = x_ref.dtype
    prec = lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else lax.Precision.DEFAULT
    iota = partial(lax.broadcasted_iota, jnp.int32)
    qs_shift = 2 * iota((1, 1, 4, 1), 2)  # low 2 bits of weight (half, j, l): qs[32*half + l] >> 2j
    hm_shift = 4 * iota((1, 2, 4, 1), 1) + iota((1, 2, 4, 1), 2)  # high bit: hm[l] >> (4*half + j)
    lo_shift = 4 * iota((1, 2, 8), 1)  # scale s low nibble: sc[s % 8] >> 4*(s // 8)
    hi_shift = 2 * iota((1, 4, 4), 1)  # scale s high 2 bits: sc[8 + s % 4] >> 2*(s // 4)

    def body(kb, acc):
        qs = qs_ref[e, :, pl.ds(kb * 64, 64)].astype(jnp.int32).reshape(bn, 2, 1, 32)
        hm = hm_ref[e, :, pl.ds(kb * 32, 32)].astype(jnp.int32).reshape(bn, 1, 1, 32)
        q = ((qs >> qs_shift) & 3) + 4 * ((hm >> hm_shift) & 1) - 4  # [bn, 2, 4, 32], -4..3
        lo = sc_ref[e, :, pl.ds(kb * 16, 8)].astype(jnp.int32).reshape(bn, 1, 8)
        hi = sc_ref[e, :, pl.ds(kb * 16 + 8, 4)].astype(jnp.int32).reshape(bn, 1, 4)
        scale = (((lo >> lo_shift) & 15).reshape(bn, 16) | (((hi >> hi_shift) & 3).reshape(bn, 16) << 4)) - 32
        d = d_ref[e, :, pl.ds(kb, 1)].astype(jnp.float32)  # [bn, 1]
        # ggml order: d * (S - 32) first, then * q (exact in f32); int_dot keeps d for after the sum
        dl = scale.astype(jnp.float32) if int_dot else d * scale.astype(jnp.float32)
        w = (dl.reshape(bn, 16, 1) * q.reshape(bn, 16, 16).astype(jnp.float32)).reshape(bn, QK)
        xb = x_ref[:, pl.ds(kb * QK, QK)]
        dot = lax.dot_general(xb, w.astype(cdt), (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32)
        if int_dot:
            dot = (xs_ref[:, pl.ds(kb, 1)] * d.reshape(1, bn)) * dot
        return acc + dot

    acc = lax.fori_loop(0, trips, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def pick_block_n(n: int, block_n: int, what: str = "grouped_matmul_q3k") -> int:
    """The column tile: block_n, halved until it divides n (a multiple of 16)."""
    bn = min(block_n, 1 << (n.bit_length() - 1))
    while bn >= 16 and n % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(f"{what}: output size {n} must be a multiple of 16")
    return bn


def gmm_padded(x_pad, tile_expert, planes: Q3KPlanes, *, block_n: int, interpret: bool, out_dtype,
                num_warps: int, num_stages: int, x_scale=None):
    """x_pad [n_tiles * bm, K] (tile i all expert tile_expert[i]) -> [n_tiles * bm, N]. x_scale:
    None, or f32 [n_tiles * bm, nb] Q8_K block scales of integer-coded x_pad (see _gmm_kernel)."""
    e, n, k = planes.shape
    if planes.qs.size >= 2 ** 31 or x_pad.size >= 2 ** 31:  # Triton's int32 element offsets
        raise ValueError(f"grouped_matmul_q3k: weights {planes.shape} or rows {x_pad.shape} exceed 2**31 elements")
    n_tiles = tile_expert.shape[0]
    bm = x_pad.shape[0] // n_tiles
    bn = pick_block_n(n, block_n)
    nb = planes.n_blocks
    int_dot = x_scale is not None
    kernel = partial(_gmm_kernel, n_blocks=nb, n_experts=e, int_dot=int_dot)
    plane_spec = lambda width: pl.BlockSpec((e, bn, width), lambda i, j: (0, j, 0))  # noqa: E731
    rows_spec = lambda width: pl.BlockSpec((bm, width), lambda i, j: (i, 0))  # noqa: E731
    x_specs, x_args = ([rows_spec(k), rows_spec(nb)], (x_pad, x_scale)) if int_dot else ([rows_spec(k)], (x_pad,))
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)), *x_specs,
                  plane_spec(nb * 64), plane_spec(nb * 32), plane_spec(nb * 16), plane_spec(nb)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((x_pad.shape[0], n), out_dtype),
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pantheon_grouped_matmul_q3k",
    )(tile_expert, *x_args, planes.qs, planes.hm, planes.sc, planes.d)


def row_layout(group_sizes, m: int, bm: int):
    """Padded row layout for rows sorted by expert.

    Returns (dest [m] int32: padded row of each sorted row, n_tiles*bm for rows past
    sum(group_sizes); tile_expert [n_tiles] int32, -1 for unused tiles; n_tiles static)."""
    e = group_sizes.shape[0]
    n_tiles = pl.cdiv(m, bm) + min(e, m)  # each non-empty group wastes < one tile
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.cumsum(sizes)
    padded = (sizes + bm - 1) // bm * bm
    pends = jnp.cumsum(padded)
    rows = jnp.arange(m, dtype=jnp.int32)
    grp = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # group of each sorted row
    g = jnp.minimum(grp, e - 1)
    dest = (pends[g] - padded[g]) + (rows - (ends[g] - sizes[g]))
    dest = jnp.where((grp < e) & (dest < n_tiles * bm), dest, n_tiles * bm)
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * bm
    te = jnp.searchsorted(pends, tile_start, side="right").astype(jnp.int32)
    tile_expert = jnp.where(te < e, te, -1)
    return dest, tile_expert, n_tiles


def default_block_m(m: int, n_experts: int) -> int:
    """Row tile: rows per expert on average, as a power of 2 in [16, 64]."""
    per = max(1, m // max(n_experts, 1))
    return int(min(64, max(16, 1 << (per - 1).bit_length())))


def _check_gmm_args(x, group_sizes, planes, what, x_scale=None):
    if not isinstance(planes, Q3KPlanes):
        raise ValueError(f"{what}: weights must be Q3KPlanes, got {type(planes).__name__}")
    planes.validate(what)
    e, n, k = planes.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [M, {k}] for weights {planes.shape} (E, N, K), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: x must be floating point, got {x.dtype}")
    if x_scale is not None and tuple(x_scale.shape) != (x.shape[0], planes.n_blocks):
        raise ValueError(f"{what}: x_scale must be [{x.shape[0]}, {planes.n_blocks}] (rows, super-blocks), "
                         f"got {tuple(x_scale.shape)}")
    if tuple(group_sizes.shape) != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{what}: group_sizes must be integer [{e}], got {group_sizes.dtype}{tuple(group_sizes.shape)}")


@partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps", "num_stages"))
def grouped_matmul_q3k(x: jax.Array, group_sizes: jax.Array, planes: Q3KPlanes, x_scale: jax.Array | None = None, *,
                       block_m: int | None = None, block_n: int = 64, interpret: bool = False, num_warps: int = 4,
                       num_stages: int = 2) -> jax.Array:
    """Grouped matmul against Q3_K expert weights, decoded inside a Pallas kernel.

    x: [M, K] float rows sorted by expert; group_sizes: int [E], rows group e = the next
    group_sizes[e] rows; planes: the weights W [E, N, K]. Returns [M, N] in x's dtype with
    out[rows of e] = x[rows of e] @ W_e^T (float32 accumulation; float32 x uses exact float32
    dots, 16-bit x multiplies weights rounded to x's dtype). Rows past sum(group_sizes) are 0.
    x_scale: None, or f32 [M, nb]: x holds Q8_K integer codes and x_scale their block scales
    (`moe.q8k_rows`); the product is then llama.cpp's (exact integer block sums times d_x * d_w).
    block_m: row tile (power of 2 >= 16; default from M/E); block_n: column tile (power of 2,
    >= 16, reduced until it divides N)."""
    _check_gmm_args(x, group_sizes, planes, "grouped_matmul_q3k", x_scale)
    m = x.shape[0]
    bm = default_block_m(m, planes.n_experts) if block_m is None else block_m
    if not (bm >= 16 and bm & (bm - 1) == 0):
        raise ValueError(f"grouped_matmul_q3k: block_m={bm} must be a power of 2 >= 16")
    if m == 0:
        return jnp.zeros((0, planes.n_out), x.dtype)
    dest, tile_expert, n_tiles = row_layout(group_sizes, m, bm)
    pad = lambda a: jnp.zeros((n_tiles * bm, a.shape[1]), a.dtype).at[dest].set(a, mode="drop")  # noqa: E731
    y = gmm_padded(pad(x), tile_expert, planes, block_n=block_n, interpret=interpret, out_dtype=x.dtype,
                    num_warps=num_warps, num_stages=num_stages, x_scale=None if x_scale is None else pad(x_scale))
    return jnp.take(y, dest, axis=0, mode="fill", fill_value=0)


@jax.jit
def grouped_matmul_q3k_reference(x: jax.Array, group_sizes: jax.Array, planes: Q3KPlanes,
                                 x_scale: jax.Array | None = None) -> jax.Array:
    """`grouped_matmul_q3k` in plain jnp: dequantize every expert (quants.dequantize, float32
    [E, N, K] — large for many experts) and `jax.lax.ragged_dot`; with x_scale, the integer block
    sums of arithmetic.int_product against the planes' integer parts (`planes_int_blocks`).
    Returns [M, N] in x's dtype."""
    _check_gmm_args(x, group_sizes, planes, "grouped_matmul_q3k_reference", x_scale)
    if x_scale is None:
        return lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(dequantize_planes(planes), 1, 2),
                              group_sizes.astype(jnp.int32), precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(x.dtype)
    codes = x.astype(jnp.float32).reshape(x.shape[0], planes.n_blocks, QK)
    return int_product(codes, x_scale[..., None], None, planes_int_blocks(planes), group_sizes).astype(x.dtype)


def planes_int_blocks(planes: Q3KPlanes) -> IntBlocks:
    """The planes as arithmetic.IntBlocks [E, K, N] (quants.integer_parts of the reassembled blocks)."""
    c, d, _, _ = integer_parts(q3k_planes_to_blocks(planes), GGMLQuantizationType.Q3_K)  # [E, N, K], [E, N, nb]
    return IntBlocks(jnp.swapaxes(c, 1, 2), jnp.swapaxes(d, 1, 2))
