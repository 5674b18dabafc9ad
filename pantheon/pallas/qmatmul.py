"""Weights kept in their GGUF quant blocks on the GPU, and the Pallas matmul that decodes them.

Shapes: E matrices (experts; 1 for a dense weight), N output features, K input features, U the
weights a kernel step decodes (256 for the K-quants; for Q8_0/Q4_0 the largest of 256, 128, 64, 32
that divides K), nu = K / U steps a row, M rows.

* `QPlanes` / `planes_from_blocks(raw, qtype)`: GGUF blocks [E, N, row bytes] -> structure-of-arrays
  planes, each [E, N, nu * width] with a power-of-2 width (Triton loads power-of-2 shapes only):
      Q8_0  qs int8 [32 a block] | d f16 [1 a block]                            34 bytes of 34
      Q4_0  qs [16 a block] (nibbles) | d f16                                   18 of 18
      Q4_K  qs [128] | sc [16] (the 12 scale bytes, zero-padded) | dm f16 [2] (d, dmin)  148 of 144
      Q5_K  qs [128] | qh [32] | sc [16] | dm f16 [2]                           180 of 176
      Q6_K  ql [128] | qh [64] | sc int8 [16] | d f16 [1]                       210 of 210
  (at most 2.8 % over the file's bytes). `planes_to_blocks` puts the bytes back together: the
  planes are a re-arrangement, and the reference decodes the reassembled blocks.
* `grouped_qmatmul(x, group_sizes, planes)`: rows of x sorted by expert, group e of group_sizes[e]
  rows -> x_g @ W_e^T; `qmatmul(x, planes)` the dense product (one group). A Pallas kernel: grid
  (row tiles, N / block_n), each program loops over the K steps, decodes the [block_n, U] weights
  of one step in registers (broadcast shifts and reshapes, no gathers, as `moe_q3k` decodes Q3_K)
  and accumulates x[:, step] . W^T in float32.
* `grouped_qmatmul_reference` / `qmatmul_reference`: `quants.dequantize` of the reassembled blocks,
  then `lax.ragged_dot` / a dot. The kernel is tested against them in interpret mode on random
  blocks of every type, and lowered for CUDA in CI (tests/pallas/test_lowering.py).

Decode order is ggml's: K-quants (d * sc) * q - (dmin * m); Q6_K (d * sc) * q; Q8_0 q * d;
Q4_0 (q - 8) * d — the reference's values (a GPU compiler may fuse a multiply-add: one rounding)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl

from pantheon.gguf.quants import dequantize
from pantheon.pallas.lowering import triton_params
from pantheon.pallas.moe_q3k import block_rows, default_block_m, pick_block_n, row_layout

# qtype -> planes: (name, bytes a GGUF block contributes, dtype) in the order QPlanes holds them
LAYOUT = {
    T.Q8_0: (("qs", 32, np.int8), ("d", 2, np.float16)),
    T.Q4_0: (("qs", 16, np.uint8), ("d", 2, np.float16)),
    T.Q4_K: (("qs", 128, np.uint8), ("sc", 16, np.uint8), ("dm", 4, np.float16)),
    T.Q5_K: (("qs", 128, np.uint8), ("qh", 32, np.uint8), ("sc", 16, np.uint8), ("dm", 4, np.float16)),
    T.Q6_K: (("ql", 128, np.uint8), ("qh", 64, np.uint8), ("sc", 16, np.int8), ("d", 2, np.float16)),
}
TYPES = frozenset(LAYOUT)
K_TYPES = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})


def _block(qtype: T) -> tuple[int, int]:
    """(weights, bytes) of one GGUF block."""
    return GGML_QUANT_SIZES[qtype]


def step_weights(qtype: T, n_in: int) -> int:
    """U: the weights one kernel step decodes (a power of 2 dividing n_in)."""
    if qtype in K_TYPES:
        return 256
    for u in (256, 128, 64, 32):
        if n_in % u == 0:
            return u
    raise ValueError(f"{qtype.name}: {n_in} inputs is not a multiple of 32")


@partial(jax.tree_util.register_dataclass, data_fields=["planes"], meta_fields=["qtype", "n_in", "compute"])
@dataclass(frozen=True)
class QPlanes:
    """Weights W [E, N, K] of GGUF type `qtype` as device planes (see the module docstring): one
    array [E, N, K / block weights * plane width] per LAYOUT entry (f16 planes count in halves).
    compute: the dtype the model's activations enter the product in (bfloat16 on a GPU)."""

    planes: tuple
    qtype: int = field(default=int(T.Q8_0))
    n_in: int = 0
    compute: str = "float32"

    @property
    def type(self) -> T:
        return T(self.qtype)

    @property
    def n_experts(self) -> int:
        return self.planes[0].shape[0]

    @property
    def n_out(self) -> int:
        return self.planes[0].shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_experts, self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self.planes)

    @property
    def gguf_nbytes(self) -> int:
        weights, size = _block(self.type)
        return self.n_experts * self.n_out * self.n_in // weights * size


