"""Quantized weights on the GPU: the planes (a byte re-arrangement of the GGUF blocks) and the
Pallas matmul that decodes them (interpret=True here), dense and grouped, against the reference
(quants.dequantize of the reassembled blocks) and a float64 product, for every type it reads, on
fresh random blocks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from pantheon.gguf.quants import dequantize_np, quantize_np
from pantheon.pallas.qmatmul import (TYPES, QPlanes, dequantize_planes, grouped_qmatmul, grouped_qmatmul_reference,
                                     planes_from_blocks, planes_to_blocks, qmatmul, qmatmul_reference, step_weights)

F32_REL = 2e-6
QTYPES = sorted(TYPES, key=lambda t: t.name)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _weights(rng, qtype, e, n, k):
    """Random weights [E, N, K] of qtype -> (raw GGUF rows [E, N, bytes], float64 dequantized)."""
    w = rng.standard_normal((e, n, k)).astype(np.float32)
    raw = quantize_np(w, qtype).reshape(e, n, -1)
    return raw, dequantize_np(raw, qtype).astype(np.float64).reshape(e, n, k)


def _groups(rng, e, m, short=0):
    sizes = rng.multinomial(m - short, rng.dirichlet(np.ones(e))).astype(np.int32)
    i, j = rng.choice(e, size=2, replace=False)
    sizes[j] += sizes[i]
    sizes[i] = 0
    return sizes


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_planes_are_the_blocks_rearranged(rng, qtype):
    """Bytes back together give the file's rows; the device bytes stay within 2.8 % of them."""
    k = 512
    raw, dense = _weights(rng, qtype, 2, 24, k)
    p = planes_from_blocks(raw, qtype)
    assert p.shape == (2, 24, k) and p.type == qtype
    np.testing.assert_array_equal(np.asarray(planes_to_blocks(p)), raw)
    np.testing.assert_array_equal(np.asarray(dequantize_planes(p)), dense.astype(np.float32))
    assert p.gguf_nbytes == raw.nbytes and p.nbytes <= 1.028 * raw.nbytes
    for a in p.planes:  # power-of-2 widths a step loads
        assert a.shape[2] % (k // step_weights(qtype, k)) == 0


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dense_kernel_matches_the_reference(rng, qtype):
    """One row (decode), a partial tile and several tiles; K = 640 (Gemma's width: 128-weight steps
    for the 32-weight types) where the type allows it."""
    shapes = [(48, 512, 1), (64, 768, 5), (32, 256, 37)]
    if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K):
        shapes.append((32, 640, 3))
    for n, k, m in shapes:
        raw, dense = _weights(rng, qtype, 1, n, k)
        p = planes_from_blocks(raw, qtype)
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = np.asarray(qmatmul(jnp.asarray(x), p, block_n=32, interpret=True))
        ref = np.asarray(qmatmul_reference(jnp.asarray(x), p))
        want = x.astype(np.float64) @ dense[0].T
        assert got.shape == (m, n) and np.isfinite(got).all()
        assert _rel(got, want) <= F32_REL, f"seed {rng.seed} {qtype.name} {(n, k, m)}: kernel {_rel(got, want)}"
        assert _rel(ref, want) <= F32_REL, f"seed {rng.seed} {qtype.name} {(n, k, m)}: reference {_rel(ref, want)}"


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_grouped_kernel_matches_the_reference(rng, qtype):
    """Experts: rows sorted by expert, one group empty, rows past the groups zero (and unread: NaN)."""
    e, n, k, m, short = 4, 32, 512, 40, 3
    raw, dense = _weights(rng, qtype, e, n, k)
    p = planes_from_blocks(raw, qtype)
    sizes = _groups(rng, e, m, short)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m - short:] = np.nan
    got = np.asarray(grouped_qmatmul(jnp.asarray(x), jnp.asarray(sizes), p, block_m=16, block_n=16, interpret=True))
    ref = np.asarray(grouped_qmatmul_reference(jnp.asarray(np.nan_to_num(x)), jnp.asarray(sizes), p))
    want, row = np.zeros((m, n)), 0
    for ex, g in enumerate(sizes):
        want[row:row + g] = x[row:row + g].astype(np.float64) @ dense[ex].T
        row += g
    assert np.isfinite(got).all() and np.all(got[m - short:] == 0)
    assert _rel(got, want) <= F32_REL, f"seed {rng.seed} {qtype.name}: kernel {_rel(got, want)} (sizes {sizes})"
    assert _rel(ref, want) <= F32_REL, f"seed {rng.seed} {qtype.name}: reference {_rel(ref, want)}"


def test_bf16_rows_multiply_weights_rounded_to_bf16(rng):
    raw, dense = _weights(rng, T.Q4_K, 1, 32, 512)
    p = planes_from_blocks(raw, T.Q4_K)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    got = np.asarray(qmatmul(jnp.asarray(x, jnp.bfloat16), p, block_n=32, interpret=True), np.float64)
    assert _rel(got, x.astype(np.float64) @ dense[0].T) <= 2e-2


def test_bad_input_is_refused_with_what_was_expected(rng):
    raw, _ = _weights(rng, T.Q8_0, 1, 16, 64)
    with pytest.raises(ValueError, match="no GPU kernel reads Q2_K"):
        planes_from_blocks(quantize_np(rng.standard_normal((16, 256)).astype(np.float32), T.Q2_K), T.Q2_K)
    with pytest.raises(ValueError, match=r"expected uint8 \[E, N, blocks \* 34\]"):
        planes_from_blocks(raw[..., :-1], T.Q8_0)
    p = planes_from_blocks(raw, T.Q8_0)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        qmatmul(jnp.zeros((2, 32)), p, interpret=True)
    bad = QPlanes((p.planes[0], p.planes[1][..., :1]), p.qtype, p.n_in)
    with pytest.raises(ValueError, match="plane d is"):
        qmatmul(jnp.zeros((2, 64)), bad, interpret=True)
