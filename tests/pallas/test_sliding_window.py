"""Sliding-window attention (gemma3's sliding layers): the blocked jnp path that serves them and the
host fallback against the plain reference, on fresh random caches; a window as long as the context
is plain causal attention."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pantheon.model.host_attention import host_attend
from pantheon.pallas.attention import attention_reference, cached_attention_blocked, decode_attention


def caches(rng, n_slots=3, ctx=80, kv=2, d=16):
    k = rng.standard_normal((n_slots, ctx, kv, d)).astype(np.float32)
    v = rng.standard_normal((n_slots, ctx, kv, d)).astype(np.float32)
    return k, v


@pytest.mark.parametrize("window", [1, 5, 64, 80])
@pytest.mark.parametrize("t", [1, 7])
def test_blocked_window_matches_the_reference(window, t):
    rng = np.random.default_rng(window * 10 + t)
    k, v = caches(rng)
    q = rng.standard_normal((2, t, 4, 16)).astype(np.float32)
    slots = np.array([2, 0], np.int32)
    pos = np.stack([np.arange(70 - t + 1, 71), np.arange(3, 3 + t)]).astype(np.int32)  # late and early rows
    got = cached_attention_blocked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), jnp.asarray(pos),
                                   fine_k=8, fine_span=16, block_k=32, window=window)
    want = attention_reference(jnp.asarray(q), jnp.asarray(k[slots]), jnp.asarray(v[slots]), jnp.asarray(pos),
                               window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    rows = np.arange(2)[:, None]  # this step's keys/values: what the cache already holds there
    host = host_attend(q, k[slots][rows, pos], v[slots][rows, pos], k.copy(), v.copy(), pos, slots, window)
    np.testing.assert_allclose(host, np.asarray(want), atol=2e-5, rtol=1e-5)


def test_skipping_the_blocks_before_the_window_changes_no_bit():
    """Deep in a long cache the loops start at the window: the result equals the reference, and a
    row's result is the same alone or beside a row that still needs the early blocks."""
    rng = np.random.default_rng(7)
    k, v = caches(rng, n_slots=2, ctx=1024)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    slots, pos = np.array([0, 1], np.int32), np.array([[1000], [40]], np.int32)
    run = lambda qq, ss, pp: np.asarray(cached_attention_blocked(  # noqa: E731
        jnp.asarray(qq), jnp.asarray(k), jnp.asarray(v), jnp.asarray(ss), jnp.asarray(pp), window=96))
    both = run(q, slots, pos)
    want = attention_reference(jnp.asarray(q), jnp.asarray(k[slots]), jnp.asarray(v[slots]), jnp.asarray(pos),
                               window=96)
    np.testing.assert_allclose(both, np.asarray(want), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(run(q[:1], slots[:1], pos[:1])[0], both[0])


def test_a_window_covering_the_context_is_causal_attention():
    rng = np.random.default_rng(0)
    k, v = caches(rng, n_slots=1)
    q = jnp.asarray(rng.standard_normal((1, 5, 4, 16)).astype(np.float32))
    pos = jnp.asarray(np.arange(40, 45, dtype=np.int32)[None])
    full = attention_reference(q, jnp.asarray(k), jnp.asarray(v), pos)
    np.testing.assert_array_equal(np.asarray(attention_reference(q, jnp.asarray(k), jnp.asarray(v), pos, window=80)),
                                  np.asarray(full))
    assert not np.allclose(np.asarray(attention_reference(q, jnp.asarray(k), jnp.asarray(v), pos, window=4)),
                           np.asarray(full), atol=1e-3)


@pytest.mark.parametrize("t", [1, 9])
def test_a_ring_holding_the_last_positions_attends_as_the_whole_cache(t):
    """A sliding layer's ring (position p at p % R, the last R positions written): the blocked path
    and the host fallback read it as the whole cache is read, for rows past several wraps and rows
    that have not wrapped yet; a ring's stale slots (older positions) never show."""
    rng = np.random.default_rng(11 + t)
    ctx, r, window = 1024, 128, 40
    k, v = caches(rng, n_slots=2, ctx=ctx)
    q = rng.standard_normal((2, t, 4, 16)).astype(np.float32)
    slots = np.array([1, 0], np.int32)
    pos = np.stack([np.arange(900 - t + 1, 901), np.arange(50, 50 + t)]).astype(np.int32)
    ring_k, ring_v = (rng.standard_normal((2, r, 2, 16)).astype(np.float32) for _ in range(2))  # stale
    for row, slot in enumerate(slots):
        last = int(pos[row].max())
        for p in range(max(last - r + 1, 0), last + 1):
            ring_k[slot, p % r], ring_v[slot, p % r] = k[slot, p], v[slot, p]
    want = attention_reference(jnp.asarray(q), jnp.asarray(k[slots]), jnp.asarray(v[slots]), jnp.asarray(pos),
                               window=window)
    got = cached_attention_blocked(jnp.asarray(q), jnp.asarray(ring_k), jnp.asarray(ring_v), jnp.asarray(slots),
                                   jnp.asarray(pos), fine_k=16, fine_span=64, block_k=64, window=window, ring=True,
                                   length=ctx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    rows = np.arange(2)[:, None]
    host = host_attend(q, k[slots][rows, pos], v[slots][rows, pos], ring_k.copy(), ring_v.copy(), pos, slots, window,
                       ring=True)
    np.testing.assert_allclose(host, np.asarray(want), atol=2e-5, rtol=1e-5)


def test_a_ring_too_short_for_its_window_is_refused():
    k = jnp.zeros((1, 64, 2, 16))
    with pytest.raises(ValueError, match="ring"):
        cached_attention_blocked(jnp.zeros((1, 1, 4, 16)), k, k, jnp.zeros(1, jnp.int32), jnp.full((1, 1), 100),
                                 window=80, ring=True, length=1024)


@pytest.mark.parametrize("ring", [False, True])
def test_the_pallas_decode_kernel_takes_a_window_and_a_ring(ring):
    """The Pallas decode kernel (interpret mode) with a window, over the whole cache or a ring holding
    each row's last R positions (rows past wraps and rows that have not wrapped): the reference."""
    rng = np.random.default_rng(5 + ring)
    ctx, r, window = 1024, 256, 40
    k, v = caches(rng, n_slots=3, ctx=ctx)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    slots, pos = np.array([2, 0, 1], np.int32), np.array([900, 30, 511], np.int32)
    want = attention_reference(jnp.asarray(q[:, None]), jnp.asarray(k[slots]), jnp.asarray(v[slots]),
                               jnp.asarray(pos[:, None]), window=window)[:, 0]
    if ring:
        k_in, v_in = (rng.standard_normal((3, r, 2, 16)).astype(np.float32) for _ in range(2))  # stale
        for slot, last in zip(slots, pos):
            keep = np.arange(max(last - r + 1, 0), last + 1)
            k_in[slot, keep % r], v_in[slot, keep % r] = k[slot, keep], v[slot, keep]
    else:
        k_in, v_in = k, v
    got = decode_attention(jnp.asarray(q), jnp.asarray(k_in), jnp.asarray(v_in), jnp.asarray(slots),
                           jnp.asarray(pos + 1), block_k=32, num_splits=2, interpret=True, window=window, ring=ring)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_a_q8_0_cache_is_read_as_its_values(window):
    """--kv-dtype q8_0 on the jnp paths: the blocked attention and the host fallback read ggml's
    blocks as d * code (and the host one writes this step's keys and values as blocks): the
    reference over the values the blocks hold."""
    from pantheon.gguf.arithmetic import q8_0_blocks, q8_0_values

    rng = np.random.default_rng(window)
    k, v = caches(rng, d=64)
    kq, vq = (np.asarray(q8_0_blocks(jnp.asarray(a))) for a in (k, v))
    kf, vf = (np.asarray(q8_0_values(jnp.asarray(a))) for a in (kq, vq))
    q = rng.standard_normal((2, 3, 4, 64)).astype(np.float32)
    slots = np.array([2, 0], np.int32)
    pos = np.stack([np.arange(60, 63), np.arange(3, 6)]).astype(np.int32)
    want = attention_reference(jnp.asarray(q), jnp.asarray(kf[slots]), jnp.asarray(vf[slots]), jnp.asarray(pos),
                               window=window)
    got = cached_attention_blocked(jnp.asarray(q), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(slots), jnp.asarray(pos),
                                   fine_k=8, fine_span=16, block_k=32, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    rows = np.arange(2)[:, None]
    host_k, host_v = kq.copy(), vq.copy()
    host = host_attend(q, kf[slots][rows, pos], vf[slots][rows, pos], host_k, host_v, pos, slots, window)
    np.testing.assert_allclose(host, np.asarray(want), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(host_k, kq)  # the values written back as the same blocks
