"""Gated delta rule: the Pallas kernels (interpret=True) against the jnp references.

Inputs are fresh random draws each run (the seed is in every failure message), shaped like the
model's: q, k L2-normalised (q also scaled by 1/sqrt(Dk)), g a log-decay <= 0, beta in (0, 1).
Tokens past a row's length are poisoned with NaN (q, k, v, g and beta alike): a kernel that reads
them into the state or the output leaks NaN, and interpret mode fills any output block a kernel
forgets to write with NaN. In the decode tests every cache slot no row names is NaN and must come
back bit-identical (still NaN, never read into a row's result).

Tolerance (float32): kernels vs reference <= 5e-5 abs on outputs and states (the state entries
are O(1..5), the outputs O(0.5); measured errors are ~1e-6)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.config import ENV_KERNELS
from pantheon.pallas import dispatch
from pantheon.pallas.deltanet import (gated_delta_rule, gated_delta_rule_reference, gated_delta_rule_step,
                                      gated_delta_rule_step_reference, kernel_supports)

F32_TOL = 5e-5
reference = jax.jit(gated_delta_rule_reference)
step_reference = jax.jit(gated_delta_rule_step_reference)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _tokens(rng, lead, h, dk, dv):
    """(q, k, v, g, beta) for token axes `lead` (e.g. (B, T) or (B,)), float32 numpy."""
    q = (_unit(rng.standard_normal((*lead, h, dk))) / np.sqrt(dk)).astype(np.float32)
    k = _unit(rng.standard_normal((*lead, h, dk))).astype(np.float32)
    v = rng.standard_normal((*lead, h, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 1.0, (*lead, h)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (*lead, h)).astype(np.float32)
    return q, k, v, g, beta


def _poison_padding(arrays, lengths):
    """NaN every token t >= lengths[b] of [B, T, ...] arrays."""
    out = []
    for a in arrays:
        a = a.copy()
        for b, n in enumerate(lengths):
            a[b, n:] = np.nan
        out.append(a)
    return out


def _err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _lengths(rng, b, t, kind):
    if kind == "full":
        return np.full(b, t, np.int32)
    lengths = rng.integers(1, t + 1, size=b).astype(np.int32)
    lengths[0] = t
    if b > 1:
        lengths[1] = int(rng.integers(1, max(2, t // 2)))  # a short row
    if b > 2 and kind == "ragged0":
        lengths[2] = 0  # an idle row: state untouched, zeros out
    return lengths


# (B, T, H, Dk, Dv, lengths, chunk, block_v): sequential and chunked forms, T not a multiple of the
# chunk, Dk != Dv both ways, Dv split over several grid tiles, every head dim once.
PREFILL_CASES = [
    (2, 37, 4, 32, 32, "ragged", 1, 16),
    (3, 23, 4, 64, 32, "ragged0", 1, 32),
    (1, 9, 4, 256, 32, "full", 1, 16),
    (3, 50, 4, 32, 64, "ragged0", 16, 32),
    (2, 70, 8, 64, 32, "ragged", 32, 16),
    (2, 64, 6, 128, 128, "ragged", 64, 64),
    (1, 20, 4, 32, 256, "full", 16, 128),
]


@pytest.mark.parametrize("b,t,h,dk,dv,kind,chunk,bv", PREFILL_CASES)
def test_prefill_kernel_matches_reference(rng, b, t, h, dk, dv, kind, chunk, bv):
    toks = _tokens(rng, (b, t), h, dk, dv)
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)
    lengths = _lengths(rng, b, t, kind)
    ref_out, ref_state = reference(*toks, state, lengths)
    out, new_state = gated_delta_rule(*(jnp.asarray(a) for a in _poison_padding(toks, lengths)), jnp.asarray(state),
                                      jnp.asarray(lengths), chunk=chunk, block_v=bv, interpret=True)
    out, new_state = np.asarray(out), np.asarray(new_state)
    msg = f"seed {rng.seed}: lengths {lengths}"
    assert out.shape == (b, t, h, dv) and out.dtype == np.float32 and new_state.shape == (b, h, dk, dv)
    assert np.isfinite(out).all() and np.isfinite(new_state).all(), f"{msg}: NaN/inf leaked"
    assert _err(out, ref_out) <= F32_TOL, f"{msg}: out max err {_err(out, ref_out)}"
    assert _err(new_state, ref_state) <= F32_TOL, f"{msg}: state max err {_err(new_state, ref_state)}"
    for bi, n in enumerate(lengths):
        assert not out[bi, n:].any(), f"{msg}: padded steps of row {bi} are not zero"
    idle = lengths == 0
    assert np.array_equal(new_state[idle], state[idle]), f"{msg}: an idle row's state changed"


@pytest.mark.parametrize("chunk", [1, 16])
def test_prefill_two_chunks_carry_the_state(rng, chunk):
    """A sequence fed as two calls (the second from the first's state; the last chunk ragged)
    gives the one-call reference."""
    b, t1, t2, h, dk, dv = 3, 19, 24, 4, 32, 64
    toks = _tokens(rng, (b, t1 + t2), h, dk, dv)
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)
    lengths2 = np.array([t2, 5, 0], np.int32)
    ref_out, ref_state = reference(*toks, state, t1 + lengths2)
    kernel = partial(gated_delta_rule, chunk=chunk, block_v=32, interpret=True)
    out1, mid = kernel(*(jnp.asarray(a[:, :t1]) for a in toks), jnp.asarray(state))  # lengths None: all
    second = _poison_padding([a[:, t1:] for a in toks], lengths2)
    out2, end = kernel(*(jnp.asarray(a) for a in second), mid, jnp.asarray(lengths2))
    out = np.concatenate([np.asarray(out1), np.asarray(out2)], axis=1)
    assert np.isfinite(out).all(), f"seed {rng.seed}: NaN leaked"
    assert _err(out, ref_out) <= F32_TOL, f"seed {rng.seed}: out max err {_err(out, ref_out)}"
    assert _err(end, ref_state) <= F32_TOL, f"seed {rng.seed}: state max err {_err(end, ref_state)}"


def test_prefill_chunked_repeated_keys_and_slow_decay(rng):
    """The hard case for the chunked form: one key repeated with beta near 1 and almost no decay
    (the triangular systems are far from diagonal); forward substitution keeps it exact."""
    b, t, h, dk, dv = 1, 64, 4, 64, 32
    q, k, v, g, beta = _tokens(rng, (b, t), h, dk, dv)
    k = np.broadcast_to(k[:, :1], k.shape).copy()
    g, beta = g * 0.01, 0.9 + 0.1 * beta
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)
    ref_out, ref_state = reference(q, k, v, g, beta, state)
    out, new_state = gated_delta_rule(*(jnp.asarray(a) for a in (q, k, v, g, beta, state)), chunk=64, block_v=32,
                                      interpret=True)
    assert _err(out, ref_out) <= F32_TOL and _err(new_state, ref_state) <= F32_TOL, \
        f"seed {rng.seed}: errs {_err(out, ref_out)}, {_err(new_state, ref_state)}"


def test_prefill_bf16_inputs(rng):
    """16-bit q/k/v/g/beta are widened inside the kernel: same result as the reference on the same values."""
    b, t, h, dk, dv = 2, 16, 4, 32, 32
    toks = [jnp.asarray(a).astype(jnp.bfloat16) for a in _tokens(rng, (b, t), h, dk, dv)]
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    ref_out, ref_state = reference(*(a.astype(jnp.float32) for a in toks), state)
    for chunk in (1, 16):
        out, new_state = gated_delta_rule(*toks, state, chunk=chunk, interpret=True)
        assert out.dtype == jnp.float32
        assert _err(out, ref_out) <= F32_TOL and _err(new_state, ref_state) <= F32_TOL, f"seed {rng.seed}"


# ---- decode step --------------------------------------------------------------------------------------
def _step_case(rng, b, h, dk, dv, n_slots, scratch_dups=0):
    """Decode inputs; slots distinct except `scratch_dups` extra rows on the last (scratch) slot.
    Returns (tokens, clean cache, cache with NaN in every slot no row names, slots)."""
    toks = _tokens(rng, (b,), h, dk, dv)
    cache = rng.standard_normal((n_slots, h, dk, dv)).astype(np.float32)
    slots = rng.permutation(n_slots - 1)[:b - scratch_dups].astype(np.int32)
    slots = np.concatenate([slots, np.full(scratch_dups, n_slots - 1, np.int32)])
    poisoned = cache.copy()
    poisoned[np.setdiff1d(np.arange(n_slots), slots)] = np.nan
    return toks, cache, poisoned, slots


# (B, H, Dk, Dv, N_slots, block_v)
STEP_CASES = [(4, 4, 32, 32, 7, 16), (3, 8, 64, 32, 5, 32), (2, 4, 128, 128, 3, 64), (1, 4, 32, 256, 2, 128)]


@pytest.mark.parametrize("b,h,dk,dv,n_slots,bv", STEP_CASES)
def test_step_kernel_matches_references(rng, b, h, dk, dv, n_slots, bv):
    toks, cache, poisoned, slots = _step_case(rng, b, h, dk, dv, n_slots)
    ref_out, ref_cache = step_reference(*toks, cache, slots)
    out, new_cache = gated_delta_rule_step(*(jnp.asarray(a) for a in (*toks, poisoned, slots)), block_v=bv,
                                           interpret=True)
    out, new_cache = np.asarray(out), np.asarray(new_cache)
    msg = f"seed {rng.seed}: slots {slots}"
    assert out.shape == (b, h, dv) and new_cache.shape == cache.shape
    assert np.isfinite(out).all(), f"{msg}: NaN leaked into the output"
    assert _err(out, ref_out) <= F32_TOL, f"{msg}: out max err {_err(out, ref_out)}"
    assert _err(new_cache[slots], np.asarray(ref_cache)[slots]) <= F32_TOL, f"{msg}: state max err"
    untouched = np.setdiff1d(np.arange(n_slots), slots)
    assert np.isnan(new_cache[untouched]).all(), f"{msg}: an untouched slot was written"
    # ... and against the prefill reference with T = 1 on the gathered states
    pre_out, pre_state = reference(*(a[:, None] for a in toks), cache[slots])
    assert _err(out, pre_out[:, 0]) <= F32_TOL and _err(new_cache[slots], pre_state) <= F32_TOL, msg


def test_step_reference_is_one_prefill_step(rng):
    toks, cache, _, slots = _step_case(rng, 3, 4, 32, 64, 6)
    out, new_cache = step_reference(*toks, cache, slots)
    pre_out, pre_state = reference(*(a[:, None] for a in toks), cache[slots])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pre_out[:, 0]))
    np.testing.assert_array_equal(np.asarray(new_cache)[slots], np.asarray(pre_state))
    others = np.setdiff1d(np.arange(6), slots)
    np.testing.assert_array_equal(np.asarray(new_cache)[others], cache[others])


def test_step_padding_rows_share_the_scratch_slot(rng):
    """Padding rows all on the scratch slot: the real rows and every other slot are unaffected."""
    b, h, dk, dv, n_slots = 5, 4, 32, 32, 6
    toks, cache, poisoned, slots = _step_case(rng, b, h, dk, dv, n_slots, scratch_dups=2)
    ref_out, ref_cache = step_reference(*toks, cache, slots)
    out, new_cache = gated_delta_rule_step(*(jnp.asarray(a) for a in (*toks, poisoned, slots)), interpret=True)
    real = slots != n_slots - 1
    assert _err(np.asarray(out)[real], np.asarray(ref_out)[real]) <= F32_TOL, f"seed {rng.seed}"
    assert _err(np.asarray(new_cache)[slots[real]], np.asarray(ref_cache)[slots[real]]) <= F32_TOL
    untouched = np.setdiff1d(np.arange(n_slots), slots)
    assert np.isnan(np.asarray(new_cache)[untouched]).all()


def test_decode_steps_reproduce_prefill(rng):
    """Three decode steps through the kernel, in place under a donating jit, equal one 3-token
    prefill of the same rows."""
    b, t, h, dk, dv, n_slots = 2, 3, 4, 32, 32, 4
    toks = _tokens(rng, (b, t), h, dk, dv)
    cache = rng.standard_normal((n_slots, h, dk, dv)).astype(np.float32)
    slots = np.array([2, 0], np.int32)
    want_out, want_state = reference(*toks, cache[slots])
    step = jax.jit(partial(gated_delta_rule_step, interpret=True), donate_argnums=5)
    c = jnp.asarray(cache)
    outs = []
    for i in range(t):
        o, c = step(*(jnp.asarray(a[:, i]) for a in toks), c, jnp.asarray(slots))
        outs.append(np.asarray(o))
    assert _err(np.stack(outs, axis=1), want_out) <= F32_TOL, f"seed {rng.seed}"
    assert _err(np.asarray(c)[slots], want_state) <= F32_TOL, f"seed {rng.seed}"
    np.testing.assert_array_equal(np.asarray(c)[[1, 3]], cache[[1, 3]])


# ---- dispatch -------------------------------------------------------------------------------------------
def test_dispatch_picks_reference_on_cpu_and_interpret_when_forced(rng, monkeypatch):
    b, t, h, dk, dv = 2, 8, 4, 32, 32
    toks = [jnp.asarray(a) for a in _tokens(rng, (b, t), h, dk, dv)]
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    lengths = jnp.array([8, 3], jnp.int32)
    stoks, cache, _, slots = _step_case(rng, 2, h, dk, dv, 4)
    stoks, cache, slots = [jnp.asarray(a) for a in stoks], jnp.asarray(cache), jnp.asarray(slots)

    monkeypatch.delenv(ENV_KERNELS, raising=False)
    if jax.default_backend() == "cpu":
        assert dispatch.kernel_mode("deltanet") == "reference"
    monkeypatch.setenv(ENV_KERNELS, "deltanet=reference")
    want = gated_delta_rule_reference(*toks, state, lengths)
    got = dispatch.deltanet(*toks, state, lengths)
    assert all(jnp.array_equal(x, y) for x, y in zip(got, want))
    want_step = gated_delta_rule_step_reference(*stoks, cache, slots)
    got_step = dispatch.deltanet_step(*stoks, cache, slots)
    assert all(jnp.array_equal(x, y) for x, y in zip(got_step, want_step))

    monkeypatch.setenv(ENV_KERNELS, "deltanet=interpret")
    got = dispatch.deltanet(*toks, state, lengths, chunk=16)
    assert max(_err(x, y) for x, y in zip(got, want)) <= F32_TOL, f"seed {rng.seed}"
    got_step = dispatch.deltanet_step(*stoks, cache, slots)
    assert max(_err(x, y) for x, y in zip(got_step, want_step)) <= F32_TOL, f"seed {rng.seed}"

    monkeypatch.setenv(ENV_KERNELS, "reference")  # a mode resolved by the caller wins over the env
    got = dispatch.deltanet(*toks, state, lengths, chunk=1, mode="interpret")
    assert max(_err(x, y) for x, y in zip(got, want)) <= F32_TOL, f"seed {rng.seed}"
    with pytest.raises(ValueError, match="unknown mode"):
        dispatch.deltanet_step(*stoks, cache, slots, mode="triton")

    monkeypatch.setenv(ENV_KERNELS, "pallas")
    with pytest.raises(ValueError, match="backend is 'cpu'"):
        dispatch.deltanet(*toks, state, lengths, backend="cpu")
    with pytest.raises(ValueError, match="backend is 'cpu'"):
        dispatch.deltanet_step(*stoks, cache, slots, backend="cpu")


# ---- input validation -----------------------------------------------------------------------------------
def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def _prefill(b=2, t=4, h=4, dk=32, dv=32):
    return [_z(b, t, h, dk), _z(b, t, h, dk), _z(b, t, h, dv), _z(b, t, h), _z(b, t, h), _z(b, h, dk, dv)]


def _with(args, i, new):
    args = list(args)
    args[i] = new
    return args


@pytest.mark.parametrize("args,kw,match", [
    (_prefill(dk=48), {}, "key dim 48"),
    (_prefill(dv=16), {}, "value dim 16"),
    (_with(_prefill(), 1, _z(2, 4, 4, 64)), {}, "differ"),
    (_with(_prefill(), 2, _z(2, 5, 4, 32)), {}, "does not match"),
    (_with(_prefill(), 3, _z(2, 4)), {}, "g must be"),
    (_with(_prefill(), 4, _z(2, 4, 3)), {}, "beta must be"),
    (_with(_prefill(), 5, _z(2, 4, 32, 64)), {}, "state must be"),
    (_with(_prefill(), 0, _z(4, 4, 32)), {}, r"\[B, T, H, Dk\]"),
    (_with(_prefill(), 2, _z(2, 4, 4, 32, dtype=jnp.int32)), {}, "floating"),
    (_prefill() + [_z(2)], {}, "lengths"),
    (_prefill() + [_z(3, dtype=jnp.int32)], {}, "lengths"),
    (_prefill(), {"chunk": 8}, "chunk=8"),
    (_prefill(), {"block_v": 8}, "block_v=8"),
    (_prefill(), {"block_v": 24}, "block_v=24"),
])
def test_prefill_validation(args, kw, match):
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(*args, interpret=True, **kw)


def _step(b=2, h=4, dk=32, dv=32, n=3):
    return [_z(b, h, dk), _z(b, h, dk), _z(b, h, dv), _z(b, h), _z(b, h), _z(n, h, dk, dv), _z(b, dtype=jnp.int32)]


@pytest.mark.parametrize("fn", [gated_delta_rule_step_reference, partial(gated_delta_rule_step, interpret=True)])
@pytest.mark.parametrize("args,match", [
    (_with(_step(), 1, _z(2, 4, 64)), "differ"),
    (_with(_step(), 2, _z(3, 4, 32)), "does not match"),
    (_with(_step(), 3, _z(2, 4, 1)), "g must be"),
    (_with(_step(), 5, _z(3, 4, 32, 64)), "state_cache must be"),
    (_with(_step(), 5, _z(4, 32, 32)), "state_cache must be"),
    (_with(_step(), 6, _z(2)), "slots"),
    (_with(_step(), 6, _z(3, dtype=jnp.int32)), "slots"),
    (_with(_step(), 0, _z(2, 1, 4, 32)), r"\[B, H, Dk\]"),
])
def test_step_validation(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_kernel_supports():
    assert kernel_supports(128, 128, (9, 32, 128, 128)) and kernel_supports(32, 32)
    assert not kernel_supports(48, 32) and not kernel_supports(128, 16)
    assert not kernel_supports(128, 128, (2 ** 18 + 1, 32, 128, 128))


def test_step_kernel_limits():
    with pytest.raises(ValueError, match="key dim 80"):
        gated_delta_rule_step(*_step(dk=80), interpret=True)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_step(*_with(_step(), 5, _z(3, 4, 32, 32, dtype=jnp.bfloat16)), interpret=True)
    with pytest.raises(ValueError, match="block_v=8"):
        gated_delta_rule_step(*_step(), block_v=8, interpret=True)
