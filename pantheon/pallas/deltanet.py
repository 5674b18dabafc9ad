"""Gated delta rule (the recurrence of a Gated DeltaNet layer): the plain-jnp reference and Pallas
(Triton) kernels for prefill and decode.

Per batch row b and value head h, with the state S a [Dk, Dv] matrix (S[i, m]: key index i, value
index m), each token t does

    S   = S * exp(g_t)                 # decay; g_t <= 0 is a log-decay
    δ   = β_t * (v_t - Sᵀ k_t)         # what the memory gets wrong about v_t
    S   = S + k_t ⊗ δ                  # rank-1 correction
    o_t = Sᵀ q_t                       # read with the *updated* state

This is llama.cpp's sequential `ggml_gated_delta_net`, which it runs for prefill and decode alike.

* `gated_delta_rule_reference(q, k, v, g, beta, state, lengths)`: the recurrence as a `lax.scan`.
* `gated_delta_rule(..., chunk=64)`: the same as Pallas kernels. `chunk=1` runs the recurrence token
  by token in a `fori_loop` inside one kernel (grid (B, H, Dv / block_v); the state tile
  [Dk, block_v] is the loop carry). `chunk` in {16, 32, 64} runs the chunked (WY / UT-transform)
  form, exact up to float32 rounding (derivation above `_chunk_inverse_kernel`): a first kernel
  inverts each chunk's unit lower-triangular [C, C] system by forward substitution, in parallel
  over (B, H, chunks); a second one carries the state tile over the chunks with dots.
* `gated_delta_rule_step(q, k, v, g, beta, state_cache, slots)`: one decode token per row, reading
  and writing row b's state in place in a slot-indexed cache [N_slots, H, Dk, Dv] at slots[b].
* `gated_delta_rule_step_reference`: the same in plain jnp (gather, one step, scatter).

The state is never tiled along Dk, only along Dv: the recurrence is independent per value column
m (Sᵀ k and Sᵀ q reduce over Dk; the decay and β are per (token, head)), so Dv tiles run on
separate grid programs with no communication and the time loop stays inside each program.

Triton rules the kernels respect (jax_feasibility.md section 1): Dk, Dv in {32, 64, 128, 256},
block_v and chunk powers of 2 >= 16 (the dots' dims are >= 16), no scalar prefetch (lengths and
slots are ordinary inputs), refs are read by indexing, recurrences never cross grid steps.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pantheon.pallas.lowering import triton_params

_HI = lax.Precision.HIGHEST  # f32 dots even where the backend would default to tf32/bf16
_SQ = getattr(pl, "squeezed", None)  # a squeezed block dim (None is the older spelling)
HEAD_DIMS = (32, 64, 128, 256)
CHUNKS = (1, 16, 32, 64)


def gated_delta_rule_reference(q, k, v, g, beta, state, lengths=None):
    """q, k: [B, T, H, Dk] float32, already L2-normalised (q also scaled by 1/sqrt(Dk)) and already
    mapped to the H value heads; v: [B, T, H, Dv]; g (log-decay <= 0), beta: [B, T, H];
    state: [B, H, Dk, Dv]; lengths: int32 [B] or None. Steps t >= lengths[b] leave row b's state
    unchanged and output zeros. Returns (out [B, T, H, Dv], new state [B, H, Dk, Dv])."""
    b, t = q.shape[:2]
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t, i = inputs  # q_t, k_t: [B, H, Dk]; v_t: [B, H, Dv]; g_t, beta_t: [B, H]
        s_new = s * jnp.exp(g_t)[..., None, None]
        recalled = jnp.einsum("bhim,bhi->bhm", s_new, k_t, precision=_HI)  # Sᵀ k: [B, H, Dv]
        delta = beta_t[..., None] * (v_t - recalled)
        s_new = s_new + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhim,bhi->bhm", s_new, q_t, precision=_HI)
        valid = (i < lengths)[:, None, None]  # [B, 1, 1]: padded steps keep the state
        return jnp.where(valid[..., None], s_new, s), jnp.where(valid, o_t, 0.0)

    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    state, out = lax.scan(step, state.astype(jnp.float32), (*time_major, jnp.arange(t)))
    return jnp.moveaxis(out, 0, 1), state


# ---- validation ------------------------------------------------------------------------------------
def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_float(what, **arrays):
    for name, a in arrays.items():
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{what}: {name} must be floating point, got {a.dtype}")


def _check_head_dims(dk: int, dv: int, what: str):
    if dk not in HEAD_DIMS or dv not in HEAD_DIMS:
        raise ValueError(f"{what}: key dim {dk} and value dim {dv} must each be one of {HEAD_DIMS} "
                         f"(power-of-2 Triton tiles)")


def _check_block_v(block_v: int, dv: int, what: str) -> int:
    if not (_is_pow2(block_v) and block_v >= 16):
        raise ValueError(f"{what}: block_v={block_v} must be a power of 2 >= 16")
    return min(block_v, dv)


def _check_prefill_args(q, k, v, g, beta, state, lengths, what):
    """(B, T, H, Dk, Dv) of valid `gated_delta_rule` arguments, else a ValueError saying what is off."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{what}: q, k must be [B, T, H, Dk] and v [B, T, H, Dv]; got q{tuple(q.shape)}, "
                         f"k{tuple(k.shape)}, v{tuple(v.shape)}")
    b, t, h, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{what}: q{tuple(q.shape)} and k{tuple(k.shape)} differ")
    if tuple(v.shape[:3]) != (b, t, h):
        raise ValueError(f"{what}: v{tuple(v.shape)} does not match q{tuple(q.shape)} in [B, T, H]")
    dv = v.shape[3]
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (b, t, h):
            raise ValueError(f"{what}: {name} must be [B, T, H] = {(b, t, h)}, got {tuple(a.shape)}")
    if tuple(state.shape) != (b, h, dk, dv):
        raise ValueError(f"{what}: state must be [B, H, Dk, Dv] = {(b, h, dk, dv)}, got {tuple(state.shape)}")
    if lengths is not None and (tuple(lengths.shape) != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise ValueError(f"{what}: lengths must be integer [B] = ({b},), got {lengths.dtype}{tuple(lengths.shape)}")
    _check_float(what, q=q, k=k, v=v, g=g, beta=beta, state=state)
    return b, t, h, dk, dv


def _check_step_args(q, k, v, g, beta, state_cache, slots, what):
    """(B, H, Dk, Dv, N_slots) of valid `gated_delta_rule_step` arguments."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"{what}: q, k must be [B, H, Dk] and v [B, H, Dv]; got q{tuple(q.shape)}, "
                         f"k{tuple(k.shape)}, v{tuple(v.shape)}")
    b, h, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{what}: q{tuple(q.shape)} and k{tuple(k.shape)} differ")
    if tuple(v.shape[:2]) != (b, h):
        raise ValueError(f"{what}: v{tuple(v.shape)} does not match q{tuple(q.shape)} in [B, H]")
    dv = v.shape[2]
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (b, h):
            raise ValueError(f"{what}: {name} must be [B, H] = {(b, h)}, got {tuple(a.shape)}")
    if state_cache.ndim != 4 or tuple(state_cache.shape[1:]) != (h, dk, dv) or state_cache.shape[0] == 0:
        raise ValueError(f"{what}: state_cache must be [N_slots, H, Dk, Dv] = [N, {h}, {dk}, {dv}], "
                         f"got {tuple(state_cache.shape)}")
    if tuple(slots.shape) != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"{what}: slots must be integer [B] = ({b},), got {slots.dtype}{tuple(slots.shape)}")
    _check_float(what, q=q, k=k, v=v, g=g, beta=beta, state_cache=state_cache)
    return b, h, dk, dv, state_cache.shape[0]


def _check_offsets(what, *arrays):
    for a in arrays:  # Triton addresses a ref with int32 element offsets
        if a.size >= 2 ** 31:
            raise ValueError(f"{what}: an operand of shape {tuple(a.shape)} has >= 2**31 elements (int32 offsets)")


def kernel_supports(dk: int, dv: int, state_cache_shape: tuple[int, ...] | None = None) -> bool:
    """Whether the Pallas kernels run these shapes (else a model should record "reference"): Dk and
    Dv in HEAD_DIMS, and a state cache [N_slots, H, Dk, Dv] under 2**31 elements (int32 offsets)."""
    if dk not in HEAD_DIMS or dv not in HEAD_DIMS:
        return False
    n = 1
    for d in state_cache_shape or ():
        n *= d
    return n < 2 ** 31


def deltanet_defaults(dk: int, chunk: int) -> tuple[int, int]:
    """(block_v, num_warps) for the prefill kernel. Sequential (chunk 1): the [Dk, block_v] state tile
    lives in registers across the time loop, so it stays at <= 4096 floats (32 per thread at 4 warps)
    and B * H * Dv / block_v programs fill the GPU. Chunked: block_v 32 with 4 warps keeps the [C, Dk]
    chunk operands, the [C, C] matrices and the state tile around 200 registers per thread.
    Untuned (no GPU run yet); profiles/gpu_kernels.py times the alternatives."""
    if chunk == 1:
        return (32 if dk <= 128 else 16), 4
    return 32, 4


# ---- prefill: sequential (chunk = 1) ---------------------------------------------------------------
def _recurrent_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, t_len: int):
    """One (row b, head h, value tile j): len_ref [1] int32; q_ref, k_ref [T, Dk]; v_ref [T, bv];
    g_ref, beta_ref [T]; s_ref [Dk, bv] the initial state tile; o_ref [T, bv]; s_out_ref [Dk, bv].

    Tokens 0..length-1 run the recurrence with the state tile as the fori_loop carry; the output
    rows of the padded tokens are written as zeros by a second loop (their inputs are never read)."""
    n = jnp.clip(len_ref[0], 0, t_len)
    bv = o_ref.shape[1]
    f32 = jnp.float32

    def step(t, s):
        kt = k_ref[t, :].astype(f32)[:, None]  # [Dk, 1]
        qt = q_ref[t, :].astype(f32)[:, None]
        s = s * jnp.exp(g_ref[t].astype(f32))
        recalled = jnp.sum(s * kt, axis=0)  # Sᵀ k: [bv]
        delta = beta_ref[t].astype(f32) * (v_ref[t, :].astype(f32) - recalled)
        s = s + kt * delta[None, :]
        o_ref[t, :] = jnp.sum(s * qt, axis=0)  # Sᵀ q with the updated state
        return s

    s_out_ref[...] = lax.fori_loop(0, n, step, s_ref[...].astype(f32))

    def zero(t, carry):
        o_ref[t, :] = jnp.zeros((bv,), f32)
        return carry

    lax.fori_loop(n, t_len, zero, 0)


def _recurrent(q, k, v, g, beta, state, lengths, *, block_v, interpret, num_warps, num_stages):
    b, t, h, dk = q.shape
    dv = v.shape[3]
    return pl.pallas_call(
        partial(_recurrent_kernel, t_len=t),
        grid=(b, h, dv // block_v),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, hi, j: (bi,)),
            pl.BlockSpec((_SQ, t, _SQ, dk), lambda bi, hi, j: (bi, 0, hi, 0)),
            pl.BlockSpec((_SQ, t, _SQ, dk), lambda bi, hi, j: (bi, 0, hi, 0)),
            pl.BlockSpec((_SQ, t, _SQ, block_v), lambda bi, hi, j: (bi, 0, hi, j)),
            pl.BlockSpec((_SQ, t, _SQ), lambda bi, hi, j: (bi, 0, hi)),
            pl.BlockSpec((_SQ, t, _SQ), lambda bi, hi, j: (bi, 0, hi)),
            pl.BlockSpec((_SQ, _SQ, dk, block_v), lambda bi, hi, j: (bi, hi, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((_SQ, t, _SQ, block_v), lambda bi, hi, j: (bi, 0, hi, j)),
            pl.BlockSpec((_SQ, _SQ, dk, block_v), lambda bi, hi, j: (bi, hi, 0, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pantheon_gated_delta_rule",
    )(lengths, q, k, v, g, beta, state)


# ---- prefill: chunked (WY / UT transform) ----------------------------------------------------------
# Inside a chunk of C tokens starting from state S, with G_t = g_1 + ... + g_t (chunk-local, so
# exp(G_t) is the decay from the chunk start to t) and D[t, s] = exp(G_t - G_s):
#
#   δ_t = β_t (v_t - exp(G_t) Sᵀ k_t - Σ_{s<t} D[t, s] (k_t·k_s) δ_s)
#
# i.e. (I + L) Δ = diag(β) (V - diag(exp G) K S) with L[t, s] = β_t D[t, s] k_t·k_s for s < t, a unit
# lower-triangular system. Then o_t = exp(G_t) Sᵀ q_t + Σ_{s<=t} D[t, s] (q_t·k_s) δ_s and
# S' = exp(G_C) S + Σ_s exp(G_C - G_s) k_s ⊗ δ_s. This is the sequential rule rewritten, not an
# approximation. A = (I + L)^-1 does not depend on S: kernel 1 computes it for every chunk in
# parallel by forward substitution (row i of A = e_i - L[i, :] A, which is the recurrence's own
# order of operations, so it is as stable as the recurrence; no power series or doubling, whose
# terms grow like binomials when keys repeat). Kernel 2 carries S across the chunks. Every decay
# factor is exp of a non-positive number (for g <= 0), so nothing overflows. Padded tokens get
# g = β = 0 and k = q = v = 0: they leave S unchanged and output 0.
def _chunk_inverse_kernel(len_ref, k_ref, gc_ref, beta_ref, a_ref, *, chunk: int):
    """One (row b, head h, chunk c): len_ref [1] int32; k_ref [C, Dk]; gc_ref, beta_ref [C] (chunk-local
    cumulative log-decay and β, zero on padded tokens); a_ref [C, C] <- (I + L)^-1."""
    f32 = jnp.float32
    c0 = pl.program_id(2) * chunk
    valid = (c0 + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)) < len_ref[0]
    kc = jnp.where(valid, k_ref[...].astype(f32), 0.0)
    gc, beta = gc_ref[...], beta_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    lower = rows > cols
    kk = lax.dot_general(kc, kc, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=f32)
    decay = jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], -jnp.inf))
    lmat = jnp.where(lower, beta[:, None] * decay * kk, 0.0)

    def row(i, a):  # rows < i of `a` are final, rows >= i are still the identity's
        li = jnp.sum(jnp.where(rows == i, lmat, 0.0), axis=0)  # L[i, :]
        return jnp.where(rows == i, a - jnp.sum(li[:, None] * a, axis=0)[None, :], a)

    a_ref[...] = lax.fori_loop(1, chunk, row, (rows == cols).astype(f32))


def _chunk_state_kernel(len_ref, q_ref, k_ref, v_ref, gc_ref, beta_ref, a_ref, s_ref, o_ref, s_out_ref, *,
                        chunk: int, t_pad: int):
    """One (row b, head h, value tile j): q_ref, k_ref [Tp, Dk]; v_ref [Tp, bv]; gc_ref, beta_ref [Tp];
    a_ref [Tp, C] (row t: row t mod C of its chunk's (I + L)^-1); s_ref, s_out_ref [Dk, bv];
    o_ref [Tp, bv]. Loops over the chunks holding valid tokens; zero-fills the rest of o."""
    f32 = jnp.float32
    length = jnp.clip(len_ref[0], 0, t_pad)
    n_chunks = (length + chunk - 1) // chunk
    bv = o_ref.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    incl = rows >= cols
    last = lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1

    def dot(x, y, dims=((1,), (0,))):
        return lax.dot_general(x, y, (dims, ((), ())), precision=_HI, preferred_element_type=f32)

    def body(c, s):
        c0 = pl.multiple_of(c * chunk, chunk)
        valid = (c0 + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)) < length
        qc = jnp.where(valid, q_ref[pl.ds(c0, chunk), :].astype(f32), 0.0)
        kc = jnp.where(valid, k_ref[pl.ds(c0, chunk), :].astype(f32), 0.0)
        vc = jnp.where(valid, v_ref[pl.ds(c0, chunk), :].astype(f32), 0.0)
        gc, beta = gc_ref[pl.ds(c0, chunk)], beta_ref[pl.ds(c0, chunk)]
        g_last = jnp.sum(jnp.where(last, gc, 0.0))
        decay = jnp.exp(gc)[:, None]  # [C, 1]: from the chunk start
        rhs = beta[:, None] * (vc - decay * dot(kc, s))  # [C, bv]
        delta = dot(a_ref[pl.ds(c0, chunk), :], rhs)  # (I + L)^-1 rhs
        qk = dot(qc, kc, ((1,), (1,)))  # [C, C]
        p = jnp.exp(jnp.where(incl, gc[:, None] - gc[None, :], -jnp.inf)) * qk
        o_ref[pl.ds(c0, chunk), :] = decay * dot(qc, s) + dot(p, delta)
        tail = jnp.exp(g_last - gc)[:, None] * delta  # [C, bv]: decay from token s to the chunk end
        return jnp.exp(g_last) * s + dot(kc, tail, ((0,), (0,)))

    s_out_ref[...] = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(f32))

    def zero(c, carry):
        o_ref[pl.ds(pl.multiple_of(c * chunk, chunk), chunk), :] = jnp.zeros((chunk, bv), f32)
        return carry

    lax.fori_loop(n_chunks, t_pad // chunk, zero, 0)


def _chunked(q, k, v, g, beta, state, lengths, *, chunk, block_v, interpret, num_warps, num_stages):
    b, t, h, dk = q.shape
    dv = v.shape[3]
    t_pad = pl.cdiv(t, chunk) * chunk
    n_chunks = t_pad // chunk
    if t_pad != t:
        pad = lambda a: jnp.pad(a, ((0, 0), (0, t_pad - t)) + ((0, 0),) * (a.ndim - 2))
        q, k, v, g, beta = (pad(a) for a in (q, k, v, g, beta))
    valid = (jnp.arange(t_pad)[None, :] < lengths[:, None])[:, :, None]  # [B, Tp, 1]
    # [B, H, Tp] gate planes, zero on padded tokens (NaN there must not reach the cumsum)
    g = jnp.moveaxis(jnp.where(valid, g.astype(jnp.float32), 0.0), 1, 2)
    beta = jnp.moveaxis(jnp.where(valid, beta.astype(jnp.float32), 0.0), 1, 2)
    gc = jnp.cumsum(g.reshape(b, h, n_chunks, chunk), axis=-1).reshape(b, h, t_pad)
    params = None if interpret else triton_params(num_warps, num_stages)
    a_inv = pl.pallas_call(
        partial(_chunk_inverse_kernel, chunk=chunk),
        grid=(b, h, n_chunks),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, hi, c: (bi,)),
            pl.BlockSpec((_SQ, chunk, _SQ, dk), lambda bi, hi, c: (bi, c, hi, 0)),
            pl.BlockSpec((_SQ, _SQ, chunk), lambda bi, hi, c: (bi, hi, c)),
            pl.BlockSpec((_SQ, _SQ, chunk), lambda bi, hi, c: (bi, hi, c)),
        ],
        out_specs=pl.BlockSpec((_SQ, _SQ, chunk, chunk), lambda bi, hi, c: (bi, hi, c, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, t_pad, chunk), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="pantheon_gated_delta_chunk_inverse",
    )(lengths, k, gc, beta)
    out, new_state = pl.pallas_call(
        partial(_chunk_state_kernel, chunk=chunk, t_pad=t_pad),
        grid=(b, h, dv // block_v),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, hi, j: (bi,)),
            pl.BlockSpec((_SQ, t_pad, _SQ, dk), lambda bi, hi, j: (bi, 0, hi, 0)),
            pl.BlockSpec((_SQ, t_pad, _SQ, dk), lambda bi, hi, j: (bi, 0, hi, 0)),
            pl.BlockSpec((_SQ, t_pad, _SQ, block_v), lambda bi, hi, j: (bi, 0, hi, j)),
            pl.BlockSpec((_SQ, _SQ, t_pad), lambda bi, hi, j: (bi, hi, 0)),
            pl.BlockSpec((_SQ, _SQ, t_pad), lambda bi, hi, j: (bi, hi, 0)),
            pl.BlockSpec((_SQ, _SQ, t_pad, chunk), lambda bi, hi, j: (bi, hi, 0, 0)),
            pl.BlockSpec((_SQ, _SQ, dk, block_v), lambda bi, hi, j: (bi, hi, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((_SQ, t_pad, _SQ, block_v), lambda bi, hi, j: (bi, 0, hi, j)),
            pl.BlockSpec((_SQ, _SQ, dk, block_v), lambda bi, hi, j: (bi, hi, 0, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, t_pad, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="pantheon_gated_delta_chunked",
    )(lengths, q, k, v, gc, beta, a_inv, state)
    return (out[:, :t] if t_pad != t else out), new_state


@partial(jax.jit, static_argnames=("chunk", "block_v", "interpret", "num_warps", "num_stages"))
def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                     lengths: jax.Array | None = None, *, chunk: int = 64, block_v: int | None = None,
                     interpret: bool = False, num_warps: int | None = None, num_stages: int = 1):
    """Pallas gated delta rule with the semantics of `gated_delta_rule_reference` (prefill chunks).

    q, k: [B, T, H, Dk] (L2-normalised, q scaled by 1/sqrt(Dk), mapped to the H value heads);
    v: [B, T, H, Dv]; g (log-decay, <= 0), beta: [B, T, H]; state: [B, H, Dk, Dv] float32;
    lengths: int [B] or None (= T). Steps t >= lengths[b] leave row b's state unchanged and output
    zeros; their inputs are never used (NaN there is harmless). Any float dtype in, float32 math;
    returns (out [B, T, H, Dv] float32, new state [B, H, Dk, Dv] float32).

    chunk: 1 runs the recurrence token by token inside the kernel (grid (B, H, Dv / block_v), the
    state tile [Dk, block_v] is the fori_loop carry); 16, 32 or 64 runs the exact chunked form (see
    the comment above `_chunk_inverse_kernel`; T is padded to a multiple of chunk inside).
    Dk, Dv in {32, 64, 128, 256}; block_v: a power of 2 >= 16 (clamped to Dv; default and num_warps
    from `deltanet_defaults`). `interpret=True` runs through the Pallas interpreter (any backend);
    otherwise it lowers with Triton (GPU only)."""
    what = "gated_delta_rule"
    b, t, h, dk, dv = _check_prefill_args(q, k, v, g, beta, state, lengths, what)
    _check_head_dims(dk, dv, what)
    if chunk not in CHUNKS:
        raise ValueError(f"{what}: chunk={chunk} must be one of {CHUNKS} (1: sequential in-kernel loop)")
    dflt_bv, dflt_warps = deltanet_defaults(dk, chunk)
    block_v = _check_block_v(block_v or dflt_bv, dv, what)
    _check_offsets(what, q, v, state)
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.clip(lengths.astype(jnp.int32), 0, t)
    state = state.astype(jnp.float32)
    if t == 0:
        return jnp.zeros((b, 0, h, dv), jnp.float32), state
    impl = _recurrent if chunk == 1 else partial(_chunked, chunk=chunk)
    return impl(q, k, v, g, beta, state, lengths, block_v=block_v, interpret=interpret,
                num_warps=num_warps or dflt_warps, num_stages=num_stages)


# ---- decode: one step against a slot-indexed state cache ---------------------------------------------
def gated_delta_rule_step_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                                    state_cache: jax.Array, slots: jax.Array):
    """One decode token per row in plain jnp: gather row b's state from state_cache[slots[b]], run one
    step of `gated_delta_rule_reference`, scatter the new states back.

    q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state_cache: [N_slots, H, Dk, Dv] float32;
    slots: int [B] (clipped to [0, N_slots); rows must use distinct slots, except rows whose
    results are thrown away, e.g. padding rows on a scratch slot). Returns (out [B, H, Dv] float32,
    the updated cache); slots no row names are returned unchanged."""
    _check_step_args(q, k, v, g, beta, state_cache, slots, "gated_delta_rule_step_reference")
    slots = jnp.clip(slots.astype(jnp.int32), 0, state_cache.shape[0] - 1)
    out, new = gated_delta_rule_reference(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                          state_cache[slots])
    return out[:, 0], state_cache.at[slots].set(new.astype(state_cache.dtype))


def _step_kernel(slot_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, cache_ref, o_ref, cache_out_ref, *,
                 n_slots: int):
    """One (row b, head h, value tile j): slot_ref [1] int32; q_ref, k_ref [Dk]; v_ref [bv];
    g_ref, beta_ref [1]; cache_ref and cache_out_ref [N_slots, Dk, bv]: this (head, value tile) of
    every slot, the same buffer (aliased); o_ref [bv]. Reads and rewrites only slot slots[b]."""
    f32 = jnp.float32
    slot = jnp.clip(slot_ref[0], 0, n_slots - 1)
    kt = k_ref[...].astype(f32)[:, None]  # [Dk, 1]
    qt = q_ref[...].astype(f32)[:, None]
    s = cache_ref[slot].astype(f32) * jnp.exp(g_ref[0].astype(f32))  # [Dk, bv]
    delta = beta_ref[0].astype(f32) * (v_ref[...].astype(f32) - jnp.sum(s * kt, axis=0))
    s = s + kt * delta[None, :]
    cache_out_ref[slot] = s.astype(cache_out_ref.dtype)
    o_ref[...] = jnp.sum(s * qt, axis=0)


@partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps", "num_stages"))
def gated_delta_rule_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                          state_cache: jax.Array, slots: jax.Array, *, block_v: int = 32, interpret: bool = False,
                          num_warps: int = 4, num_stages: int = 1):
    """Pallas one-token decode, semantics of `gated_delta_rule_step_reference`.

    q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state_cache: float32 [N_slots, H, Dk, Dv], a
    layer's SSM state for every slot (HybridState.ssm[i]: N_slots = slots + 1 with the scratch
    slot last); slots: int [B], the cache slot of each row (an ordinary input, clipped to
    [0, N_slots)). Returns (out [B, H, Dv] float32, the updated cache).

    Grid (B, H, Dv / block_v): each program reads the [Dk, block_v] tile of its row's slot, does one
    step with broadcast-multiply + sums (no dots: one token), and writes the tile back into the same
    buffer (input_output_aliases), so no gather or scatter of states happens outside the kernel.
    Donate the cache in the caller's jit (the model's layer programs do) or XLA copies it first.
    Rows must name distinct slots, except rows whose output is discarded (padding rows on the
    scratch slot): two programs updating one slot race on a GPU."""
    what = "gated_delta_rule_step"
    b, h, dk, dv, n_slots = _check_step_args(q, k, v, g, beta, state_cache, slots, what)
    _check_head_dims(dk, dv, what)
    if state_cache.dtype != jnp.float32:
        raise ValueError(f"{what}: state_cache must be float32 (updated in place), got {state_cache.dtype}")
    block_v = _check_block_v(block_v, dv, what)
    _check_offsets(what, state_cache)
    out, cache = pl.pallas_call(
        partial(_step_kernel, n_slots=n_slots),
        grid=(b, h, dv // block_v),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, hi, j: (bi,)),
            pl.BlockSpec((_SQ, _SQ, dk), lambda bi, hi, j: (bi, hi, 0)),
            pl.BlockSpec((_SQ, _SQ, dk), lambda bi, hi, j: (bi, hi, 0)),
            pl.BlockSpec((_SQ, _SQ, block_v), lambda bi, hi, j: (bi, hi, j)),
            pl.BlockSpec((_SQ, 1), lambda bi, hi, j: (bi, hi)),
            pl.BlockSpec((_SQ, 1), lambda bi, hi, j: (bi, hi)),
            pl.BlockSpec((n_slots, _SQ, dk, block_v), lambda bi, hi, j: (0, hi, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((_SQ, _SQ, block_v), lambda bi, hi, j: (bi, hi, j)),
            pl.BlockSpec((n_slots, _SQ, dk, block_v), lambda bi, hi, j: (0, hi, 0, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct(state_cache.shape, state_cache.dtype)],
        input_output_aliases={6: 1},
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pantheon_gated_delta_step",
    )(slots.astype(jnp.int32), q, k, v, g, beta, state_cache)
    return out, cache
