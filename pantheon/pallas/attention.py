"""Causal grouped-query attention: the plain-jnp reference and two Pallas (Triton) kernels.

Shapes: B batch rows, T queries per row, S key positions, H query heads, K kv heads,
G = H / K query heads per kv head (query head h reads kv head h // G), D head dim.

* `attention_reference(q, k, v, q_pos)`: the model's attention (`layers.gqa_attention` is this
  function). Key s is visible to query (b, t) iff s <= q_pos[b, t].
* `flash_attention(q, k, v, q_pos, ...)`: the same math as a flash-attention kernel (prefill).
  Grid (B, H, T / block_q); each program runs an online softmax over key blocks in a `fori_loop`
  whose trip count comes from the largest q_pos of its query block, so key blocks past the last
  visible position are never read.
* `decode_attention(q, k_cache, v_cache, slots, lengths, ...)`: one new query per row, reading
  row b's keys/values straight from cache slot slots[b], positions < lengths[b] (no gather of the
  cache outside the kernel). Grid (B, K, splits): the context is split into `num_splits` ranges
  that run in parallel (flash-decoding) and are merged outside the kernel. The G query heads of a
  kv head are processed together, padded to >= 16 rows for Triton's dot.

Conventions shared by all three:
* a query with no visible key (q_pos < 0, or length 0) returns zeros, not NaN;
* keys/values at positions no query can see may hold anything, NaN included: they never reach the
  output (the kernels zero invalid value rows, the reference zeroes them too);
* the output has q's dtype; scores, softmax and accumulation are float32.

Triton rules the kernels respect (jax_feasibility.md section 1): every value has power-of-2 dims
(D in {16, ..., 256}, block sizes powers of 2), dot operands have all dims >= 16, no scalar
prefetch (slots/lengths/q_pos are ordinary inputs), refs are read by indexing.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pantheon.gguf.arithmetic import kv_values
from pantheon.pallas.lowering import triton_params

# A squeezed block dim: `pl.squeezed` where this jax has it (None is the older spelling).
_SQ = getattr(pl, "squeezed", None)
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite running max: exp(_M_INIT - m) == 0, never NaN


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_head_dim(d: int, what: str):
    if not (_is_pow2(d) and 16 <= d <= 512):
        raise ValueError(f"{what}: head_dim {d} must be a power of 2 in [16, 512] (Triton tiles)")


def _dot_precision(dtype):
    """float32 operands: exact IEEE dot (Triton's default would be TF32); 16-bit: default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


# ---- reference ------------------------------------------------------------------------------------
def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, window: int = 0) -> jax.Array:
    """Causal grouped-query attention against keys at absolute positions 0..S-1 (plain jnp).

    q: [B, T, H, D]; k, v: [B, S, K, D] with H % K == 0; q_pos: int [B, T], the absolute position
    of each query. Key s is visible to query (b, t) iff s <= q_pos[b, t]; query head h uses kv
    head h // (H / K). Scores q.k / sqrt(D) and the softmax are float32. Returns [B, T, H, D] in
    q's dtype; a query with no visible key (q_pos < 0) gets zeros. window > 0: a sliding window, key s
    visible only while q_pos - s < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD)."""
    b, t, h, d = _check_attention_args(q, k, v, q_pos, "attention_reference")
    s, kh = k.shape[1], k.shape[2]
    # Zero value rows no query of the row can see, so stale NaN/inf there cannot leak through 0 * x.
    seen = jnp.arange(s)[None, :] <= jnp.max(q_pos, axis=1)[:, None]  # [B, S]
    v = jnp.where(seen[:, :, None, None], v, jnp.zeros((), v.dtype))
    qg = q.reshape(b, t, kh, h // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    visible = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if window:
        visible = visible & (q_pos[:, :, None] - jnp.arange(s)[None, None, :] < window)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    probs = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], probs, 0.0)  # no NaN rows
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def _check_attention_args(q, k, v, q_pos, what):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{what}: q must be [B, T, H, D] and k, v [B, S, K, D]; got q{tuple(q.shape)}, "
                         f"k{tuple(k.shape)}, v{tuple(v.shape)}")
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{what}: k{tuple(k.shape)} and v{tuple(v.shape)} differ")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{what}: k{tuple(k.shape)} does not match q{tuple(q.shape)} in batch or head_dim")
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"{what}: {h} query heads are not a multiple of {k.shape[2]} kv heads")
    if tuple(q_pos.shape) != (b, t) or not jnp.issubdtype(q_pos.dtype, jnp.integer):
        raise ValueError(f"{what}: q_pos must be integer [B, T] = {(b, t)}, got {q_pos.dtype}{tuple(q_pos.shape)}")
    return b, t, h, d


