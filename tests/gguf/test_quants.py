"""pantheon.gguf.quants: jnp dequantizers vs gguf-py (and ggml), numpy quantizer round trips.

Random blocks are drawn fresh each run. The block layouts below (where the fp16 fields sit) are
written out here independently of the module, so a wrong offset there cannot hide itself.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from pantheon.gguf.quants import (QUANTIZE_TYPES, SCALE_FIELDS, SUPPORTED_TYPES, dequantize, dequantize_np,
                                  integer_parts, quantize_np)

# Byte offsets of each block's fp16 fields (d, and m/dmin where present).
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
BLOCK_TYPES = list(F16_FIELDS)

# Round-trip bound as a fraction of the tensor's span (max - min), for zero-mean data (so every
# sub-block's |x| <= span). Derivation: half a code step, with the step widened by the scale
# quantization (scales are rounded up to a multiple of the super-scale), plus a little slack.
#   Q8_0: amax/127/2;  Q4_0/Q5_0 (gguf-py maps the signed extreme to -8/-16, so the opposite
#   extreme clips by one step): amax/8, amax/16;  Q4_1/Q5_1: span/15/2, span/31/2;
#   Q2_K: (span/3)(1+1/15)/2 + d/2;  Q3_K: (amax/3)(1+1/31)/2;  Q4_K/Q5_K: (span/15|31)(1+1/63)^2/2;
#   Q6_K: (amax/31)(1+1/127)/2;  IQ4_NL: the table's widest gap (24 of 127) halved, or the far end
#   clipped (113 of 127): amax * 14/127;  IQ4_XS: that, plus the 6-bit sub-scale's rounding (amax/62).
ROUND_TRIP_TOL = {T.Q8_0: 0.005, T.Q4_0: 0.13, T.Q5_0: 0.065, T.Q4_1: 0.036, T.Q5_1: 0.018,
                  T.Q2_K: 0.20, T.Q3_K: 0.18, T.Q4_K: 0.036, T.Q5_K: 0.018, T.Q6_K: 0.017, T.IQ4_NL: 0.12,
                  T.IQ4_XS: 0.14}


def random_finite_f16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform random fp16 bit patterns, any sign/exponent/subnormal, but never inf or NaN."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    all_ones_exp = (bits & 0x7C00) == 0x7C00
    return np.where(all_ones_exp, bits ^ 0x4000, bits).astype(np.uint16)  # clear one exponent bit


def random_blocks(rng: np.random.Generator, qtype: T, lead: tuple[int, ...], n_blocks: int) -> np.ndarray:
    """Random raw rows (*lead, n_blocks * type_size) with finite fp16 scale fields."""
    tsize = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(*lead, n_blocks, tsize), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[..., off:off + 2] = random_finite_f16_bits(rng, (*lead, n_blocks, 1)).view(np.uint8)
    return raw.reshape(*lead, n_blocks * tsize)


def assert_equal_to_float_rounding(got: np.ndarray, ref: np.ndarray, block: int) -> None:
    """Equal up to float rounding: |got - ref| <= 1e-6 * (|ref| + max |ref| of its block).

    The per-block term allows a backend that fuses d*q + m into an FMA (one rounding fewer); on
    CPU the results are in fact bit-identical (see test_dequantize_is_bit_exact_on_cpu)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    g, r = got.reshape(-1, block), ref.reshape(-1, block)
    bound = 1e-6 * (np.abs(r) + np.abs(r).max(axis=1, keepdims=True))
    bad = np.abs(g - r) > bound
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. got {g[bad][:4]} want {r[bad][:4]}"


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_on_random_blocks(qtype, rng):
    raw = random_blocks(rng, qtype, (2, 3), n_blocks=4)  # 3-D: leading dims must pass through
    got = dequantize_np(raw, qtype)
    block = GGML_QUANT_SIZES[qtype][0]
    assert got.shape == (2, 3, 4 * block)
    assert_equal_to_float_rounding(got, gguf_dequantize(raw, qtype), block)


def test_dequantize_is_bit_exact_on_cpu(rng):
    if jax.default_backend() != "cpu":
        pytest.skip("bit-exactness is only promised where XLA does not contract to FMA")
    for qtype in BLOCK_TYPES:
        raw = random_blocks(rng, qtype, (2,), n_blocks=2)
        got, ref = dequantize_np(raw, qtype), gguf_dequantize(raw, qtype)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), qtype.name


