"""gated_delta_rule_reference against a float64 numpy loop written straight from the recurrence
(SPEC §4 item 8), on fresh random inputs with ragged lengths."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pantheon.pallas.deltanet import gated_delta_rule_reference as _reference

gated_delta_rule_reference = jax.jit(_reference)  # one compile per shape instead of op-by-op dispatch

B, T, H, DK, DV = 3, 9, 4, 8, 6  # Dk != Dv catches a transposed state


def numpy_delta_rule(q, k, v, g, beta, state, lengths):
    """float64, one token and one head at a time; padded steps skipped (output 0)."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for b in range(q.shape[0]):
        for t in range(lengths[b]):
            for h in range(q.shape[2]):
                s[b, h] *= np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - k[b, t, h] @ s[b, h])  # [Dv]
                s[b, h] += np.outer(k[b, t, h], delta)
                out[b, t, h] = q[b, t, h] @ s[b, h]  # the updated state
    return out, s


def random_inputs(seed):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = (unit(rng.standard_normal((B, T, H, DK))) / np.sqrt(DK)).astype(np.float32)
    k = unit(rng.standard_normal((B, T, H, DK))).astype(np.float32)
    v = rng.standard_normal((B, T, H, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (B, T, H)).astype(np.float32)  # log-decay <= 0
    beta = rng.uniform(0.0, 1.0, (B, T, H)).astype(np.float32)
    state = rng.standard_normal((B, H, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("lengths", [(T, T, T), (T, 4, 0), (1, T - 1, 5)])
def test_matches_float64_loop_with_ragged_lengths(lengths):
    q, k, v, g, beta, state = random_inputs(seed=sum(lengths))
    lengths = np.array(lengths, np.int32)
    out, new_state = gated_delta_rule_reference(q, k, v, g, beta, state, lengths)
    ref_out, ref_state = numpy_delta_rule(q, k, v, g, beta, state, lengths)
    assert out.shape == (B, T, H, DV) and new_state.shape == (B, H, DK, DV)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(new_state), ref_state, atol=1e-5, rtol=0)
    for b, n in enumerate(lengths):
        assert not np.asarray(out)[b, n:].any()  # padded steps output zeros
    assert np.array_equal(np.asarray(new_state)[lengths == 0], state[lengths == 0])  # and touch nothing


def test_no_lengths_means_every_step_and_chunks_compose():
    q, k, v, g, beta, state = random_inputs(seed=7)
    full_out, full_state = gated_delta_rule_reference(q, k, v, g, beta, state)
    same_out, same_state = gated_delta_rule_reference(q, k, v, g, beta, state, np.full(B, T, np.int32))
    np.testing.assert_array_equal(np.asarray(full_out), np.asarray(same_out))
    np.testing.assert_array_equal(np.asarray(full_state), np.asarray(same_state))
    # Two chunks (the second starting from the first one's state) give the one-shot result.
    cut = 4
    first = [a[:, :cut] for a in (q, k, v, g, beta)]
    second = [a[:, cut:] for a in (q, k, v, g, beta)]
    out_a, mid = gated_delta_rule_reference(*first, state)
    out_b, end = gated_delta_rule_reference(*second, mid)
    np.testing.assert_allclose(np.concatenate([out_a, out_b], axis=1), np.asarray(full_out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(end), np.asarray(full_state), atol=1e-6)