def _online_softmax_step(acc, m, l, s, mask, v, v_rows, prec):
    """One key block of the online softmax: scores s [R, bk] (float32, scaled) where `mask` [R or 1,
    bk] holds, values v [bk, D] where v_rows [1, bk] holds (other rows are zeroed: padding or
    unwritten cache may hold NaN); running (acc [R, D], max m [R], sum l [R]) -> the updated triple."""
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * corr + jnp.sum(p, axis=1)
    v = jnp.where(v_rows.reshape(v.shape[0], 1), v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)
    return acc * corr[:, None] + pv, m_new, l


# ---- prefill: flash attention ---------------------------------------------------------------------
def _flash_kernel(qpos_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, kv_len: int, scale: float):
    """One (b, h, query block): qpos_ref [bq] int32, q_ref [bq, D], k_ref/v_ref [S_pad, D], o_ref [bq, D]."""
    qp = qpos_ref[...]
    q = q_ref[...]
    bq, d = q.shape
    last = jnp.max(qp)  # the largest visible position in this block
    hi = jnp.minimum(jnp.maximum(last + 1, 0), kv_len)
    n_blocks = (hi + block_k - 1) // block_k
    prec = _dot_precision(q.dtype)

    def body(j, carry):
        acc, m, l = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        kpos = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
        mask = (kpos <= qp[:, None]) & (kpos < kv_len)  # [bq, bk]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale
        row_ok = (kpos <= last) & (kpos < kv_len)  # [1, bk]: rows some query here can see
        return _online_softmax_step(acc, m, l, s, mask, v, row_ok, prec)

    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _M_INIT, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, _, l = lax.fori_loop(0, n_blocks, body, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / l_safe[:, None], 0.0).astype(o_ref.dtype)