def test_dequantize_matches_ggml_to_float_on_llama_cpp_quantized_samples(reference_dir):
    """ref/quant_samples.npz: blocks quantized by ggml itself and its own to_float output."""
    samples = np.load(reference_dir / "qwen35moe" / "ref" / "quant_samples.npz")
    names = [k[:-4] for k in samples if k.endswith("_raw")]
    assert names
    for name in names:
        got = dequantize_np(samples[f"{name}_raw"], T[name])
        want = samples[f"{name}_f32"].reshape(got.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_plain_float_types_match_gguf_py_from_typed_arrays_and_raw_bytes(rng):
    f32 = rng.normal(size=(3, 8)).astype(np.float32)
    f16 = random_finite_f16_bits(rng, (3, 8)).view(np.float16)
    bf16 = rng.integers(0, 1 << 16, size=(3, 8), dtype=np.uint16)
    bf16 = np.where((bf16 & 0x7F80) == 0x7F80, bf16 ^ 0x4000, bf16).astype(np.uint16)  # finite
    # The reader hands out F32/F16 as typed arrays and BF16 as uint16 bit patterns.
    for qtype, typed in ((T.F32, f32), (T.F16, f16), (T.BF16, bf16)):
        want = gguf_dequantize(typed.view(np.uint8), qtype)  # gguf-py's BF16 path wants bytes
        got_typed = dequantize_np(typed, qtype)
        got_bytes = dequantize_np(typed.view(np.uint8), qtype)
        for got in (got_typed, got_bytes):
            assert got.dtype == np.float32 and got.shape == (3, 8)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qtype.name


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q3_K, T.Q4_K], ids=lambda t: t.name)
def test_dequantize_under_jax_jit_on_multirow_2d_input(qtype, rng):
    raw = random_blocks(rng, qtype, (5,), n_blocks=2)
    fn = jax.jit(dequantize, static_argnums=1)
    got = fn(raw, qtype)
    assert isinstance(got, jax.Array) and got.shape == (5, 2 * GGML_QUANT_SIZES[qtype][0])
    assert_equal_to_float_rounding(np.asarray(got), gguf_dequantize(raw, qtype), GGML_QUANT_SIZES[qtype][0])
    # The same function also runs eagerly (outside jit) with the same result.
    np.testing.assert_array_equal(np.asarray(dequantize(raw, qtype)), np.asarray(got))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_quantize_np_round_trip_within_tolerance_and_jnp_decodes_it_like_gguf_py(qtype, rng):
    block, tsize = GGML_QUANT_SIZES[qtype]
    n = 2 * max(block, 256)
    # Zero-mean rows with different magnitudes, plus a positive offset on one row so that
    # sub-blocks with no negative values (the "min" formats' m = 0 path) occur.
    x = rng.normal(size=(3, n)).astype(np.float32) * np.float32([[1.0], [0.01], [30.0]])
    x[1, : n // 4] = np.abs(x[1, : n // 4])
    blocks = quantize_np(x, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (3, n // block * tsize)
    ref = gguf_dequantize(blocks, qtype)
    for row, back in zip(x, ref):
        span = row.max() - row.min()
        err = np.abs(back - row).max() / span
        assert err <= ROUND_TRIP_TOL[qtype], f"{qtype.name}: max error {err:.4f} of span"
    assert_equal_to_float_rounding(dequantize_np(blocks, qtype), ref, block)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_quantize_np_of_zeros_decodes_to_exact_zeros_without_nan(qtype):
    n = max(GGML_QUANT_SIZES[qtype][0], 256)
    np.testing.assert_array_equal(dequantize_np(quantize_np(np.zeros((2, n)), qtype), qtype), 0.0)


def test_supported_and_quantizable_type_sets():
    assert SUPPORTED_TYPES == frozenset(BLOCK_TYPES) | {T.F32, T.F16, T.BF16}
    assert QUANTIZE_TYPES == frozenset(BLOCK_TYPES)


def test_unknown_or_unsupported_type_raises_value_error_naming_it():
    raw = np.zeros((2, 66), np.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize_np(raw, T.IQ2_XXS)
    with pytest.raises(ValueError, match="12345"):
        dequantize(raw, 12345)
    with pytest.raises(ValueError, match="F32"):
        quantize_np(np.zeros((2, 256), np.float32), T.F32)


def test_malformed_input_raises_value_error():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(np.zeros((2, 145), np.uint8), T.Q4_K)  # not a whole number of 144-byte blocks
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros((2, 34), np.float32), T.Q8_0)  # block data must be raw bytes
    with pytest.raises(ValueError, match="Q6_K"):
        quantize_np(np.zeros((2, 128), np.float32), T.Q6_K)  # row shorter than a super-block
    with pytest.raises(ValueError, match="non-finite"):
        quantize_np(np.full((1, 32), np.nan, np.float32), T.Q8_0)


def _rebuild(raw, qtype):
    """d * c + dmin * mn from integer_parts, per weight; and c."""
    c, d, mn, dmin = (None if a is None else np.asarray(a) for a in integer_parts(raw, qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    w = np.repeat(d, block, -1) * c
    if mn is not None:
        w = w + np.repeat(dmin, block, -1) * np.repeat(mn, c.shape[-1] // mn.shape[-1], -1)
    return w, c, mn


@pytest.mark.parametrize("qtype", sorted(SCALE_FIELDS, key=int), ids=lambda t: t.name)
def test_integer_parts_hold_integers_and_rebuild_the_weights(qtype, rng):
    """The split llama.cpp's integer dot products use: w = d * c + dmin * mn per block, c and mn
    integers (so their sums against integer activations are exact in f32 below 2**24)."""
    raw = quantize_np((rng.standard_normal((3, 512)) * rng.uniform(0.01, 3)).astype(np.float32), qtype)
    w, c, mn = _rebuild(raw, qtype)
    assert np.array_equal(c, np.round(c)) and np.abs(c).max() < 2 ** 13
    if mn is not None:
        assert np.array_equal(mn, np.round(mn))
    want = dequantize_np(raw, qtype)
    np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_integer_parts_of_ggml_quantized_samples(reference_dir):
    """Blocks quantized by ggml itself (ref/quant_samples.npz) rebuild its own to_float output."""
    samples = np.load(reference_dir / "qwen35moe" / "ref" / "quant_samples.npz")
    names = [k[:-4] for k in samples if k.endswith("_raw") and T[k[:-4]] in SCALE_FIELDS]
    assert {"Q3_K", "Q4_K", "Q6_K", "Q8_0"} <= set(names)
    for name in names:
        w, _, _ = _rebuild(samples[f"{name}_raw"], T[name])
        want = samples[f"{name}_f32"].reshape(w.shape)
        np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=name)


def test_integer_parts_refuses_types_without_an_integer_dot():
    with pytest.raises(ValueError, match="F32 has no integer dot product"):
        integer_parts(np.zeros((1, 16), np.uint8), T.F32)
