"""Attention: the jnp reference vs float64 numpy, the Pallas kernels (interpret=True) vs the reference.

Inputs are fresh random draws each run (the seed is in every failure message). Positions no query
may see are poisoned with NaN: a kernel that reads or weights them leaks NaN into the output, and
interpret mode fills any output block a kernel forgets to write with NaN.

Tolerances (float32): reference vs float64 numpy <= 1e-5 abs; kernels vs reference <= 5e-5 abs
(outputs are convex combinations of N(0,1) values, |out| < 4). bfloat16 kernels <= 3e-2 abs
against the float32 reference of the same bf16 inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.model import layers
from pantheon.pallas.attention import (attention_reference, decode_attention, decode_attention_reference,
                                       flash_attention)

F32_TOL = 5e-5


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _np_attention(q, k, v, q_pos):
    """float64 numpy: per (b, t, h) softmax over visible keys; no visible key -> zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            vis = np.arange(s) <= q_pos[bi, ti]
            if not vis.any():
                continue
            for hi in range(h):
                sc = k[bi, vis, hi // g] @ q[bi, ti, hi] / np.sqrt(d)
                p = np.exp(sc - sc.max())
                out[bi, ti, hi] = (p / p.sum()) @ v[bi, vis, hi // g]
    return out


def _positions(rng, b, t, s, *, padded_rows=True):
    """q_pos [B, T]: each row a chunk of consecutive positions at a random offset inside S; with
    padded_rows, row 0's tail is padding (-1) when T > 1."""
    pos = np.zeros((b, t), np.int32)
    for bi in range(b):
        start = int(rng.integers(0, max(1, s - t + 1)))
        pos[bi] = start + np.arange(t)
    if padded_rows and t > 1:
        pos[0, t // 2:] = -1
    return np.minimum(pos, s - 1)


def _poison_invisible(k, v, q_pos):
    """NaN every key/value position past the largest q_pos of its row (no query can see it)."""
    k, v = k.copy(), v.copy()
    for bi in range(k.shape[0]):
        last = int(q_pos[bi].max())
        k[bi, last + 1:] = np.nan
        v[bi, last + 1:] = np.nan
    return k, v


def test_gqa_attention_is_the_reference():
    assert layers.gqa_attention is attention_reference


@pytest.mark.parametrize("b,t,h,kh,d,s", [(2, 5, 4, 2, 16, 9), (1, 7, 6, 2, 32, 12), (3, 1, 8, 8, 16, 20)])
def test_reference_matches_float64_numpy(rng, b, t, h, kh, d, s):
    q, k, v = _normal(rng, (b, t, h, d)), _normal(rng, (b, s, kh, d)), _normal(rng, (b, s, kh, d))
    pos = _positions(rng, b, t, s)
    out = np.asarray(attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos)))
    err = np.abs(out - _np_attention(q, k, v, pos)).max()
    assert err <= 1e-5, f"seed {rng.seed}: max err {err}"
    if t > 1:  # padded queries of row 0 give zeros, not NaN
        assert np.all(out[0, t // 2:] == 0)


def test_reference_ignores_nan_past_the_visible_range(rng):
    b, t, h, kh, d, s = 2, 4, 4, 2, 16, 16
    q, k, v = _normal(rng, (b, t, h, d)), _normal(rng, (b, s, kh, d)), _normal(rng, (b, s, kh, d))
    pos = _positions(rng, b, t, 10, padded_rows=False)
    kp, vp = _poison_invisible(k, v, pos)
    out = np.asarray(attention_reference(*(jnp.asarray(a) for a in (q, kp, vp, pos))))
    err = np.abs(out - _np_attention(q, k, v, pos)).max()
    assert np.isfinite(out).all() and err <= 1e-5, f"seed {rng.seed}: max err {err}"


# (B, T, H, K, D, S, block_q, block_k): GQA groups 1/2/3/8, T and S not multiples of the blocks,
# head_dim 64/128/256, several query blocks and key blocks.
FLASH_CASES = [
    (2, 20, 4, 2, 64, 70, 16, 16),
    (1, 33, 6, 2, 128, 48, 16, 32),
    (2, 16, 2, 1, 256, 40, 16, 16),
    (1, 40, 8, 1, 64, 128, 32, 64),
]


@pytest.mark.parametrize("b,t,h,kh,d,s,bq,bk", FLASH_CASES)
def test_flash_attention_matches_reference(rng, b, t, h, kh, d, s, bq, bk):
    q, k, v = _normal(rng, (b, t, h, d)), _normal(rng, (b, s, kh, d)), _normal(rng, (b, s, kh, d))
    pos = _positions(rng, b, t, s)
    kp, vp = _poison_invisible(k, v, pos)
    ref = np.asarray(attention_reference(*(jnp.asarray(a) for a in (q, k, v, pos))))
    out = np.asarray(flash_attention(*(jnp.asarray(a) for a in (q, kp, vp, pos)), block_q=bq, block_k=bk,
                                     interpret=True))
    assert out.shape == (b, t, h, d) and out.dtype == np.float32
    assert np.isfinite(out).all(), f"seed {rng.seed}: NaN/inf in the kernel output"
    err = np.abs(out - ref).max()
    assert err <= F32_TOL, f"seed {rng.seed}: max err {err}"


def test_flash_attention_bf16(rng):
    b, t, h, kh, d, s = 1, 32, 4, 2, 128, 64
    q, k, v = (jnp.asarray(_normal(rng, sh)).astype(jnp.bfloat16)
               for sh in ((b, t, h, d), (b, s, kh, d), (b, s, kh, d)))
    pos = jnp.asarray(_positions(rng, b, t, s, padded_rows=False))
    out = flash_attention(q, k, v, pos, block_q=16, block_k=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    ref = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), pos)
    err = float(jnp.abs(out.astype(jnp.float32) - ref).max())
    assert err <= 3e-2, f"seed {rng.seed}: max err {err}"


def _cache_case(rng, b, h, kh, d, n_slots, ctx, dtype=np.float32):
    """Random decode inputs; every cache position a row must not read is NaN."""
    q = _normal(rng, (b, h, d))
    kc, vc = _normal(rng, (n_slots, ctx, kh, d)), _normal(rng, (n_slots, ctx, kh, d))
    slots = rng.permutation(n_slots)[:b].astype(np.int32)
    if b > 1:
        slots[-1] = slots[0]  # two rows may share a slot (e.g. padding rows on the scratch slot)
    lengths = rng.integers(0, ctx + 1, size=b).astype(np.int32)
    lengths[0] = ctx  # full context
    if b > 2:
        lengths[1] = 1
    if b > 3:
        lengths[2] = 0  # no keys -> zeros
    reach = np.zeros(n_slots, np.int64)
    for sl, ln in zip(slots, lengths):
        reach[sl] = max(reach[sl], ln)
    kp, vp = kc.copy(), vc.copy()
    for sl in range(n_slots):
        kp[sl, reach[sl]:] = np.nan
        vp[sl, reach[sl]:] = np.nan
    return q, kc, vc, kp, vp, slots, lengths


# (B, H, K, D, N_slots, C, block_k, num_splits): ragged lengths incl. 0, 1 and C; C not a multiple
# of the key block (the last block is shifted back); GQA groups 1, 3, 4, 8.
DECODE_CASES = [
    (5, 8, 2, 64, 7, 100, 16, 3),
    (4, 6, 2, 128, 5, 64, 32, 1),
    (3, 8, 1, 256, 4, 48, 16, None),
    (2, 2, 2, 64, 3, 40, 16, 2),
]


@pytest.mark.parametrize("b,h,kh,d,n_slots,ctx,bk,splits", DECODE_CASES)
def test_decode_attention_matches_reference(rng, b, h, kh, d, n_slots, ctx, bk, splits):
    q, kc, vc, kp, vp, slots, lengths = _cache_case(rng, b, h, kh, d, n_slots, ctx)
    ref = np.asarray(decode_attention_reference(*(jnp.asarray(a) for a in (q, kc, vc, slots, lengths))))
    out = np.asarray(decode_attention(*(jnp.asarray(a) for a in (q, kp, vp, slots, lengths)), block_k=bk,
                                      num_splits=splits, interpret=True))
    assert out.shape == (b, h, d)
    assert np.isfinite(out).all(), f"seed {rng.seed}: NaN/inf in the kernel output"
    err = np.abs(out - ref).max()
    assert err <= F32_TOL, f"seed {rng.seed}: max err {err} (lengths {lengths}, slots {slots})"
    assert np.all(out[lengths == 0] == 0)


def test_decode_reference_matches_float64_numpy(rng):
    b, h, kh, d, n_slots, ctx = 4, 4, 2, 16, 5, 24
    q, kc, vc, kp, vp, slots, lengths = _cache_case(rng, b, h, kh, d, n_slots, ctx)
    ref = np.asarray(decode_attention_reference(*(jnp.asarray(a) for a in (q, kp, vp, slots, lengths))))
    want = _np_attention(q[:, None], kc[slots], vc[slots], (lengths - 1)[:, None])[:, 0]
    err = np.abs(ref - want).max()
    assert np.isfinite(ref).all() and err <= 1e-5, f"seed {rng.seed}: max err {err}"


def test_decode_attention_bf16_cache(rng):
    b, h, kh, d, n_slots, ctx = 3, 4, 2, 128, 4, 64
    q, kc, vc, kp, vp, slots, lengths = _cache_case(rng, b, h, kh, d, n_slots, ctx)
    qb, kb, vb = (jnp.asarray(a).astype(jnp.bfloat16) for a in (q, kp, vp))
    out = decode_attention(qb, kb, vb, jnp.asarray(slots), jnp.asarray(lengths), block_k=16, num_splits=2,
                           interpret=True)
    ref = decode_attention_reference(qb.astype(jnp.float32), jnp.asarray(kc).astype(jnp.bfloat16).astype(jnp.float32),
                                     jnp.asarray(vc).astype(jnp.bfloat16).astype(jnp.float32),
                                     jnp.asarray(slots), jnp.asarray(lengths))
    assert out.dtype == jnp.bfloat16
    err = float(jnp.abs(out.astype(jnp.float32) - ref).max())
    assert err <= 3e-2, f"seed {rng.seed}: max err {err}"


# ---- input validation --------------------------------------------------------------------------------
def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("fn", [attention_reference, lambda *a: flash_attention(*a, interpret=True)])
@pytest.mark.parametrize("args,match", [
    ((_z(1, 4, 3, 16), _z(1, 8, 2, 16), _z(1, 8, 2, 16), _z(1, 4, dtype=jnp.int32)), "not a multiple"),
    ((_z(1, 4, 4, 16), _z(1, 8, 2, 16), _z(1, 9, 2, 16), _z(1, 4, dtype=jnp.int32)), "differ"),
    ((_z(1, 4, 4, 16), _z(1, 8, 2, 32), _z(1, 8, 2, 32), _z(1, 4, dtype=jnp.int32)), "head_dim"),
    ((_z(1, 4, 4, 16), _z(1, 8, 2, 16), _z(1, 8, 2, 16), _z(1, 5, dtype=jnp.int32)), "q_pos"),
    ((_z(1, 4, 4, 16), _z(1, 8, 2, 16), _z(1, 8, 2, 16), _z(1, 4)), "q_pos"),
    ((_z(4, 4, 16), _z(1, 8, 2, 16), _z(1, 8, 2, 16), _z(1, 4, dtype=jnp.int32)), r"\[B, T, H, D\]"),
])
def test_attention_validation(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_flash_attention_kernel_limits():
    q, kv, pos = _z(1, 4, 2, 80), _z(1, 8, 2, 80), _z(1, 4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="power of 2"):
        flash_attention(q, kv, kv, pos, interpret=True)
    q, kv = _z(1, 4, 2, 16), _z(1, 8, 2, 16)
    with pytest.raises(ValueError, match="block_q=24"):
        flash_attention(q, kv, kv, pos, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="block_k=8"):
        flash_attention(q, kv, kv, pos, block_k=8, interpret=True)


@pytest.mark.parametrize("fn", [decode_attention_reference, lambda *a: decode_attention(*a, interpret=True)])
@pytest.mark.parametrize("args,match", [
    ((_z(2, 4, 16), _z(3, 32, 3, 16), _z(3, 32, 3, 16), _z(2, dtype=jnp.int32), _z(2, dtype=jnp.int32)),
     "not a multiple"),
    ((_z(2, 4, 16), _z(3, 32, 2, 16), _z(3, 32, 2, 16), _z(3, dtype=jnp.int32), _z(2, dtype=jnp.int32)), "slots"),
    ((_z(2, 4, 16), _z(3, 32, 2, 16), _z(3, 32, 2, 16), _z(2, dtype=jnp.int32), _z(2)), "lengths"),
    ((_z(2, 4, 16), _z(3, 32, 2, 32), _z(3, 32, 2, 32), _z(2, dtype=jnp.int32), _z(2, dtype=jnp.int32)), "head_dim"),
    ((_z(2, 1, 4, 16), _z(3, 32, 2, 16), _z(3, 32, 2, 16), _z(2, dtype=jnp.int32), _z(2, dtype=jnp.int32)),
     r"\[B, H, D\]"),
])
def test_decode_validation(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_decode_kernel_limits():
    q, sl = _z(2, 4, 16), _z(2, dtype=jnp.int32)
    with pytest.raises(ValueError, match="num_splits=5"):
        decode_attention(q, _z(3, 64, 2, 16), _z(3, 64, 2, 16), sl, sl, block_k=16, num_splits=5, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):
        decode_attention(q, _z(3, 8, 2, 16), _z(3, 8, 2, 16), sl, sl, interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        decode_attention(_z(2, 4, 48), _z(3, 64, 2, 48), _z(3, 64, 2, 48), sl, sl, interpret=True)
