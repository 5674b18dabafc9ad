"""Q3_K MoE: device planes, the grouped Q3_K matmul kernel (interpret=True) and the MoE FFN.

Weights are random Q3_K blocks from `quants.quantize_np`, inputs fresh random draws each run (the
seed is in every failure message). Group sizes are random and include empty groups; rows past
sum(group_sizes) are NaN-poisoned and must come out as zeros without leaking.

Tolerances: planes decode bit-exactly (0.0) like quants.dequantize. float32 matmuls compare with a
relative error max|a - b| / max|b| <= 2e-6 (only the summation order differs; float32 rounding of
a K<=1024 dot is ~1e-7 relative), against float64 numpy <= 2e-6. bfloat16 inputs <= 2e-2 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from pantheon.gguf.quants import dequantize_np, quantize_np
from pantheon.pallas.moe import moe_ffn, moe_ffn_reference, q8k_rows, route
from pantheon.pallas.moe_q3k import (PLANE_BYTES, Q3KPlanes, dequantize_planes, grouped_matmul_q3k,
                                     grouped_matmul_q3k_reference, q3k_planes_from_blocks, q3k_planes_to_blocks)

F32_REL = 2e-6


def _q3k(rng, e, n, k, scale=1.0):
    """Random Q3_K weights [E, N, K] -> (raw GGUF blocks, planes, float64 dequantised)."""
    w = (rng.standard_normal((e, n, k)) * scale).astype(np.float32)
    raw = quantize_np(w, T.Q3_K)
    planes = q3k_planes_from_blocks(raw)
    return raw, planes, dequantize_np(raw, T.Q3_K).astype(np.float64)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _groups(rng, e, m, *, short=0):
    """Random group sizes [E] summing to m - short, with at least one empty group."""
    sizes = rng.multinomial(m - short, rng.dirichlet(np.ones(e))).astype(np.int32)
    i, j = rng.choice(e, size=2, replace=False)
    sizes[j] += sizes[i]
    sizes[i] = 0
    return sizes


def _np_gmm(x, sizes, w):
    out = np.zeros((x.shape[0], w.shape[1]))
    s = 0
    for e, g in enumerate(sizes):
        out[s:s + g] = np.asarray(x[s:s + g], np.float64) @ w[e].T
        s += g
    return out


# ---- planes ------------------------------------------------------------------------------------------
def test_planes_are_a_lossless_rearrangement(rng):
    raw, planes, w = _q3k(rng, 3, 16, 768)
    assert planes.shape == (3, 16, 768) and planes.n_blocks == 3
    assert planes.qs.shape == (3, 16, 192) and planes.hm.shape == (3, 16, 96)
    assert planes.sc.shape == (3, 16, 48) and planes.d.shape == (3, 16, 3) and planes.d.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(q3k_planes_to_blocks(planes)), raw)
    np.testing.assert_array_equal(np.asarray(dequantize_planes(planes), np.float64), w)  # bit-exact
    assert planes.gguf_nbytes == raw.nbytes
    assert planes.nbytes == 3 * 16 * 3 * PLANE_BYTES  # 114 device bytes per 110-byte block
    # A pytree: device_put moves all four planes, jit sees them as arrays.
    dev = jax.device_put(planes)
    assert isinstance(dev, Q3KPlanes) and len(jax.tree_util.tree_leaves(dev)) == 4


def test_planes_from_2d_and_validation(rng):
    raw, _, _ = _q3k(rng, 1, 16, 256)
    assert q3k_planes_from_blocks(raw[0]).shape == (1, 16, 256)
    with pytest.raises(ValueError, match="uint8"):
        q3k_planes_from_blocks(raw[..., :100])
    with pytest.raises(ValueError, match="uint8"):
        q3k_planes_from_blocks(raw.astype(np.int16))


# ---- grouped matmul ------------------------------------------------------------------------------------
# (E, N, K, M, block_m, block_n, short): rows past the groups when short > 0.
GMM_CASES = [
    (4, 64, 512, 40, 16, 32, 0),
    (6, 32, 256, 50, 32, 64, 5),
    (3, 48, 768, 21, None, 64, 0),  # N = 48: the column tile drops to 16
]


@pytest.mark.parametrize("e,n,k,m,bm,bn,short", GMM_CASES)
def test_grouped_matmul_matches_reference(rng, e, n, k, m, bm, bn, short):
    _, planes, w = _q3k(rng, e, n, k)
    sizes = _groups(rng, e, m, short=short)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m - short:] = np.nan  # rows past the groups: must not leak
    xj, sj = jnp.asarray(x), jnp.asarray(sizes)
    out = np.asarray(grouped_matmul_q3k(xj, sj, planes, block_m=bm, block_n=bn, interpret=True))
    ref = np.asarray(grouped_matmul_q3k_reference(jnp.asarray(np.nan_to_num(x)), sj, planes))
    want = _np_gmm(np.nan_to_num(x), sizes, w)
    assert out.shape == (m, n) and np.isfinite(out).all(), f"seed {rng.seed}: NaN in output (sizes {sizes})"
    assert np.all(out[m - short:] == 0)
    assert _rel(out, ref) <= F32_REL, f"seed {rng.seed}: kernel vs reference {_rel(out, ref)} (sizes {sizes})"
    assert _rel(out, want) <= F32_REL, f"seed {rng.seed}: kernel vs float64 {_rel(out, want)}"
    assert _rel(ref, want) <= F32_REL, f"seed {rng.seed}: reference vs float64 {_rel(ref, want)}"


def test_grouped_matmul_integer_mode_is_ggml_q3k_q8k_arithmetic(rng):
    """With x_scale the rows are Q8_K codes: each super-block's dot is an exact integer sum against
    the integer weights (S - 32) * q, scaled by d_x * d_w (ggml_vec_dot_q3_K_q8_K). Kernel and
    reference against an int64 numpy transcription."""
    from pantheon.gguf.quants import integer_parts
    e, n, k, m = 3, 32, 512, 40
    raw, planes, _ = _q3k(rng, e, n, k)
    sizes = _groups(rng, e, m)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    q, xs = q8k_rows(jnp.asarray(x), "q8_k")
    out = np.asarray(grouped_matmul_q3k(q, jnp.asarray(sizes), planes, xs, block_m=16, block_n=16, interpret=True))
    ref = np.asarray(grouped_matmul_q3k_reference(q, jnp.asarray(sizes), planes, xs))
    c, d, _, _ = (np.asarray(a) if a is not None else None for a in integer_parts(raw, T.Q3_K))  # [E, N, K], [E, N, nb]
    qi, dx = np.asarray(q).astype(np.int64), np.asarray(xs)
    want, row = np.zeros((m, n)), 0
    for ex, g in enumerate(sizes):
        for r in range(row, row + g):
            isum = np.einsum("bk,nbk->nb", qi[r].reshape(2, 256), c[ex].astype(np.int64).reshape(n, 2, 256))
            want[r] = ((dx[r][None] * d[ex]).astype(np.float32) * isum.astype(np.float32)).astype(np.float64).sum(-1)
        row += g
    assert np.array_equal(np.asarray(q), np.round(np.asarray(q))) and np.abs(np.asarray(q)).max() <= 127
    assert _rel(out, want) <= 1e-6 and _rel(ref, want) <= 1e-6, f"seed {rng.seed}: {_rel(out, want)} {_rel(ref, want)}"
    with pytest.raises(ValueError, match="x_scale must be"):
        grouped_matmul_q3k_reference(q, jnp.asarray(sizes), planes, xs[:, :1])


def test_grouped_matmul_bf16_and_one_expert_takes_all(rng):
    e, n, k, m = 4, 32, 256, 24
    _, planes, w = _q3k(rng, e, n, k)
    sizes = np.zeros(e, np.int32)
    sizes[rng.integers(0, e)] = m  # every other group empty
    x = rng.standard_normal((m, k)).astype(np.float32)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    out = grouped_matmul_q3k(xb, jnp.asarray(sizes), planes, block_m=16, interpret=True)
    assert out.dtype == jnp.bfloat16
    want = _np_gmm(np.asarray(xb.astype(jnp.float32)), sizes, w)
    assert _rel(out.astype(jnp.float32), want) <= 2e-2, f"seed {rng.seed}"


def test_grouped_matmul_validation(rng):
    _, planes, _ = _q3k(rng, 2, 16, 256)
    x, sizes = jnp.zeros((4, 256)), jnp.array([2, 2], jnp.int32)
    for fn in (lambda *a: grouped_matmul_q3k(*a, interpret=True), grouped_matmul_q3k_reference):
        with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
            fn(jnp.zeros((4, 512)), sizes, planes)
        with pytest.raises(ValueError, match="group_sizes"):
            fn(x, jnp.array([4], jnp.int32), planes)
        with pytest.raises(ValueError, match="group_sizes"):
            fn(x, jnp.array([2.0, 2.0]), planes)
        with pytest.raises(ValueError, match="Q3KPlanes"):
            fn(x, sizes, np.zeros((2, 16, 256)))
        bad = Q3KPlanes(planes.qs, planes.hm, planes.sc[..., :12], planes.d)
        with pytest.raises(ValueError, match="plane sc"):
            fn(x, sizes, bad)
    with pytest.raises(ValueError, match="block_m=24"):
        grouped_matmul_q3k(x, sizes, planes, block_m=24, interpret=True)
    _, odd, _ = _q3k(rng, 2, 8, 256)
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_matmul_q3k(x, sizes, odd, interpret=True)


# ---- the MoE FFN ---------------------------------------------------------------------------------------
def test_route_matches_numpy(rng):
    logits = rng.standard_normal((6, 16)).astype(np.float32) * 3
    w, idx = route(jnp.asarray(logits), 4)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want_idx = np.argsort(-p, axis=-1)[:, :4]
    want_w = np.take_along_axis(p, want_idx, -1)
    want_w /= np.maximum(want_w.sum(-1, keepdims=True), 6.1e-5)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)


def _moe_weights(rng, e, dm, f, fused):
    if fused:
        _, gate_up, _ = _q3k(rng, e, 2 * f, dm, 0.05)
        gate, up = gate_up, None
    else:
        gate, up = _q3k(rng, e, f, dm, 0.05)[1], _q3k(rng, e, f, dm, 0.05)[1]
    return gate, up, _q3k(rng, e, dm, f, 0.05)[1]


# (T, D, F, E, top_k, fused gate_up, activation schemes). With Q8_K rounding the products are integer
# sums scaled by d_x * d_w, the same numbers in every implementation, so even the down input (a
# function of those products) rounds alike and all three can be rounded.
Q8K = ("q8_k",) * 3
MOE_CASES = [(5, 256, 256, 8, 2, False, None), (7, 512, 256, 6, 3, True, Q8K), (3, 256, 512, 4, 1, False, Q8K)]


@pytest.mark.parametrize("t,dm,f,e,k,fused,schemes", MOE_CASES)
def test_moe_ffn_matches_dense_reference(rng, t, dm, f, e, k, fused, schemes):
    gate, up, down = _moe_weights(rng, e, dm, f, fused)
    x = jnp.asarray(rng.standard_normal((t, dm)).astype(np.float32))
    logits = jnp.asarray(rng.standard_normal((t, e)).astype(np.float32) * 2)
    dense = np.asarray(moe_ffn_reference(x, logits, k, gate, up, down, schemes=schemes))
    ref = np.asarray(moe_ffn(x, logits, k, gate, up, down, impl="reference", schemes=schemes))
    out = np.asarray(moe_ffn(x, logits, k, gate, up, down, impl="interpret", schemes=schemes))
    assert out.shape == (t, dm) and np.isfinite(out).all(), f"seed {rng.seed}"
    assert _rel(ref, dense) <= 1e-5, f"seed {rng.seed}: reference vs dense {_rel(ref, dense)}"
    assert _rel(out, dense) <= 1e-5, f"seed {rng.seed}: interpret vs dense {_rel(out, dense)}"
    if schemes:  # the rounding is really applied
        plain = np.asarray(moe_ffn_reference(x, logits, k, gate, up, down))
        assert _rel(plain, dense) > 1e-4


@pytest.mark.parametrize("down_kind", ["f32", "q4_k_int"])
def test_moe_ffn_with_a_dense_down_matches_dense_reference(rng, down_kind):
    """A Q3_K_M-style mix: Q3_K gate/up planes through the grouped kernel, the down projection dense
    ([E, F, D] f32, or Q4_K IntBlocks with Q8_K rounding: llama.cpp's integer arithmetic)."""
    from pantheon.gguf.arithmetic import IntBlocks
    t, dm, f, e, k = 6, 256, 256, 4, 2
    gate, up, _ = _moe_weights(rng, e, dm, f, False)
    wd = (rng.standard_normal((e, dm, f)) * 0.05).astype(np.float32)  # [E, out, in]
    if down_kind == "f32":
        down, schemes = jnp.asarray(np.swapaxes(wd, 1, 2)), None
    else:
        down, schemes = IntBlocks.from_gguf(quantize_np(wd, T.Q4_K), T.Q4_K, f), Q8K
        down = IntBlocks(*(jnp.asarray(a) for a in (down.c, down.d, down.mn, down.dmin)), group=down.group)
    x = jnp.asarray(rng.standard_normal((t, dm)).astype(np.float32))
    logits = jnp.asarray(rng.standard_normal((t, e)).astype(np.float32) * 2)
    dense = np.asarray(moe_ffn_reference(x, logits, k, gate, up, down, schemes=schemes))
    for impl in ("reference", "interpret"):
        out = np.asarray(moe_ffn(x, logits, k, gate, up, down, impl=impl, schemes=schemes))
        assert _rel(out, dense) <= 1e-5, f"seed {rng.seed}: {impl} vs dense {_rel(out, dense)}"
    with pytest.raises(ValueError, match="dense down weights"):
        moe_ffn(x, logits, k, gate, up, jnp.zeros((e, dm, f + 16)), impl="reference")


def test_moe_ffn_all_experts_bf16(rng):
    t, dm, f, e = 4, 256, 256, 4
    gate, up, down = _moe_weights(rng, e, dm, f, False)
    x = jnp.asarray(rng.standard_normal((t, dm)).astype(np.float32))
    logits = jnp.asarray(rng.standard_normal((t, e)).astype(np.float32))
    dense = np.asarray(moe_ffn_reference(x, logits, e, gate, up, down))
    out = moe_ffn(x.astype(jnp.bfloat16), logits, e, gate, up, down, impl="interpret")
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), dense) <= 3e-2, f"seed {rng.seed}"


def test_moe_ffn_validation(rng):
    gate, up, down = _moe_weights(rng, 4, 256, 512, False)
    x, logits = jnp.zeros((2, 256)), jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="impl"):
        moe_ffn(x, logits, 2, gate, up, down, impl="triton")
    for fn in (lambda *a, **kw: moe_ffn(*a, impl="reference", **kw), moe_ffn_reference):
        with pytest.raises(ValueError, match="top_k=5"):
            fn(x, logits, 5, gate, up, down)
        with pytest.raises(ValueError, match="router_logits"):
            fn(x, jnp.zeros((3, 4)), 2, gate, up, down)
        with pytest.raises(ValueError, match="hidden 512"):
            fn(jnp.zeros((2, 512)), logits, 2, gate, up, down)
        with pytest.raises(ValueError, match="down weights"):
            fn(x, logits, 2, gate, up, gate)
        with pytest.raises(ValueError, match="differ"):
            fn(x, logits, 2, gate, down, down)
        with pytest.raises(ValueError, match="schemes"):
            fn(x, logits, 2, gate, up, down, schemes=("q8_k",))
