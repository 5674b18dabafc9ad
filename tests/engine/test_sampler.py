"""The jitted sampler against plain numpy expectations on fresh random logits."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.engine.sampler import (SamplingBatch, SamplingParams, allocate_sampler_state, bias_arrays,
                                     prng_key_for, reset_slot, sample, top_candidates)

V = 300


def batch_of(params_list, steps=None, forced=None):
    b = len(params_list)
    f = lambda attr, dt: np.array([getattr(p, attr) for p in params_list], dt)  # noqa: E731
    keys = np.stack([prng_key_for(p.seed) for p in params_list])
    return SamplingBatch(np.arange(b, dtype=np.int32), f("temperature", np.float32), f("top_k", np.int32),
                         f("top_p", np.float32), f("min_p", np.float32), f("presence_penalty", np.float32),
                         f("frequency_penalty", np.float32), f("repetition_penalty", np.float32), keys,
                         np.zeros(b, np.int32) if steps is None else steps,
                         np.full(b, -1, np.int32) if forced is None else forced)


def run(logits, params_list, state=None, steps=None, forced=None, want_top=False, prompts=None):
    b = logits.shape[0]
    if state is None:
        state = allocate_sampler_state(b, V)
        for i, p in enumerate(params_list):
            ids, vals = bias_arrays(p, V)
            seen = np.zeros(V, np.bool_)
            seen[list(prompts[i]) if prompts else []] = True
            state = reset_slot(state, np.int32(i), ids, vals, seen)
    out, state = sample(logits, state, batch_of(params_list, steps, forced), want_top=want_top)
    return out, state


def test_greedy_rows_take_the_argmax_and_logprobs_are_log_softmax():
    rng = np.random.default_rng()
    logits = rng.normal(size=(3, V)).astype(np.float32) * 3
    out, _ = run(logits, [SamplingParams(temperature=0)] * 3, want_top=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(np.asarray(out.logprob), logits.max(-1) - lse, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], logits.argmax(-1))
    assert np.all(np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0)


def test_top_k_1_equals_greedy_and_top_k_restricts_the_support():
    rng = np.random.default_rng()
    logits = rng.normal(size=(1, V)).astype(np.float32)
    for seed in range(5):
        out, _ = run(logits, [SamplingParams(temperature=1.0, top_k=1, top_p=1.0, seed=seed)])
        assert int(out.tokens[0]) == logits.argmax()
    top5 = set(np.argsort(-logits[0])[:5].tolist())
    for seed in range(40):
        out, _ = run(logits, [SamplingParams(temperature=5.0, top_k=5, top_p=1.0, seed=seed)])
        assert int(out.tokens[0]) in top5


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.full((1, V), -20.0, np.float32)
    logits[0, [7, 8, 9]] = [np.log(0.6), np.log(0.3), np.log(0.1)]
    seen = set()
    for seed in range(60):
        out, _ = run(logits, [SamplingParams(temperature=1.0, top_k=0, top_p=0.8, seed=seed)])
        seen.add(int(out.tokens[0]))
    assert seen == {7, 8}  # 0.6 < 0.8, 0.6 + 0.3 >= 0.8: token 9 is cut


@pytest.mark.parametrize("top_k, top_p, temperature", [(5, 1.0, 0.7), (0, 0.9, 1.3), (200, 0.5, 1.0), (3, 0.2, 2.0)])
def test_post_sampling_probabilities_are_the_distribution_drawn_from(top_k, top_p, temperature):
    """llama-server's post_sampling_probs: temperature, then top-k, then top-p's smallest prefix
    reaching p, renormalised; in numpy on fresh logits (a batch mixing greedy and sampled rows)."""
    rng = np.random.default_rng()
    logits = (rng.normal(size=(2, V)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=int(rng.integers(1 << 30))),
              SamplingParams(temperature=0)]
    out, _ = run(logits, params, want_top=True)
    order = np.argsort(-logits[0], kind="stable")
    k = V if top_k <= 0 else min(top_k, V)
    z = logits[0, order[:k]].astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p
    post = np.where(keep, p, 0.0) / p[keep].sum()
    n = min(20, k)
    np.testing.assert_array_equal(np.asarray(out.post_ids)[0, :n], order[:n])
    np.testing.assert_allclose(np.asarray(out.post_probs)[0, :n], post[:n], rtol=2e-5, atol=1e-7)
    token = int(out.tokens[0])
    assert token in set(order[:k][keep].tolist())
    assert float(out.post_prob[0]) == pytest.approx(post[list(order[:k]).index(token)], rel=2e-5)
    # the greedy row: its argmax alone, with probability 1
    assert int(out.post_ids[1, 0]) == int(out.tokens[1]) == logits[1].argmax()
    np.testing.assert_array_equal(np.asarray(out.post_probs)[1], np.eye(1, 20)[0])
    assert float(out.post_prob[1]) == 1.0


def test_same_seed_same_tokens_and_steps_advance_the_stream():
    rng = np.random.default_rng()
    logits = rng.normal(size=(1, V)).astype(np.float32)
    p = SamplingParams(temperature=2.0, top_k=0, top_p=1.0, seed=42)
    a = [int(run(logits, [p], steps=np.array([s], np.int32))[0].tokens[0]) for s in range(12)]
    b = [int(run(logits, [p], steps=np.array([s], np.int32))[0].tokens[0]) for s in range(12)]
    assert a == b and len(set(a)) > 1


def test_logit_bias_and_penalties_change_the_choice():
    logits = np.zeros((1, V), np.float32)
    logits[0, 10] = 1.0
    out, _ = run(logits, [SamplingParams(temperature=0, logit_bias=((20, 5.0),))])
    assert int(out.tokens[0]) == 20
    # presence penalty: once 10 was generated, 11 (0.9) wins over 10 (1.0 - 2.0)
    logits[0, 11] = 0.9
    p = SamplingParams(temperature=0, presence_penalty=2.0)
    out, state = run(logits, [p])
    assert int(out.tokens[0]) == 10
    out, _ = run(logits, [p], state=state, steps=np.ones(1, np.int32))
    assert int(out.tokens[0]) == 11


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.3, 0.7), (0.0, 1.3)])
def test_min_p_drops_candidates_under_min_p_times_the_likeliest(min_p, temperature):
    """After temperature, top-k and top-p: p / p_max >= min_p, renormalised (numpy on fresh logits)."""
    rng = np.random.default_rng()
    logits = (rng.normal(size=(1, V)) * 2).astype(np.float32)
    p = SamplingParams(temperature=temperature, top_k=60, top_p=0.98, min_p=min_p, seed=int(rng.integers(1 << 30)))
    out, _ = run(logits, [p], want_top=True)
    order = np.argsort(-logits[0], kind="stable")[:60]
    z = logits[0, order].astype(np.float64) / temperature
    q = np.exp(z - z.max())
    q /= q.sum()
    keep = ((np.cumsum(q) - q) < 0.98) & (q >= min_p * q.max() * (1 - 1e-6))
    post = np.where(keep, q, 0.0) / q[keep].sum()
    np.testing.assert_array_equal(np.asarray(out.post_ids)[0], order[:20])
    np.testing.assert_allclose(np.asarray(out.post_probs)[0], post[:20], rtol=2e-5, atol=1e-7)
    for seed in range(30):
        token = int(run(logits, [replace(p, seed=seed)])[0].tokens[0])
        assert token in set(order[keep].tolist())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """Prompt tokens and generated ones (vLLM's and transformers' rule), then presence/frequency;
    the reported log-probability stays the model's."""
    rng = np.random.default_rng()
    logits = rng.normal(size=(1, V)).astype(np.float32)
    logits[0, np.argmax(logits[0])] = np.sort(logits[0])[-2] + 0.1  # a best that falls behind once divided
    prompt = sorted(set(rng.choice(V, 40, replace=False).tolist()) | {int(np.argmax(logits[0]))})  # the best is seen
    r = 1.7
    p = SamplingParams(temperature=0, repetition_penalty=r, presence_penalty=0.3)
    out, state = run(logits, [p], prompts=[prompt], want_top=True)
    expected = logits[0].astype(np.float64).copy()
    expected[prompt] = np.where(expected[prompt] > 0, expected[prompt] / r, expected[prompt] * r)
    assert int(out.tokens[0]) == int(np.argmax(expected)) != int(np.argmax(logits[0]))
    lse = np.log(np.exp(logits[0] - logits[0].max()).sum()) + logits[0].max()
    assert float(out.logprob[0]) == pytest.approx(float(logits[0, int(out.tokens[0])] - lse), abs=1e-5)
    # the generated token is now seen too, and pays the presence penalty after the repetition one
    first = int(out.tokens[0])
    out, _ = run(logits, [p], state=state, steps=np.ones(1, np.int32))
    x = expected.copy()
    if first not in prompt:
        x[first] = x[first] / r if x[first] > 0 else x[first] * r
    x[first] -= 0.3
    assert int(out.tokens[0]) == int(np.argmax(x))
    # off (1.0) or a slot whose request had no penalty: the prompt is not marked
    out, _ = run(logits, [SamplingParams(temperature=0)], prompts=[prompt])
    assert int(out.tokens[0]) == int(np.argmax(logits[0]))


