"""The blocked jnp attention of the CPU serve path (`cached_attention_blocked`) against the plain
reference, on fresh random inputs: prefill chunks and decode rows, slots read in place, a cache
length that is not a multiple of the block, stale NaN past the visible range, and rows whose
result must not depend on their batch-mates."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.pallas.attention import attention_reference, cached_attention_blocked


def cache_and_rows(rng, n_slots, c, kh, d, slots):
    k = rng.standard_normal((n_slots, c, kh, d)).astype(np.float32)
    v = rng.standard_normal((n_slots, c, kh, d)).astype(np.float32)
    return k, v, np.asarray(slots, np.int32)


@pytest.mark.parametrize("t,c,block,fine,span,h,kh", [(1, 300, 64, 64, 256, 4, 2), (7, 300, 64, 32, 100, 6, 3),
                                                     (16, 256, 256, 64, 256, 4, 1), (32, 1000, 128, 64, 256, 8, 2),
                                                     (1, 1000, 256, 64, 256, 4, 2), (1, 40, 256, 64, 256, 4, 2),
                                                     (3, 700, 256, 48, 200, 4, 2)])
def test_blocked_matches_the_reference_on_the_rows_slots(rng, t, c, block, fine, span, h, kh):
    d, b, n_slots = 16, 3, 5
    k, v, slots = cache_and_rows(rng, n_slots, c, kh, d, [4, 0, 2])
    start = rng.integers(0, c - t, b)
    q_pos = (start[:, None] + np.arange(t)[None]).astype(np.int32)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    got = cached_attention_blocked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                                   jnp.asarray(q_pos), block_k=block, fine_k=fine, fine_span=span)
    want = attention_reference(jnp.asarray(q), jnp.asarray(k[slots]), jnp.asarray(v[slots]), jnp.asarray(q_pos))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5,
                               err_msg=f"seed {rng.seed}")


def test_stale_nan_past_the_position_never_leaks_and_negative_positions_give_zeros(rng):
    c, kh, d, h = 200, 2, 16, 4
    k, v, slots = cache_and_rows(rng, 2, c, kh, d, [1, 0])
    k[:, 150:], v[:, 150:] = np.nan, np.inf
    q = rng.standard_normal((2, 1, h, d)).astype(np.float32)
    q_pos = np.array([[149], [-1]], np.int32)
    out = np.asarray(cached_attention_blocked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                                              jnp.asarray(q_pos), block_k=64))
    assert np.isfinite(out).all() and not out[1].any()


@pytest.mark.parametrize("short", [40, 300])  # in the fine blocks, and past them
def test_a_rows_result_is_bit_identical_alone_and_beside_a_longer_row(rng, short):
    c, kh, d, h = 1024, 2, 16, 4
    k, v, _ = cache_and_rows(rng, 3, c, kh, d, [0])
    q = rng.standard_normal((2, 1, h, d)).astype(np.float32)
    pair = cached_attention_blocked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([0, 1], jnp.int32),
                                    jnp.asarray([[short], [1000]], jnp.int32))
    alone = cached_attention_blocked(jnp.asarray(q[:1]), jnp.asarray(k), jnp.asarray(v),
                                     jnp.asarray([0], jnp.int32), jnp.asarray([[short]], jnp.int32))
    assert np.array_equal(np.asarray(pair[0]), np.asarray(alone[0]))
