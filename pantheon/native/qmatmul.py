"""Matrix products against weights kept in ggml's quant blocks, on the CPU.

XLA:CPU has no quantized matmul, and no int8/bf16 formulation of its own streams faster than f32
(research/jax_feasibility.md §4); but batch decode reads every weight once per token, so the bytes
read bound it: SmolLM2-135M is 538 MB as f32, 85 MB as its GGUF's Q4_1/Q8_0 blocks, which the
kernel reads as they are (the K-quants' super-blocks in kquants.h). `qmatmul` is an XLA FFI
custom call (qmatmul.cc) that reads the blocks inside the compiled program like any other op, in
one of two formulations: f32 activations times weights dequantized in registers ("exact"
numerics), or activations first rounded to 8-bit blocks and integer dot products, as llama.cpp's
CPU backend computes them ("llamacpp" numerics; ~1.5x less time per block). `qmatmul_reference` is the
same product in plain jnp (dequantize and einsum, or arithmetic.int_linear's integer arithmetic): the
kernel is tested against it.

Where the native library cannot be built (build.py: no compiler, no AVX2, PANTHEON_NATIVE=0),
`build.available()` is False and the models keep their f32 weights only."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.gguf.arithmetic import IntBlocks, int_linear
from pantheon.gguf.quants import SCALE_FIELDS, dequantize, integer_parts
from pantheon.native import build

TARGET = "pantheon_qmatmul"
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 1, 2, 3, 6, 7, 8, 30  # ggml type ids the kernel takes from a GGUF
IQ4_NL = 20  # Q4_0's layout, the nibbles index a table of 16 int8 values (gguf.quants.IQ4_VALUES)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14  # K-quants: 256-weight super-blocks (kquants.h)
IQ4_XS = 23  # read as a K-quant: eight 32-weight sub-blocks of IQ4_NL indices with 6-bit scales
K_TYPES = frozenset({Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS})
# A product of more rows than kernel_rows (a prefill chunk) is compute-bound: an f32 GEMM runs over
# the weights dequantized (layers.linear), on AVX-512 the native one (`qgemm`, a tile at a time),
# elsewhere XLA's over the matrix dequantized in the program; up to it the kernel reads the blocks.
# On AVX2 (8-wide, dequantize-and-XLA's GEMM): a 16-token chunk of the default model 71 -> 50 ms
# in the kernel; at 32 tokens the GEMM is ahead, 99 against 109 ms. A large matrix costs more to
# dequantize: from LARGE_MATRIX weights the kernel takes up to twice the rows.
KERNEL_MAX_ROWS = 16
LARGE_MATRIX = 1 << 22
# Where the fixed-point K-quant kernel runs (kquants.h; AVX-512 VNNI, exact numerics), `qgemm` takes
# over at (two Zen 5 threads, 8192 x 2048, kernel against qgemm): Q6_K at 32 / 48 / 64 rows 3.5 /
# 5.3 / 7.0 against 4.0 / 4.9 / 6.2 ms (2048 x 8192 K-tiled 3.8 / 5.6 against 4.1 / 5.0), so Q2_K,
# Q3_K and Q6_K from 32 rows ...
FIXED_KERNEL_ROWS = 32
# ... Q4_K/Q5_K, whose products from 12 rows (8 K-tiled) run as a GEMM over columns decoded once (kquants.h:
# fixed_gemm32), from 128: 128 / 192 / 256 rows 9.7 / 14.7 / 19.7 against 10.5 / 14.2 / 18.7 ms
# (2048 x 2048 at 128 / 192: 2.5 / 3.8 against 2.6 / 3.6) ...
GEMM_KERNEL_ROWS, GEMM_TYPES = 128, frozenset({Q4_K, Q5_K})
# ... as Q4_0/Q4_1 rows of a multiple of 256 weights, eight blocks read as one super-block
# (kquants.h: fixed_group; 16384 x 2048 Q4_0 at one row 1.06 -> 0.89 ms against the f32 kernel):
# at 96 / 128 / 192 rows 7.4 / 10.0 / 15.1 against 7.6 / 10.3 / 14.2 ms ...
GROUP_TYPES = frozenset({Q4_0, Q4_1})
# ... and the f32 kernels' row tiles (over blocks of columns, kquants.h: kColumnBlock) from 32: Q8_0 at
# 32 / 48 / 64 rows 3.3 / 4.8 / 6.5 against 3.5 / 4.5 / 5.6 ms, Q5_0 3.8 / 5.7 / 7.6 against 3.7 /
# 4.6 / 5.9.
WIDE_KERNEL_ROWS = 32


def kernel_rows(w: "QMatrix") -> int:
    """The most rows of f32 activations the kernel multiplies with w (more: an f32 GEMM)."""
    if not build.fixed_point():
        return 2 * KERNEL_MAX_ROWS if w.n_in * w.n_out >= LARGE_MATRIX else KERNEL_MAX_ROWS
    if (w.qtype in GROUP_TYPES and w.n_in % 256 == 0) or base_type(w.qtype) in GEMM_TYPES:
        return GEMM_KERNEL_ROWS
    return FIXED_KERNEL_ROWS if base_type(w.qtype) in TILEABLE else WIDE_KERNEL_ROWS


# Pantheon's own: d and m (fp16), then 32 unsigned codes, one per byte: Q4_1/Q5_1 unpacked (`unpack_nibbles`)
U4_1 = 1003
# Q2_K-Q6_K blocks K-tile-major (`tile_k`): type id + TILED. Tile i holds super-blocks
# [8 i, 8 i + len_i) of every row, row after row, so the fixed-point kernel (kquants.h, exact
# numerics on AVX-512 VNNI) reads a tile of a long row's matrix as one stream while x's part for it
# stays in L1: the same bytes, re-ordered. Loaded so for rows of >= TILE_MIN_IN weights.
TILED, TILE_BLOCKS, TILE_MIN_IN = 1000, 8, 4096
TILEABLE = frozenset({Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
# type id -> bytes per 32-weight block
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, U4_1: 36, F16: 64, BF16: 64, IQ4_NL: 18}
# K type id -> bytes per 256-weight super-block
SUPER_BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}
# The GGUF types the kernel reads, every one as the file holds it (F16/BF16 rows as blocks of 32
# with no scale, f32 activations only).
KERNEL_TYPES = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, IQ4_NL, *K_TYPES})


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class QMatrix:
    """A weight W [n_out, n_in] as ggml blocks: `blocks` uint8 [n_out, n_in / 32 * block bytes], each
    row the blocks of one output. qtype: a BLOCK_BYTES or SUPER_BLOCK_BYTES key (a ggml type id, or
    U4_1), or a K-tiled type (TILED)."""

    blocks: jax.Array
    qtype: int
    n_in: int

    @property
    def n_out(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    def tree_flatten(self):
        return (self.blocks,), (self.qtype, self.n_in)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def supported(ggml_type: int) -> bool:
    """Whether the kernel reads a GGUF matrix of this ggml type."""
    return int(ggml_type) in KERNEL_TYPES


def unpack_nibbles(blocks: np.ndarray, qtype: int, layout: dict) -> tuple[np.ndarray, int]:
    """Packed blocks with each code in its own byte, losslessly, per `layout`: Q4_0/Q5_0 -> Q8_0 (the
    code centred, as int8, the same scale), Q4_1/Q5_1 -> U4_1 (with d and m). The kernel reads the
    packed ones as the file holds them (splitting the codes in registers); the tests check that it
    reads them as these, bit for bit. blocks: uint8 [n_out, row bytes] -> (blocks, type)."""
    if layout.get(qtype, qtype) == qtype:
        return blocks, qtype
    head = 2 if qtype in (Q4_0, Q5_0) else 4  # d (and m), fp16
    b = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[qtype])
    five = qtype in (Q5_0, Q5_1)  # a u32 of fifth bits (bit j: weight j) before the nibbles
    qs = b[..., head + 4 * five:]
    values = np.concatenate([qs & 15, qs >> 4], axis=-1)  # low nibbles are weights 0-15, high 16-31
    if five:
        qh = np.ascontiguousarray(b[..., head:head + 4]).view("<u4")  # [..., 1]
        values |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    if qtype in (Q4_0, Q5_0):  # signed codes, centred: Q8_0 with the same scale
        values = (values.astype(np.int16) - (16 if five else 8)).astype(np.int8).view(np.uint8)
    out = np.concatenate([b[..., :head], values], axis=-1).reshape(blocks.shape[0], -1)
    return np.ascontiguousarray(out), layout[qtype]


def base_type(qtype: int) -> int:
    """The block type of a (possibly K-tiled) QMatrix type."""
    return qtype - TILED if qtype - TILED in TILEABLE else qtype


def _tiles(n_in: int) -> list[tuple[int, int]]:
    """The K tiles of a row of n_in weights: super-block ranges [j0, j1)."""
    nsb = n_in // 256
    return [(j, min(nsb, j + TILE_BLOCKS)) for j in range(0, nsb, TILE_BLOCKS)]


def tiles(w) -> bool:
    """Whether the fixed-point kernel reads w K-tiled (where it runs, with exact numerics): a 2-D
    Q2_K-Q6_K QMatrix of rows of >= TILE_MIN_IN weights."""
    return isinstance(w, QMatrix) and w.qtype in TILEABLE and w.blocks.ndim == 2 and w.n_in >= TILE_MIN_IN


def tile_k(w: QMatrix) -> QMatrix:
    """w's blocks K-tile-major (TILED): host numpy, at load. Only Q2_K-Q6_K, 2-D."""
    assert w.qtype in TILEABLE and w.blocks.ndim == 2, (w.qtype, w.blocks.shape)
    bb = SUPER_BLOCK_BYTES[w.qtype]
    b = np.asarray(w.blocks)
    return QMatrix(np.concatenate([b[:, j0 * bb:j1 * bb].reshape(-1) for j0, j1 in _tiles(w.n_in)]).reshape(b.shape),
                   w.qtype + TILED, w.n_in)


