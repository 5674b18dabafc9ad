"""Small pure functions the model files are built from. Shapes in comments:
B batch rows, T tokens per row, S attended cache positions, H query heads, K kv heads,
G = H / K query heads per kv head, D head dim."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pantheon.gguf.arithmetic import NONE, Q8_0, Q8_K, IntBlocks, int_linear, quantize_activations, silu
from pantheon.model.rope_scaling import RopeScaling
from pantheon.model.spec import ROPE_NEOX, ROPE_NORM
from pantheon.native import build
from pantheon.native.qmatmul import QMatrix, dequantize_native, expert_qmatmul, kernel_rows, qgemm, qmatmul
from pantheon.pallas import dispatch
from pantheon.pallas.qmatmul import QPlanes
# Causal GQA attention: q [B, T, H, D], keys/values [B, S, K, D], q_pos [B, T] -> [B, T, H, D]. One
# implementation, beside its Pallas kernels (pantheon/pallas/attention.py).
from pantheon.pallas.attention import attention_reference as gqa_attention  # noqa: F401


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * weight


def rope_angles(positions: jax.Array, base: float, n_rot: int, scaling: RopeScaling | None = None) -> jax.Array:
    """The n_rot/2 rotation angles per position [..., n_rot/2]: p * base^(-2k/n_rot), then the file's
    scaling. (ggml's rope cache multiplies its way up, theta_{k+1} = theta_k * base^(-2/n_rot), one f32
    rounding a step: emulated exactly, that cost 64 unfused multiplies per layer and moved a 256-wide
    head's logits by < 1e-3, so the closed form stays.)"""
    inv_freq = base ** (-jnp.arange(0, n_rot, 2, dtype=jnp.float32) / n_rot)  # [n_rot/2]
    angle = positions.astype(jnp.float32)[..., None] * inv_freq
    return angle if scaling is None else scaling.scale(angle)


def rope(x: jax.Array, positions: jax.Array, base: float, n_rot: int, style: str,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding on the first `n_rot` dims of each head. x: [B, T, n_heads, D]; positions: [B, T]."""
    d = x.shape[-1]
    angle = rope_angles(positions, base, n_rot, scaling)[..., None, :]  # [B, T, 1, n_rot/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if scaling is not None and scaling.magnitude != 1.0:
        cos, sin = cos * scaling.magnitude, sin * scaling.magnitude
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if style == ROPE_NORM:  # adjacent pairs
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    elif style == ROPE_NEOX:  # halves
        a, b = rot[..., : n_rot // 2], rot[..., n_rot // 2:]
        rot = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return rot if n_rot == d else jnp.concatenate([rot, rest], axis=-1)


def swiglu(x, w_gate, w_up, w_down, schemes=(NONE, NONE, NONE)) -> jax.Array:
    """Weights are [in, out]; schemes: activation rounding per weight."""
    return swiglu_down(linear(x, w_gate, schemes[0]), linear(x, w_up, schemes[1]), w_down, schemes[2])


def swiglu_down(gate, up, w_down, scheme: str = NONE) -> jax.Array:
    """The SwiGLU after its gate and up projections (computed apart, or as one fused product)."""
    return linear(silu(gate) * up, w_down, scheme)


def linear(x: jax.Array, w: jax.Array | QMatrix | QPlanes | IntBlocks, scheme: str = NONE) -> jax.Array:
    """y = x W with W stored [in, out] (or a QMatrix: quant blocks [out, in], read by the native
    kernel; QPlanes: the blocks on a GPU, read by the Pallas kernel; or IntBlocks, llama.cpp's
    integer arithmetic in jnp); x is first rounded per `scheme`
    (see numerics.py). A bf16 W takes bf16 operands and accumulates in f32 (model/dtypes.py); the
    result is f32 either way."""
    if isinstance(w, QMatrix):
        rows = math.prod(x.shape[:-1])
        # Long exact prefill chunks are compute-bound: an f32 GEMM over the dequantized weights.
        # Rounded activations always go through the kernel, however many rows: its integer dot
        # products are llama.cpp's own arithmetic, row by row, where an f32 GEMM over the same
        # rounded activations sums in another order and flips roundings downstream (a Q8_0 qwen3
        # 62-token prompt: 0.12 from llama.cpp's log-probs through the GEMM, 4e-7 here).
        if scheme == NONE and rows > kernel_rows(w):
            if native_gemm(w):
                return qgemm(x, w)
            dense = dequantize_native(w, after=x).T  # [in, out], as f32 weights are held
            return jnp.einsum("...i,io->...o", x, dense, preferred_element_type=jnp.float32)
        # the kernel rounds x itself (Q8_0/Q8_1, or Q8_K against K-quants) and sums integer dots;
        # against F16/BF16 rows llama.cpp rounds x to their type, then multiplies in f32
        int8 = scheme in (Q8_0, Q8_K)
        return qmatmul(x if int8 else quantize_activations(x, scheme), w, int8_activations=int8)
    if isinstance(w, QPlanes):  # blocks on the GPU: the Pallas kernel decodes them (dispatch: qmatmul)
        h = quantize_activations(x, scheme).astype(w.compute)
        y = dispatch.quantized_matmul(h.reshape(-1, x.shape[-1]), w)
        return y.reshape(*x.shape[:-1], w.n_out)
    if isinstance(w, IntBlocks):  # loaded for llamacpp numerics: rounds x itself
        return int_linear(x, w)
    x = quantize_activations(x, scheme)
    return jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def native_gemm(w) -> bool:
    """Whether long exact chunks multiply w through the native GEMM, a tile of its blocks dequantized
    at a time (AVX-512 builds). Like the row-tile kernels of short chunks, it leaves x's trailing
    rows of zeros (a chunk's padding, llama.block) out of the arithmetic (native/common.h:
    live_rows); dequantized f32 weights under XLA's GEMM (the AVX2 build) and a GPU's kernels
    compute every row."""
    return isinstance(w, QMatrix) and build.gemm() and w.n_out % 32 == 0


# ---- routed experts (qwen35moe's non-Q3_K experts, qwen3moe, llama with experts) ------------------------
def _rows_per_block(assignments: int, n_expert: int) -> int:
    """Block height for grouped expert matmuls: about the mean rows per expert (power of two, <= 64)."""
    mean = max(1, assignments // n_expert)
    return min(64, 1 << (mean.bit_length() - 1))


def expert(w, e):
    """Expert e's matrix of stacked experts: f32 [X, in, out] -> [in, out], or a QMatrix of blocks
    [X, out, row bytes] -> the QMatrix of expert e's rows (read by the kernel)."""
    if isinstance(w, QMatrix):
        return QMatrix(jax.lax.dynamic_index_in_dim(w.blocks, e, 0, keepdims=False), w.qtype, w.n_in)
    return w[e]


def grouped_experts(x, experts, w_gate, w_up, w_down, schemes):
    """Every token through each of its chosen experts. x: [N, E]; experts: [N, k] ids;
    w_gate/w_up: [X, E, F]; w_down: [X, F, E] (or QMatrix blocks [X, out, row bytes]). Returns [N, k, E].

    Experts held as the file's blocks (QMatrix) are read in place by the native kernel, one call a
    role over every chosen expert (expert_qmatmul: each expert's rows one product), but for tall
    exact blocks without the native GEMM (_xla_gemm_wins). Otherwise the
    N*k assignments are sorted by expert and packed into blocks of `rows` rows, each block owned by
    one expert, so a block is a dense matmul against one expert's weights and only chosen experts
    are read (decode: rows = 1, one weight read per assignment)."""
    n, k = experts.shape
    if any(isinstance(m, QPlanes) for m in (w_gate, w_up, w_down)):
        return _grouped_planes(x, experts, w_gate, w_up, w_down, schemes)
    n_expert, a = w_gate.shape[0], n * k
    rows = _rows_per_block(a, n_expert)
    roles = (w_gate, w_up, w_down)
    if all(isinstance(m, QMatrix) for m in roles) and not _xla_gemm_wins(rows, roles, schemes):
        gate, up = (_expert_product(x, experts, m, s) for m, s in ((w_gate, schemes[0]), (w_up, schemes[1])))
        return _expert_product(silu(gate) * up, experts, w_down, schemes[2]).reshape(n, k, -1)
    n_blocks = (a + min(a, n_expert) * (rows - 1)) // rows  # static bound: each used expert adds < 1 block

    flat = experts.reshape(a)
    order = jnp.argsort(flat, stable=True)  # assignment ids grouped by expert
    sorted_e = flat[order]
    count = jnp.bincount(flat, length=n_expert)  # [X]
    padded = (count + rows - 1) // rows * rows  # each expert's rows rounded up to whole blocks
    dest = (jnp.cumsum(padded) - padded)[sorted_e] + jnp.arange(a) - (jnp.cumsum(count) - count)[sorted_e]
    packed = jnp.zeros((n_blocks * rows, x.shape[-1]), x.dtype).at[dest].set(x[order // k])
    # a block belongs to the expert whose packed range holds its first row (unused blocks: any)
    owner = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * rows, side="right")
    owner = jnp.minimum(owner, n_expert - 1)

    def block(args):
        xb, e = args  # [rows, E], expert id
        return swiglu(xb, expert(w_gate, e), expert(w_up, e), expert(w_down, e), schemes)

    y = jax.lax.map(block, (packed.reshape(n_blocks, rows, -1), owner)).reshape(n_blocks * rows, -1)
    return jnp.zeros((a, y.shape[-1]), y.dtype).at[order].set(y[dest]).reshape(n, k, -1)


def _one_expert(w: QMatrix) -> QMatrix:
    """An expert's matrix of the stacked w, by shape (for kernel_rows and native_gemm)."""
    return QMatrix(jax.ShapeDtypeStruct(w.blocks.shape[1:], w.blocks.dtype), w.qtype, w.n_in)


def _xla_gemm_wins(rows: int, roles, schemes) -> bool:
    """Without the native GEMM (AVX2 builds) an exact product of more than kernel_rows rows is
    faster as XLA's GEMM over the matrix dequantized (`linear`), so blocks of that many rows take the
    block path (AVX2 build, qwen3moe mid shape, 365-token prefill: 3.5 s on the block path, 4.2
    through the expert kernel's row tiles, 3.1 by this rule, its 109-token remainder in the kernel;
    138 tokens, blocks of 16: 1.9 on the block path, 1.5 in the kernel)."""
    return not build.gemm() and any(s == NONE and rows > kernel_rows(_one_expert(w)) for w, s in zip(roles, schemes))


def _expert_product(x, experts, w: QMatrix, scheme: str) -> jax.Array:
    """x's rows (a token's, or an assignment's) times their experts' matrices of the stacked w,
    read in place (expert_qmatmul), x rounded per `scheme` and each expert's rows taking the kernel
    `linear` gives a product of that many rows: the GEMM past kernel_rows in exact numerics where
    it is built."""
    one = _one_expert(w)
    if scheme == NONE:
        return expert_qmatmul(x, experts, w, gemm_rows=kernel_rows(one) + 1 if native_gemm(one) else 0)
    int8 = scheme in (Q8_0, Q8_K)
    return expert_qmatmul(x if int8 else quantize_activations(x, scheme), experts, w, int8_activations=int8)


def _grouped_planes(x, experts, w_gate, w_up, w_down, schemes):
    """grouped_experts with experts as QPlanes [X, out, in] (a GPU): the assignments sorted by
    expert, each role one grouped product over all chosen experts (the Pallas kernel reads a
    QPlanes role's blocks; a role of another type is dense [X, in, out], lax.ragged_dot)."""
    n, k = experts.shape
    flat = experts.reshape(n * k)
    order = jnp.argsort(flat, stable=True)
    n_expert = next(m.n_experts for m in (w_gate, w_up, w_down) if isinstance(m, QPlanes))
    sizes = jnp.bincount(flat, length=n_expert).astype(jnp.int32)
    xs = x[order // k]

    def product(h, w, scheme):
        h = quantize_activations(h, scheme)
        if isinstance(w, QPlanes):
            return dispatch.quantized_matmul(h.astype(w.compute), w, sizes)
        return jax.lax.ragged_dot(h.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32)

    act = silu(product(xs, w_gate, schemes[0])) * product(xs, w_up, schemes[1])
    y = product(act, w_down, schemes[2])
    return jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)