def flash_defaults(head_dim: int) -> tuple[int, int, int]:
    """(block_q, block_k, num_warps) for a head dim: the [block_q, D] float32 accumulator stays in
    registers, so D = 256 takes a smaller key block and twice the warps."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 8)


@partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "num_warps", "num_stages"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, *, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool = False, num_warps: int | None = None,
                    num_stages: int = 2) -> jax.Array:
    """Pallas flash attention with the semantics of `attention_reference`.

    q: [B, T, H, D]; k, v: [B, S, K, D]; q_pos: int [B, T]. Returns [B, T, H, D] in q's dtype.
    block_q / block_k: powers of 2 >= 16 (clamped down to the padded T / S; defaults from
    `flash_defaults(D)`, as is num_warps). T and S are padded
    to the blocks inside (padded queries get q_pos -1, padded keys are masked), so any T, S work;
    D must be a power of 2 in [16, 512]. `interpret=True` runs the kernel through the Pallas
    interpreter (any backend); otherwise it lowers with Triton (GPU only)."""
    b, t, h, d = _check_attention_args(q, k, v, q_pos, "flash_attention")
    _check_head_dim(d, "flash_attention")
    dq, dk, dw = flash_defaults(d)
    block_q, block_k, num_warps = block_q or dq, block_k or dk, num_warps or dw
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if not (_is_pow2(blk) and blk >= 16):
            raise ValueError(f"flash_attention: {name}={blk} must be a power of 2 >= 16")
    s, kh = k.shape[1], k.shape[2]
    if s == 0 or t == 0:
        return jnp.zeros(q.shape, q.dtype)
    group = h // kh
    bq = min(block_q, max(16, 1 << (t - 1).bit_length()))
    bk = min(block_k, max(16, 1 << (s - 1).bit_length()))
    t_pad, s_pad = pl.cdiv(t, bq) * bq, pl.cdiv(s, bk) * bk
    q_pos = q_pos.astype(jnp.int32)
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, t_pad - t)), constant_values=-1)
    if s_pad != s:
        k = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    kernel = partial(_flash_kernel, block_k=bk, kv_len=s, scale=d ** -0.5)
    out = pl.pallas_call(
        kernel,
        grid=(b, h, t_pad // bq),
        in_specs=[
            pl.BlockSpec((_SQ, bq), lambda bi, hi, qi: (bi, qi)),
            pl.BlockSpec((_SQ, bq, _SQ, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
            pl.BlockSpec((_SQ, s_pad, _SQ, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),
            pl.BlockSpec((_SQ, s_pad, _SQ, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),
        ],
        out_specs=pl.BlockSpec((_SQ, bq, _SQ, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pantheon_flash_attention",
    )(q_pos, q, k, v)
    return out[:, :t] if t_pad != t else out


# ---- decode ----------------------------------------------------------------------------------------
def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array,
                               lengths: jax.Array) -> jax.Array:
    """Plain-jnp decode attention: row b's query attends to cache slot slots[b], positions < lengths[b].

    q: [B, H, D]; k_cache, v_cache: [N_slots, C, K, D]; slots, lengths: int [B]. Returns [B, H, D]
    in q's dtype (zeros for a row with length <= 0). Gathers the rows' caches, then applies
    `attention_reference` with q_pos = lengths - 1."""
    b, h, d = _check_decode_args(q, k_cache, v_cache, slots, lengths, "decode_attention_reference")
    keys = k_cache[slots]  # [B, C, K, D]
    values = v_cache[slots]
    q_pos = jnp.minimum(lengths.astype(jnp.int32), k_cache.shape[1])[:, None] - 1
    return attention_reference(q[:, None], keys.astype(q.dtype), values.astype(q.dtype), q_pos)[:, 0]


def cached_attention_blocked(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array,
                             q_pos: jax.Array, block_k: int = 256, fine_k: int = 64, fine_span: int = 256,
                             window: int = 0, ring: bool = False, length: int = 0) -> jax.Array:
    """`attention_reference` read straight from the slot cache, one key block at a time (plain jnp,
    online softmax in float32) — the CPU serve path for prefill chunks and decode steps alike.

    q: [B, T, H, D]; k_cache, v_cache: [N_slots, C, K, D]; slots: int [B]; q_pos: int [B, T]
    absolute positions. Row b attends to slot slots[b], keys 0..q_pos[b, t]. Returns [B, T, H, D] in
    q's dtype (zeros for a query with q_pos < 0).

    Key blocks: `fine_k` positions up to `fine_span`, `block_k` beyond (a short conversation reads
    64-key blocks, not a 256-key block it mostly cannot see: a SmolLM2 decode step at position 10
    costs 26 instead of 32 ms; long ones keep the larger blocks' lower loop overhead). The loops
    run over the blocks up to the batch's largest position, so a step costs what its rows attend, not
    the cache length or a padded bucket, and nothing is gathered beyond one block. The partition
    is fixed by absolute position, and a block a row cannot see leaves its accumulators
    bit-identical (scale 1, add 0), so a row's result does not depend on its batch-mates. window > 0:
    a sliding window (as attention_reference's); the blocks before every row's window are skipped.

    ring: the caches are rings (a sliding layer's windowed KV, state.ring_len): absolute position p
    lives at p % R (R = the cache's length, a multiple of the blocks), the loops run over absolute
    positions up to `length` (the model's context) and read each block at its ring offset. A ring
    keeps the last R positions written, which hold every row's window (R >= window + T)."""
    b, t, h, d = q.shape
    r, kh = k_cache.shape[1], k_cache.shape[2]
    c = length if ring else r
    g = h // kh
    qg = q.reshape(b, t, kh, g, d).astype(jnp.float32) * (d ** -0.5)
    q_pos = q_pos.astype(jnp.int32)
    last = jnp.max(q_pos, axis=1)  # [B]
    reach = jnp.max(last) + 1  # keys any row attends: 0..reach-1
    bf = min(fine_k, c)
    span = bf * (min(fine_span, c) // bf)  # [0, span): fine blocks; [span, c): coarse blocks
    bk = min(block_k, c)

    if ring and (r % bf or r % bk or span % bk or r < window + t):
        raise ValueError(f"cached_attention_blocked: a ring of {r} must be a multiple of the key blocks "
                         f"({bf}, {bk}; {span} in fine ones) and hold the window ({window}) and the step ({t})")

    def read(cache, start, n):  # [B, n, K, D] f32: each row's slot, keys start..start+n-1
        at = start % r if ring else start  # a block never wraps: aligned, and r a multiple of n
        width = cache.shape[3]  # D, or a q8_0 cache's D / 32 * 34 bytes
        return kv_values(jax.vmap(lambda s: jax.lax.dynamic_slice(cache, (s, at, 0, 0), (1, n, kh, width))[0])(slots))

    def attend_block(carry, first, start, n):
        """Keys first..first+n-1 (read from `start` <= first: a block may overlap the one before it
        at the end of the cache; the overlap is masked out)."""
        acc, m, l = carry
        kpos = start + jnp.arange(n)
        fresh = kpos >= first  # keys an earlier block already covered are skipped
        visible = fresh[None, None, :] & (kpos[None, None, :] <= q_pos[:, :, None])  # [B, T, n]
        if window:
            visible = visible & (q_pos[:, :, None] - kpos[None, None, :] < window)
        k = read(k_cache, start, n)
        v = read(v_cache, start, n)
        seen = fresh[None, :] & (kpos[None, :] <= last[:, None])  # [B, n]: no stale NaN leaks via 0 * x
        if ring:  # and a ring slot holds kpos only while kpos is among the last r positions
            seen = seen & (kpos[None, :] > last[:, None] - r)
        v = jnp.where(seen[:, :, None, None], v, 0.0)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k)
        s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        return (acc * scale[..., None] + jnp.einsum("btkgs,bskd->btkgd", p, v),
                m_new, l * scale + jnp.sum(p, axis=-1))

    def fine(i, carry):
        return attend_block(carry, i * bf, i * bf, bf)

    def coarse(i, carry):
        first = span + i * bk
        # A block past the end of a ring's context reads ring slots its keys mask out.
        return attend_block(carry, first, first if ring else jnp.minimum(first, c - bk), bk)

    carry = (jnp.zeros((b, t, kh, g, d), jnp.float32), jnp.full((b, t, kh, g), -1e30, jnp.float32),
             jnp.zeros((b, t, kh, g), jnp.float32))
    # With a window, blocks wholly before every row's window are skipped: such a block leaves the
    # accumulators bit-identical anyway, so a long context costs about its window, not its length.
    floor = jnp.maximum(jnp.min(jnp.where(q_pos >= 0, q_pos, reach)) - window + 1, 0) if window else 0
    if span:
        carry = jax.lax.fori_loop(jnp.minimum(floor // bf, span // bf), jnp.clip((reach + bf - 1) // bf, 0, span // bf),
                                  fine, carry)
    if span < c:
        carry = jax.lax.fori_loop(jnp.maximum(floor - span, 0) // bk,
                                  jnp.clip((reach - span + bk - 1) // bk, 0, -(-(c - span) // bk)), coarse, carry)
    acc, _, l = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _check_decode_args(q, k_cache, v_cache, slots, lengths, what):
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"{what}: q must be [B, H, D] and k_cache/v_cache [N_slots, C, K, D]; got "
                         f"q{tuple(q.shape)}, k_cache{tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{what}: k_cache{tuple(k_cache.shape)} and v_cache{tuple(v_cache.shape)} differ")
    b, h, d = q.shape
    if k_cache.shape[3] != d:
        raise ValueError(f"{what}: head_dim of q ({d}) and cache ({k_cache.shape[3]}) differ")
    if k_cache.shape[2] == 0 or h % k_cache.shape[2]:
        raise ValueError(f"{what}: {h} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    for name, a in (("slots", slots), ("lengths", lengths)):
        if tuple(a.shape) != (b,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{what}: {name} must be integer [B] = ({b},), got {a.dtype}{tuple(a.shape)}")
    return b, h, d


def _decode_kernel(slot_ref, len_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, block_k: int,
                   split_len: int, ctx: int, n_slots: int, scale: float, window: int = 0, ring: bool = False):
    """One (row b, kv head, split): slot_ref/len_ref [1] int32; q_ref [Gp, D]; k_ref/v_ref
    [N_slots, C, D] (this kv head of the whole cache); outputs acc [Gp, D] (unnormalised), m, l [Gp].
    window > 0: only keys at positions >= length - window; ring: cache index i holds the latest
    position p <= length - 1 with p % C == i (a sliding layer's ring, model/state.py)."""
    split = pl.program_id(2)
    slot = jnp.clip(slot_ref[0], 0, n_slots - 1)
    full = jnp.maximum(len_ref[0], 0)  # the row's length, which a ring may exceed
    length = jnp.minimum(full, ctx)  # cache indices in use
    lo = split * split_len
    hi = jnp.minimum(lo + split_len, length)
    n_blocks = (jnp.maximum(hi - lo, 0) + block_k - 1) // block_k
    q = q_ref[...]
    gp, d = q.shape
    prec = _dot_precision(q.dtype)

    def body(j, carry):
        acc, m, l = carry
        start = lo + j * block_k
        # The last block of a context that is not a multiple of block_k is shifted back to stay in
        # bounds; positions before `start` it re-reads are masked out.
        read = jnp.minimum(start, ctx - block_k)
        k = k_ref[slot, pl.ds(read, block_k), :]
        v = v_ref[slot, pl.ds(read, block_k), :]
        idx = read + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        valid = (idx >= start) & (idx < hi)  # [1, bk]
        if window:
            kpos = full - 1 - lax.rem(full - 1 - idx, ctx) if ring else idx  # >= 0 where valid
            valid = valid & (kpos >= full - window)
        s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale  # [Gp, bk]
        return _online_softmax_step(acc, m, l, s, valid, v.astype(q.dtype), valid, prec)

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), _M_INIT, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def default_num_splits(ctx: int, block_k: int) -> int:
    """Context splits for decode: about one per 512 positions, at most 16, each >= one block."""
    return max(1, min(16, ctx // 512, ctx // block_k))


@partial(jax.jit, static_argnames=("block_k", "num_splits", "interpret", "num_warps", "num_stages", "window",
                                   "ring"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array,
                     lengths: jax.Array, *, block_k: int = 64, num_splits: int | None = None,
                     interpret: bool = False, num_warps: int = 4, num_stages: int = 2, window: int = 0,
                     ring: bool = False) -> jax.Array:
    """Pallas batched decode attention, semantics of `decode_attention_reference`.

    q: [B, H, D], the new token of each row (its key/value must already be in the cache);
    k_cache, v_cache: [N_slots, C, K, D] (a layer's slot cache, any float dtype; C >= 16);
    slots: int [B] cache slot of each row; lengths: int [B], row b attends positions
    0..lengths[b]-1 (clamped to [0, C]; 0 gives a zero output). Returns [B, H, D] in q's dtype.

    The kernel reads the cache in place: grid (B, K, num_splits), each program loads its row's slot
    index and length from the ordinary inputs `slots`/`lengths` and loops over the key blocks of its
    context split that lie below the length. The G = H/K query heads of a kv head share the key
    loads and are padded to max(16, next pow2) rows for Triton's dot. Partial results of the splits
    are merged with a log-sum-exp outside the kernel (a few KB).

    window > 0: a sliding layer's, only each row's last `window` positions; ring: the caches are
    rings (model/state.py: position p at p % C, lengths may exceed C; needs a window <= C). A ring
    reads every index in use and masks those outside the window."""
    b, h, d = _check_decode_args(q, k_cache, v_cache, slots, lengths, "decode_attention")
    if ring and not 0 < window <= k_cache.shape[1]:
        raise ValueError(f"decode_attention: a ring of {k_cache.shape[1]} needs a window it holds, got {window}")
    _check_head_dim(d, "decode_attention")
    if not (_is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"decode_attention: block_k={block_k} must be a power of 2 >= 16")
    n_slots, ctx, kh, _ = k_cache.shape
    if k_cache.size >= 2 ** 31:  # Triton addresses a ref with int32 element offsets
        raise ValueError(f"decode_attention: a cache of {k_cache.size} elements needs 64-bit offsets; "
                         f"keep one layer's cache under 2**31 elements")
    if ctx < 16:
        raise ValueError(f"decode_attention: cache length {ctx} must be >= 16")
    bk = min(block_k, _pow2_floor(ctx))
    splits = default_num_splits(ctx, bk) if num_splits is None else num_splits
    if not 1 <= splits <= pl.cdiv(ctx, bk):
        raise ValueError(f"decode_attention: num_splits={splits} must be in [1, {pl.cdiv(ctx, bk)}]")
    split_len = pl.cdiv(pl.cdiv(ctx, splits), bk) * bk
    group = h // kh
    gp = max(16, 1 << (group - 1).bit_length())
    qg = q.reshape(b, kh, group, d)
    if gp != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    kernel = partial(_decode_kernel, block_k=bk, split_len=split_len, ctx=ctx, n_slots=n_slots,
                     scale=d ** -0.5, window=window, ring=ring)
    part = (b, kh, splits, gp)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kh, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, ki, si: (bi,)),
            pl.BlockSpec((1,), lambda bi, ki, si: (bi,)),
            pl.BlockSpec((_SQ, _SQ, gp, d), lambda bi, ki, si: (bi, ki, 0, 0)),
            pl.BlockSpec((n_slots, ctx, _SQ, d), lambda bi, ki, si: (0, 0, ki, 0)),
            pl.BlockSpec((n_slots, ctx, _SQ, d), lambda bi, ki, si: (0, 0, ki, 0)),
        ],
        out_specs=[
            pl.BlockSpec((_SQ, _SQ, _SQ, gp, d), lambda bi, ki, si: (bi, ki, si, 0, 0)),
            pl.BlockSpec((_SQ, _SQ, _SQ, gp), lambda bi, ki, si: (bi, ki, si, 0)),
            pl.BlockSpec((_SQ, _SQ, _SQ, gp), lambda bi, ki, si: (bi, ki, si, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(part + (d,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pantheon_decode_attention",
    )(slots.astype(jnp.int32), lengths.astype(jnp.int32), qg, k_cache, v_cache)
    # Merge the splits: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # empty splits have m = _M_INIT and l = 0
    num = jnp.sum(w[..., None] * acc, axis=2)  # [B, K, Gp, D]
    den = jnp.sum(w * l, axis=2)[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    return out[:, :, :group].reshape(b, h, d).astype(q.dtype)