def holds(ggml_type, shape) -> bool:
    """Whether a GGUF tensor of this type and shape (numpy order) stays in blocks on a GPU: a matrix
    [out, in] or experts [X, out, in] of a type the kernel reads, whose rows tile by 16."""
    return len(shape) in (2, 3) and ggml_type in TYPES and shape[-2] % 16 == 0


def plane_bytes(qtype, gguf_bytes: int) -> int:
    """The device bytes of planes holding `gguf_bytes` of qtype's blocks (for admission)."""
    qtype = T(qtype)
    return gguf_bytes * sum(width for _, width, _ in LAYOUT[qtype]) // _block(qtype)[1]


def planes_from_blocks(raw, qtype, compute: str = "float32") -> QPlanes:
    """GGUF rows uint8 [E, N, row bytes] (or [N, row bytes]: E = 1) of type qtype -> QPlanes of
    numpy arrays (`jax.device_put` the result); compute: QPlanes.compute."""
    qtype = T(qtype)
    if qtype not in LAYOUT:
        raise ValueError(f"planes_from_blocks: no GPU kernel reads {qtype.name} (types: "
                         f"{', '.join(sorted(t.name for t in TYPES))})")
    weights, size = _block(qtype)
    b = block_rows(raw, size, "planes_from_blocks", qtype.name)
    e, n, nb, _ = b.shape
    fields = {name: b[..., at:at + used] for name, (at, used) in _OFFSETS[qtype].items()}
    planes = []
    for name, width, dtype in LAYOUT[qtype]:
        part = fields[name]
        if part.shape[-1] < width:  # zero padding to the plane's power-of-2 width
            part = np.concatenate([part, np.zeros((*part.shape[:-1], width - part.shape[-1]), np.uint8)], -1)
        planes.append(np.ascontiguousarray(part).view(dtype).reshape(e, n, -1))
    return QPlanes(tuple(planes), int(qtype), nb * weights, compute)


# where each field sits in a GGUF block (start byte), and how many bytes of its plane it fills
_OFFSETS = {
    T.Q8_0: {"d": (0, 2), "qs": (2, 32)},
    T.Q4_0: {"d": (0, 2), "qs": (2, 16)},
    T.Q4_K: {"dm": (0, 4), "sc": (4, 12), "qs": (16, 128)},
    T.Q5_K: {"dm": (0, 4), "sc": (4, 12), "qh": (16, 32), "qs": (48, 128)},
    T.Q6_K: {"ql": (0, 128), "qh": (128, 64), "sc": (192, 16), "d": (208, 2)},
}


def planes_to_blocks(p: QPlanes) -> jax.Array:
    """Inverse of `planes_from_blocks` (jnp, jit-able): uint8 [E, N, row bytes] GGUF rows."""
    qtype = p.type
    e, n, k = p.shape
    weights, size = _block(qtype)
    nb = k // weights
    parts = {}
    for (name, width, _), a in zip(LAYOUT[qtype], p.planes):
        a = jnp.asarray(a)
        if a.dtype != jnp.uint8:
            a = lax.bitcast_convert_type(a, jnp.uint8)  # [..., items, itemsize] for 16-bit planes
        parts[name] = a.reshape(e, n, nb, width)
    order = sorted(_OFFSETS[qtype].items(), key=lambda kv: kv[1][0])
    blocks = jnp.concatenate([parts[name][..., :used] for name, (_, used) in order], axis=-1)
    assert blocks.shape[-1] == size
    return blocks.reshape(e, n, nb * size)