def untile_blocks(blocks, qtype: int):
    """K-tiled blocks [n_out, row bytes] back in row order (numpy or jnp; other types unchanged)."""
    if base_type(qtype) == qtype:
        return blocks
    bb = SUPER_BLOCK_BYTES[base_type(qtype)]
    n = blocks.shape[0]
    flat, xp = blocks.reshape(-1), (np if isinstance(blocks, np.ndarray) else jnp)
    parts = [flat[n * j0 * bb:n * j1 * bb].reshape(n, -1) for j0, j1 in _tiles(blocks.shape[1] // bb * 256)]
    return xp.concatenate(parts, axis=1)


def dequantize_blocks(blocks: jax.Array, qtype: int) -> jax.Array:
    """Blocks of any type the kernel reads -> f32 [..., n_in] (pantheon.gguf.quants for ggml's)."""
    if base_type(qtype) != qtype:
        return dequantize(untile_blocks(blocks, qtype), base_type(qtype))
    if qtype != U4_1:
        return dequantize(blocks, qtype)
    b = blocks.reshape(*blocks.shape[:-1], -1, BLOCK_BYTES[U4_1])
    d = jax.lax.bitcast_convert_type(b[..., 0:2], jnp.float16).astype(jnp.float32)[..., None]
    m = jax.lax.bitcast_convert_type(b[..., 2:4], jnp.float16).astype(jnp.float32)[..., None]
    return (d * b[..., 4:].astype(jnp.float32) + m).reshape(*blocks.shape[:-1], -1)


def dequantize_native(w: QMatrix, after: jax.Array | None = None) -> jax.Array:
    """W [n_out, n_in] f32 from its blocks, in the native kernel: the values `dequantize_blocks`
    (the jnp reference) gives, bit for bit, ~10x faster than XLA runs that one (a long prefill
    chunk dequantizes every matrix of the model once).

    after: an array the dequantization waits for (the kernel ignores its values). XLA runs
    operations that need no activations first: a layer's matrices would all be dequantized at the
    start of its program and held together (a 1 B layer: 233 MiB of f32, which the allocator then
    keeps); waiting for the matrix's own input bounds that to the matrix in use."""
    call = jax.ffi.ffi_call("pantheon_dequantize", jax.ShapeDtypeStruct((w.n_out, w.n_in), jnp.float32))
    dep = jnp.zeros((1,), jnp.float32) if after is None else after.reshape(-1)[:1].astype(jnp.float32)
    return call(w.blocks, dep, qtype=np.int64(w.qtype))


def qgemm(x: jax.Array, w: QMatrix) -> jax.Array:
    """x [..., n_in] f32 -> x W^T [..., n_out] for long prefill chunks (exact numerics; AVX-512 builds,
    build.gemm()): the native GEMM over weights dequantized a tile at a time (qmatmul.cc: QGemm), the
    values dequantize_native gives, never the whole matrix as f32. n_out a multiple of 32."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.n_in).astype(jnp.float32)
    call = jax.ffi.ffi_call("pantheon_qgemm", jax.ShapeDtypeStruct((x2.shape[0], w.n_out), jnp.float32))
    return call(x2, w.blocks, qtype=np.int64(w.qtype)).reshape(*lead, w.n_out)


def qmatmul(x: jax.Array, w: QMatrix, int8_activations: bool = False) -> jax.Array:
    """x [..., n_in] f32 -> x W^T [..., n_out], through the native kernel; with int8_activations,
    x rounded to 8-bit blocks first as ggml-cpu does: Q8_0 (Q8_1 against Q4_1/Q5_1/U4_1), Q8_K (per 256)
    against K-quants, then integer dot products."""
    if w.qtype not in BLOCK_BYTES and base_type(w.qtype) not in K_TYPES:
        raise ValueError(f"qmatmul reads F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, U4_1, IQ4_NL and K-quant blocks, "
                         f"not type {w.qtype}")
    if int8_activations and base_type(w.qtype) != w.qtype:
        raise ValueError("K-tiled blocks take f32 activations (exact numerics): load them untiled for llamacpp numerics")
    if int8_activations and w.qtype in (F16, BF16):
        raise ValueError("F16/BF16 weights take f32 activations (llamacpp numerics round them to f16/bf16 first)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.n_in).astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.n_out), jnp.float32))
    return call(x2, w.blocks, qtype=np.int64(w.qtype),
                int8_activations=np.int64(int8_activations)).reshape(*lead, w.n_out)


def expert_qmatmul(x: jax.Array, experts: jax.Array, w: QMatrix, int8_activations: bool = False,
                   gemm_rows: int = 0) -> jax.Array:
    """Routed experts read in place (qmatmul.cc: ExpertMatmul): row a = n k + j of the result is
    token n's j-th assignment, x's row times expert experts[n, j]'s matrix of the stacked experts'
    blocks w [X, n_out, row bytes] (no expert copied out). x: [N, n_in], a row per token (the gate
    and up products), or [N k, n_in], a row per assignment (the down product); experts: int [N, k].
    Returns [N k, n_out]. Each expert's rows are one product, the kernel that many rows take alone:
    from gemm_rows rows (0: never; f32 activations only, AVX-512 builds: the kernel takes the row
    kernels otherwise) the GEMM, as `qgemm`, else the row kernels, as `qmatmul`; trailing rows of
    zeros are zeros, not computed."""
    if w.blocks.ndim != 3 or base_type(w.qtype) != w.qtype:
        raise ValueError("expert_qmatmul takes stacked experts' blocks [X, n_out, row bytes], untiled")
    if w.qtype not in BLOCK_BYTES and w.qtype not in K_TYPES:
        raise ValueError(f"expert_qmatmul: no kernel reads type {w.qtype}")
    n, k = experts.shape
    call = jax.ffi.ffi_call("pantheon_expert_matmul", jax.ShapeDtypeStruct((n * k, w.blocks.shape[1]), jnp.float32))
    return call(x.astype(jnp.float32), experts.astype(jnp.int32), w.blocks, qtype=np.int64(w.qtype),
                int8_activations=np.int64(int8_activations), gemm_rows=np.int64(gemm_rows))


def expert_qmatmul_reference(x: jax.Array, experts: jax.Array, w: QMatrix, int8_activations: bool = False) -> jax.Array:
    """expert_qmatmul in plain jnp: each assignment's row through qmatmul_reference against its expert
    (every expert's product of every row, then each row's own: a test's reference, small X)."""
    n, k = experts.shape
    rows = jnp.repeat(x, k, axis=0) if x.shape[0] == n else x
    every = jnp.stack([qmatmul_reference(rows, QMatrix(w.blocks[e], w.qtype, w.n_in), int8_activations)
                       for e in range(w.blocks.shape[0])])  # [X, N k, n_out]: each row through every expert
    return jnp.take_along_axis(every, experts.reshape(1, -1, 1).astype(jnp.int32), axis=0)[0]


def qmatmul_reference(x: jax.Array, w: QMatrix, int8_activations: bool = False) -> jax.Array:
    """The product in plain jnp: dequantize the weights (pantheon.gguf.quants), einsum; with
    int8_activations, llama.cpp's integer arithmetic over the blocks' integer parts
    (arithmetic.int_linear: x rounded to Q8_0, or Q8_1 against Q4_1/Q5_1/U4_1, whose fp16 block sum multiplies
    the weight block's minimum)."""
    x = x.astype(jnp.float32)
    if int8_activations:
        return int_linear(x, int_blocks(w))  # K-quants: x rounded to Q8_K
    dense = dequantize_blocks(w.blocks, w.qtype).reshape(w.n_out, w.n_in)
    return jnp.einsum("...i,oi->...o", x, dense, precision=jax.lax.Precision.HIGHEST)


def int_blocks(w: QMatrix):
    """A QMatrix as arithmetic.IntBlocks [n_in, n_out] (jnp): w = d * c (+ m per block); K-quants and
    IQ4_NL through gguf.quants.integer_parts (their integer sub-block scales and mins, the table's
    values)."""
    if base_type(w.qtype) != w.qtype:
        w = QMatrix(untile_blocks(w.blocks, w.qtype), base_type(w.qtype), w.n_in)
    if w.qtype in K_TYPES or w.qtype in (IQ4_NL, Q5_0, Q5_1):  # traceable: integer_parts decodes in jnp
        c, d, mn, dmin = (None if a is None else a.T for a in integer_parts(w.blocks, w.qtype))
        return IntBlocks(c, d, mn, dmin, SCALE_FIELDS[w.qtype][2])
    b = w.blocks.reshape(w.n_out, w.n_in // 32, BLOCK_BYTES[w.qtype])
    fp16 = lambda lo: jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.float16).astype(jnp.float32).T  # noqa: E731
    nibbles = lambda qs: jnp.concatenate([qs & 15, qs >> 4], axis=-1)  # noqa: E731 - weights 0-15, then 16-31
    if w.qtype in (Q8_0, Q4_0):  # d, then 32 x int8 (Q4_0: 16 bytes of nibbles, code - 8)
        c = (jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32) if w.qtype == Q8_0
             else nibbles(b[..., 2:]).astype(jnp.float32) - 8)
        return IntBlocks(c.reshape(w.n_out, w.n_in).T, fp16(0))
    # U4_1 / Q4_1: d, m, then 32 x u8 (or 16 bytes of nibbles); the min term is m * 1 per block
    codes = b[..., 4:] if w.qtype == U4_1 else nibbles(b[..., 4:])
    c = codes.reshape(w.n_out, w.n_in).astype(jnp.float32).T
    return IntBlocks(c, fp16(0), jnp.ones((w.n_in // 32, w.n_out), jnp.float32), fp16(2), group=32)


def embed_rows(w: QMatrix, ids: jax.Array) -> jax.Array:
    """Rows `ids` of W, dequantized: the embedding lookup of a tied, quantized head."""
    blocks = untile_blocks(w.blocks, w.qtype)  # (a tiled matrix is never an embedding; correct all the same)
    return dequantize_blocks(jnp.take(blocks, ids, axis=0), base_type(w.qtype))