def test_forced_token_replaces_the_choice_but_keeps_the_model_logprob():
    rng = np.random.default_rng()
    logits = rng.normal(size=(1, V)).astype(np.float32)
    out, _ = run(logits, [SamplingParams(temperature=0)], forced=np.array([123], np.int32), want_top=True)
    assert int(out.tokens[0]) == 123
    lse = np.log(np.exp(logits[0] - logits.max()).sum()) + logits.max()
    assert abs(float(out.logprob[0]) - (logits[0, 123] - lse)) < 1e-5


def test_first_argmax_is_jnp_argmax_on_ties_nans_and_masked_rows():
    import jax.numpy as jnp

    from pantheon.engine.sampler import first_argmax

    rng = np.random.default_rng()
    for trial in range(60):
        x = rng.standard_normal((4, 700)).astype(np.float32)
        x[0, rng.integers(0, 700, 6)] = x[0].max() + 1  # a tie at the top: the first index wins
        if trial % 3 == 0:
            x[1, rng.integers(0, 700, 2)] = np.nan  # the first NaN, as jnp.argmax answers
        x[2] = -np.inf  # every token masked: index 0
        x[3, :] = 0.0
        np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.asarray(jnp.argmax(x, axis=-1)))


@pytest.mark.parametrize("vocab,width", [(262144, 128), (151937, 128), (49152, 20), (1000, 128)])
def test_top_candidates_equal_a_full_top_k(vocab, width):
    """The two-pass top-k (group maxima first) gives lax.top_k's values and ids, ties to the lower
    id: on rows of distinct values, of heavy ties (a few distinct values), and with -inf entries."""
    rng = np.random.default_rng()
    rows = [rng.standard_normal(vocab).astype(np.float32),
            rng.integers(0, 6, vocab).astype(np.float32),  # most entries tie with many others
            np.where(rng.random(vocab) < 0.999, -np.inf, rng.standard_normal(vocab)).astype(np.float32)]
    x = jnp.asarray(np.stack(rows))
    want_vals, want_ids = jax.lax.top_k(x, width)
    vals, ids = jax.jit(top_candidates, static_argnums=1)(x, width)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def test_without_logprobs_no_log_softmax_is_taken():
    """Where no row asked for logprobs (want_top off) the log-softmax over the vocabulary is
    skipped: the logprob and top arrays are zeros, and the tokens are the same as with it."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=4)]
    off, _ = run(logits, params)
    on, _ = run(logits, params, want_top=True)
    assert np.array_equal(np.asarray(off.tokens), np.asarray(on.tokens))
    assert not np.asarray(off.logprob).any() and not np.asarray(off.top_logprobs).any()
    assert np.asarray(on.logprob).all()