@jax.jit
def dequantize_planes(p: QPlanes) -> jax.Array:
    """float32 [E, N, K] weights: quants.dequantize of the reassembled GGUF blocks."""
    return dequantize(planes_to_blocks(p), p.type)


def embed_rows(p: QPlanes, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` (any int shape) of a [V, E] weight held as planes (E = 1), dequantized:
    float32 [*tokens.shape, E] — the embedding lookup of a table the head also multiplies."""
    ids = tokens.reshape(-1)
    rows = dataclasses.replace(p, planes=tuple(jnp.take(jnp.asarray(a)[0], ids, axis=0)[None] for a in p.planes))
    return dequantize_planes(rows)[0].reshape(*tokens.shape, p.n_in)


# ---- decoding one step of [bn, U] weights inside the kernel -----------------------------------------
def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _load(ref, e, start, size):
    return ref[e, :, pl.ds(start, size)]


def _decode(qtype: T, refs, e, kb, bn: int, u: int) -> jax.Array:
    """Step kb's weights [bn, U] f32 (natural weight order) of expert e from the plane refs."""
    f32 = jnp.float32
    if qtype == T.Q8_0:
        qs_ref, d_ref = refs
        g = u // 32
        q = _load(qs_ref, e, kb * u, u).astype(f32).reshape(bn, g, 32)
        d = _load(d_ref, e, kb * g, g).astype(f32).reshape(bn, g, 1)
        return (q * d).reshape(bn, u)
    if qtype == T.Q4_0:
        qs_ref, d_ref = refs
        g = u // 32
        qs = _load(qs_ref, e, kb * 16 * g, 16 * g).astype(jnp.int32).reshape(bn, g, 1, 16)
        q = (qs >> (4 * _iota((1, 1, 2, 1), 2))) & 15  # weight i < 16: low nibble of byte i, else high of i - 16
        d = _load(d_ref, e, kb * g, g).astype(f32).reshape(bn, g, 1)
        return ((q.reshape(bn, g, 32).astype(f32) - 8.0) * d).reshape(bn, u)
    if qtype in (T.Q4_K, T.Q5_K):
        qs_ref, *mid, sc_ref, dm_ref = refs
        qs = _load(qs_ref, e, kb * 128, 128).astype(jnp.int32).reshape(bn, 4, 1, 32)
        q = ((qs >> (4 * _iota((1, 1, 2, 1), 2))) & 15).reshape(bn, 8, 32)  # sub-block 2c + h, weight l
        if qtype == T.Q5_K:
            qh = _load(mid[0], e, kb * 32, 32).astype(jnp.int32).reshape(bn, 1, 32)
            q = q | (((qh >> _iota((1, 8, 1), 1)) & 1) << 4)  # bit s of byte l: weight l of sub-block s
        a = _load(sc_ref, e, kb * 16, 4).astype(jnp.int32).reshape(bn, 1, 4)  # sc0-3 | high bits of 4-7
        m = _load(sc_ref, e, kb * 16 + 4, 4).astype(jnp.int32).reshape(bn, 1, 4)  # m0-3 | high bits
        c = _load(sc_ref, e, kb * 16 + 8, 4).astype(jnp.int32).reshape(bn, 1, 4)  # low nibbles of sc4-7, m4-7
        high = _iota((1, 2, 4), 1) == 1  # sub-blocks 4-7
        sc = jnp.where(high, (c & 15) | ((a >> 6) << 4), a & 63).reshape(bn, 8)
        mn = jnp.where(high, (c >> 4) | ((m >> 6) << 4), m & 63).reshape(bn, 8)
        d = _load(dm_ref, e, kb * 2, 1).astype(f32)  # [bn, 1]
        dmin = _load(dm_ref, e, kb * 2 + 1, 1).astype(f32)
        dl, ml = d * sc.astype(f32), dmin * mn.astype(f32)
        return (dl.reshape(bn, 8, 1) * q.astype(f32) - ml.reshape(bn, 8, 1)).reshape(bn, 256)
    ql_ref, qh_ref, sc_ref, d_ref = refs  # Q6_K
    ql = _load(ql_ref, e, kb * 128, 128).astype(jnp.int32).reshape(bn, 2, 1, 64)
    low = (ql >> (4 * _iota((1, 1, 2, 1), 2))) & 15  # half h, nibble n, byte k: weight 128h + 64n + k
    qh = _load(qh_ref, e, kb * 64, 64).astype(jnp.int32).reshape(bn, 2, 1, 32)
    high = (qh >> (2 * _iota((1, 1, 4, 1), 2))) & 3  # half h, crumb g, byte l: weight 128h + 32g + l
    q = (low.reshape(bn, 16, 16) | (high.reshape(bn, 16, 16) << 4)).astype(f32) - 32.0
    sc = _load(sc_ref, e, kb * 16, 16).astype(f32)  # int8 scale per 16 weights
    d = _load(d_ref, e, kb, 1).astype(f32)
    return ((d * sc).reshape(bn, 16, 1) * q).reshape(bn, 256)


def _kernel(tile_ref, x_ref, *refs, qtype: T, steps: int, u: int, n_experts: int):
    """One (row tile, column tile): tile_ref [1] int32 expert (-1: unused); x_ref [bm, K]; the
    plane refs [E, bn, ...] (every expert's rows of this column tile); o_ref [bm, bn]."""
    *planes, o_ref = refs
    expert = tile_ref[0]
    e = jnp.clip(expert, 0, n_experts - 1)
    trips = jnp.where(expert >= 0, steps, 0)
    bm, bn = o_ref.shape
    cdt = x_ref.dtype
    prec = lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else lax.Precision.DEFAULT

    def body(kb, acc):
        w = _decode(qtype, planes, e, kb, bn, u)
        xb = x_ref[:, pl.ds(kb * u, u)]
        return acc + lax.dot_general(xb, w.astype(cdt), (((1,), (1,)), ((), ())), precision=prec,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, trips, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _padded(x_pad, tile_expert, p: QPlanes, *, block_n, interpret, out_dtype, num_warps, num_stages):
    e, n, k = p.shape
    qtype = p.type
    if any(a.size >= 2 ** 31 for a in p.planes) or x_pad.size >= 2 ** 31:  # Triton's int32 offsets
        raise ValueError(f"grouped_qmatmul: weights {p.shape} or rows {x_pad.shape} exceed 2**31 elements")
    n_tiles = tile_expert.shape[0]
    bm = x_pad.shape[0] // n_tiles
    bn = pick_block_n(n, block_n, "grouped_qmatmul")
    u = step_weights(qtype, k)
    kernel = partial(_kernel, qtype=qtype, steps=k // u, u=u, n_experts=e)
    plane_specs = [pl.BlockSpec((e, bn, a.shape[2]), lambda i, j: (0, j, 0)) for a in p.planes]
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)), pl.BlockSpec((bm, k), lambda i, j: (i, 0)), *plane_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((x_pad.shape[0], n), out_dtype),
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"pantheon_qmatmul_{qtype.name.lower()}",
    )(tile_expert, x_pad, *p.planes)


def _check(x, group_sizes, p, what):
    if not isinstance(p, QPlanes):
        raise ValueError(f"{what}: weights must be QPlanes, got {type(p).__name__}")
    if p.type not in LAYOUT:
        raise ValueError(f"{what}: no kernel for {p.type.name}")
    e, n, k = p.shape
    weights, _ = _block(p.type)
    for (name, width, dtype), a in zip(LAYOUT[p.type], p.planes):
        items = width // np.dtype(dtype).itemsize
        if tuple(a.shape) != (e, n, k // weights * items) or np.dtype(a.dtype) != np.dtype(dtype):
            raise ValueError(f"{what}: plane {name} is {np.dtype(a.dtype).name}{tuple(a.shape)}, expected "
                             f"{np.dtype(dtype).name}{(e, n, k // weights * items)}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [M, {k}] for weights {p.shape} (E, N, K), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: x must be floating point, got {x.dtype}")
    if group_sizes is not None and (tuple(group_sizes.shape) != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
        raise ValueError(f"{what}: group_sizes must be integer [{e}], got {group_sizes.dtype}{tuple(group_sizes.shape)}")


@partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps", "num_stages", "out_dtype"))
def grouped_qmatmul(x: jax.Array, group_sizes: jax.Array, p: QPlanes, *, block_m: int | None = None,
                    block_n: int = 64, interpret: bool = False, num_warps: int = 4, num_stages: int = 2,
                    out_dtype=None) -> jax.Array:
    """Grouped matmul against quantized weights decoded inside a Pallas kernel.

    x: [M, K] float rows sorted by expert; group_sizes: int [E]; p: W [E, N, K]. Returns [M, N] in
    out_dtype (default x's), out[rows of e] = x[rows of e] @ W_e^T (float32 accumulation; float32 x uses exact
    float32 dots, 16-bit x multiplies weights rounded to its dtype). Rows past sum(group_sizes)
    are 0. block_m: row tile (power of 2 >= 16; default from M/E); block_n: column tile."""
    _check(x, group_sizes, p, "grouped_qmatmul")
    m = x.shape[0]
    bm = default_block_m(m, p.n_experts) if block_m is None else block_m
    if not (bm >= 16 and bm & (bm - 1) == 0):
        raise ValueError(f"grouped_qmatmul: block_m={bm} must be a power of 2 >= 16")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if m == 0:
        return jnp.zeros((0, p.n_out), out_dtype)
    dest, tile_expert, n_tiles = row_layout(group_sizes, m, bm)
    x_pad = jnp.zeros((n_tiles * bm, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    y = _padded(x_pad, tile_expert, p, block_n=block_n, interpret=interpret, out_dtype=out_dtype,
                num_warps=num_warps, num_stages=num_stages)
    return jnp.take(y, dest, axis=0, mode="fill", fill_value=0)


@partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps", "num_stages", "out_dtype"))
def qmatmul(x: jax.Array, p: QPlanes, *, block_m: int = 16, block_n: int = 64, interpret: bool = False,
            num_warps: int = 4, num_stages: int = 2, out_dtype=None) -> jax.Array:
    """x [M, K] @ W^T for a dense quantized weight (E = 1): [M, N] in out_dtype (default x's). Rows are tiled by
    block_m (decode: one 16-row tile, the weights read once)."""
    _check(x, None, p, "qmatmul")
    if p.n_experts != 1:
        raise ValueError(f"qmatmul: a dense weight has one matrix, got {p.n_experts} (use grouped_qmatmul)")
    m = x.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if m == 0:
        return jnp.zeros((0, p.n_out), out_dtype)
    n_tiles = pl.cdiv(m, block_m)
    x_pad = jnp.zeros((n_tiles * block_m, x.shape[1]), x.dtype).at[:m].set(x)
    y = _padded(x_pad, jnp.zeros((n_tiles,), jnp.int32), p, block_n=block_n, interpret=interpret,
                out_dtype=out_dtype, num_warps=num_warps, num_stages=num_stages)
    return y[:m]


@jax.jit
def grouped_qmatmul_reference(x: jax.Array, group_sizes: jax.Array, p: QPlanes) -> jax.Array:
    """`grouped_qmatmul` in plain jnp: every expert dequantized (float32 [E, N, K]), lax.ragged_dot."""
    _check(x, group_sizes, p, "grouped_qmatmul_reference")
    return lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(dequantize_planes(p), 1, 2),
                          group_sizes.astype(jnp.int32), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32).astype(x.dtype)


@jax.jit
def qmatmul_reference(x: jax.Array, p: QPlanes) -> jax.Array:
    """`qmatmul` in plain jnp: the weight dequantized (float32 [N, K]) and one dot."""
    _check(x, None, p, "qmatmul_reference")
    return jnp.dot(x.astype(jnp.float32), dequantize_planes(p)[0].T,
                   precision=lax.Precision.HIGHEST).astype(x.dtype)
