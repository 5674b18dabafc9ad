"""The native CPU kernels (pantheon/native) against their jnp references, on fresh random inputs."""

from __future__ import annotations

from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from gguf.constants import GGMLQuantizationType as Q

from pantheon.config import ENV_NATIVE
from pantheon.gguf.arithmetic import q8_0_blocks, q8_0_values
from pantheon.gguf.quants import dequantize_np, quantize_np
from pantheon.native import build
from pantheon.native.attention import attention_decode
from pantheon.native.qmatmul import U4_1, QMatrix, dequantize_blocks, embed_rows, qmatmul, qmatmul_reference, unpack_nibbles
from pantheon.native.qmatmul import TILED, dequantize_native, expert_qmatmul, expert_qmatmul_reference, tile_k, untile_blocks
from pantheon.pallas import dispatch
from pantheon.pallas.attention import attention_reference, cached_attention_blocked

QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL)  # GGUF types, as the models load them (the file's blocks)


@pytest.fixture(scope="module", autouse=True)
def native():
    # CI and the serve machines are x86 with AVX2 and g++: the kernels must build there.
    assert build.available(), build.unavailable_reason()


HALF = (Q.F16, Q.BF16)  # rows of 16-bit floats, read by the kernel as blocks of 32 with no scale


def random_matrix(rng, n_out: int, n_in: int, qtype) -> tuple[QMatrix, np.ndarray]:
    """A random matrix quantized to `qtype` as the models load it, and its dequantized GGUF values."""
    values = (rng.standard_normal((n_out, n_in)) * rng.uniform(0.01, 2.0)).astype(np.float32)
    if qtype in HALF:
        blocks = values.astype(np.float16 if qtype == Q.F16 else jnp.bfloat16).view(np.uint8).reshape(n_out, -1)
    else:
        blocks = quantize_np(values, qtype).reshape(n_out, -1)
    dense = dequantize_np(blocks, qtype).reshape(n_out, n_in)
    return QMatrix(jnp.asarray(blocks), int(qtype), n_in), dense


K_QTYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)  # read as the file holds them (kquants.h)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES + HALF, ids=lambda t: t.name)
def test_qmatmul_matches_the_reference(qtype):
    """f32 activations against blocks dequantized in the kernel: the GGUF values (ggml's
    dequantize_row_*, transcribed in gguf/quants.py), multiplied in f32. K-quant super-blocks are
    read as the file holds them, not repacked."""
    rng = np.random.default_rng()
    shapes = (((64, 256, 1), (300, 768, 3), (193, 1536, 9), (1100, 512, 5)) if qtype in K_QTYPES else
              ((64, 32, 1), (576, 576, 3), (193, 1536, 9), (4100, 96, 5)))
    for n_out, n_in, m in shapes:
        w, dense = random_matrix(rng, n_out, n_in, qtype)
        if qtype in K_QTYPES:
            assert w.qtype == int(qtype) and w.blocks.nbytes == quantize_np(dense, qtype).nbytes
        x = jnp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
        got = np.asarray(jax.jit(qmatmul)(x, w))
        ref = np.asarray(jax.jit(qmatmul_reference)(x, w))
        exact = np.asarray(x, np.float64) @ dense.T.astype(np.float64)
        scale = np.abs(exact).max()
        assert np.abs(got - exact).max() <= 2e-6 * scale * np.sqrt(n_in / 32), (n_out, n_in, m)
        assert np.abs(ref - exact).max() <= 2e-6 * scale * np.sqrt(n_in / 32)


@pytest.mark.parametrize("qtype", K_QTYPES, ids=lambda t: t.name)
def test_k_quant_rows_do_not_depend_on_their_batch(qtype):
    rng = np.random.default_rng()
    w, _ = random_matrix(rng, 300, 512, qtype)
    x = jnp.asarray(rng.standard_normal((11, 512)).astype(np.float32))
    for int8 in (False, True):
        f = jax.jit(lambda x, w: qmatmul(x, w, int8_activations=int8))
        full = np.asarray(f(x, w))
        for m in (1, 2, 3, 4, 5, 8):
            np.testing.assert_array_equal(np.asarray(f(x[:m], w)), full[:m])


@pytest.mark.parametrize("qtype", (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K), ids=lambda t: t.name)
def test_k_quant_products_hold_f32_accuracy_at_every_magnitude(qtype):
    """Where the CPU has AVX-512 VNNI, Q2_K-Q6_K products take x as 23-bit fixed point per 32
    (kquants.h: fixed_rows): rows from 1e-30 to 1e30 and sparse rows stay within f32's error of
    the float64 product relative to sum |x w|; a 32 with an outlier 3e4 times its neighbours
    rounds them to its grid, so that row is held to sum over 32s of max |x| * sum |w| (where the
    f32 kernel lands too, measured: 1.2e-7 of it against 6.7e-8); a row of zeros is zero; a NaN or
    an infinity makes its row non-finite and leaves the others as they are alone."""
    rng = np.random.default_rng()
    w, dense = random_matrix(rng, 96, 1024, qtype)
    x = rng.standard_normal((8, 1024))
    x *= np.array([1e-30, 1e-3, 1.0, 1e4, 1e30, 1.0, 1.0, 0.0])[:, None]
    x[5, 37] = 3e4  # an outlier among values ~1
    x[6, ::3] = 0.0
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(qmatmul)(jnp.asarray(x), w), np.float64)
    x64, d64 = x.astype(np.float64), dense.astype(np.float64)
    exact = x64 @ d64.T
    bound = np.abs(x64) @ np.abs(d64).T  # sum |x w| per output
    grid = np.abs(x64).reshape(8, -1, 32).max(2) @ np.abs(d64).reshape(96, -1, 32).sum(2).T
    err = np.abs(got - exact)
    rows = [0, 1, 2, 3, 4, 6]
    assert np.all(err[rows] <= 2e-6 * bound[rows] + 1e-45), np.max(err[rows] / (bound[rows] + 1e-45))
    assert np.all(err[5] <= 1e-6 * grid[5]), np.max(err[5] / grid[5])
    assert np.all(got[7] == 0.0)
    bad = x.copy()
    bad[2, 100], bad[4, 900] = np.nan, np.inf
    out = np.asarray(jax.jit(qmatmul)(jnp.asarray(bad), w))
    assert not np.isfinite(out[2]).any() and not np.isfinite(out[4]).any()
    keep = [0, 1, 3, 5, 6, 7]
    np.testing.assert_array_equal(out[keep], np.asarray(jax.jit(qmatmul)(jnp.asarray(x[keep]), w)))


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K), ids=lambda t: t.name)
def test_trailing_rows_of_zeros_are_zero_and_the_rest_unchanged(qtype):
    """A prefill chunk's padding rows reach the kernel as rows of zeros (llama.block), which it
    writes as zeros without computing them (common.h: live_rows): the other rows are what they are
    alone, a zero row before a live one is still computed, and a trailing row holding a NaN is not
    taken for padding."""
    rng = np.random.default_rng()
    w, _ = random_matrix(rng, 40, 512, qtype)
    x = rng.standard_normal((12, 512)).astype(np.float32)
    x[3] = 0.0
    x[7:] = 0.0
    x[8, 5] = -0.0
    for int8 in (False, True):
        f = jax.jit(lambda x, w: qmatmul(x, w, int8_activations=int8))
        got = np.asarray(f(jnp.asarray(x), w))
        alone = np.concatenate([np.asarray(f(jnp.asarray(x[m:m + 1]), w)) for m in range(7)])
        np.testing.assert_array_equal(got[:7], alone)
        assert np.all(got[7:] == 0.0) and not np.any(np.signbit(got[7:]))
    nan = x.copy()
    nan[11, 100] = np.nan  # f32 activations carry it into the row's products (8-bit ones round it away)
    assert np.all(np.isnan(np.asarray(jax.jit(qmatmul)(jnp.asarray(nan), w))[11]))


@pytest.mark.parametrize("qtype", (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1), ids=lambda t: t.name)
def test_k_quant_gemm_rows_equal_their_single_row_products(qtype):
    """From kquants.h's gemm_rows (12 rows for Q4_K/Q5_K, 24 for Q2_K/Q3_K/Q6_K, 8 K-tiled) the
    fixed-point kernel multiplies as a GEMM over columns decoded once (fixed_gemm32, fixed_gemm16;
    2-row x 4-column tiles): every row of a 27-row product equals that row's product alone bit for
    bit (an odd last row, 70 columns that do not fill the tiles), row major and K-tiled, and holds
    f32's error of the float64 product. Q4_0/Q4_1 rows of a multiple
    of 256 weights go the same way, eight blocks as one super-block (kquants.h: fixed_group), and
    other lengths (576) through the f32 kernel; long ones (4096) held row major go in K tiles from
    the rows whose planes outgrow L1 (3 here) and take the GEMM from 8, so batches of 2, 3, 4, 5, 7,
    8 and 13 rows are checked against the 27 too. Elsewhere the same holds for the row tiles every
    CPU runs."""
    rng = np.random.default_rng()
    shapes = (((512, False), (4096, True)) if qtype in K_QTYPES else
              ((512, False), (576, False), (2048, False), (4096, False)))
    for n_in, tiled in shapes:
        if tiled and not build.fixed_point():
            continue  # only the AVX-512 VNNI kernel reads K tiles
        w, dense = random_matrix(rng, 70, n_in, qtype)
        w = tile_k(w) if tiled else w
        x = rng.standard_normal((27, n_in)).astype(np.float32)
        f = jax.jit(qmatmul)
        full = np.asarray(f(jnp.asarray(x), w))
        for m in range(27):
            np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[m:m + 1]), w))[0], full[m])
        for m in (2, 3, 4, 5, 7, 8, 13):  # each mode and threshold: the row tiles, K tiles, the GEMM
            np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), w)), full[:m])
        exact = x.astype(np.float64) @ dense.T.astype(np.float64)
        assert np.abs(full - exact).max() <= 2e-6 * np.abs(exact).max() * np.sqrt(n_in / 32)


@pytest.mark.parametrize("qtype", (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K), ids=lambda t: t.name)
def test_k_tiled_blocks_give_the_row_major_product_bit_for_bit(qtype):
    """Long rows load K-tile-major for the fixed-point kernel (qmatmul.tile_k): the same bytes
    re-ordered, read in the same order of sums, so the product, the dequantized matrix and the jnp
    reference are the row-major ones exactly — with a last tile shorter than the others (2304 =
    9 super-blocks), at any batch. 8-bit activations refuse them (llamacpp numerics load untiled)."""
    rng = np.random.default_rng()
    for n_out, n_in in ((96, 4096), (40, 2304)):
        w, dense = random_matrix(rng, n_out, n_in, qtype)
        t = tile_k(w)
        assert t.qtype == int(qtype) + TILED and t.blocks.shape == w.blocks.shape
        assert not np.array_equal(np.asarray(t.blocks), np.asarray(w.blocks))
        np.testing.assert_array_equal(untile_blocks(np.asarray(t.blocks), t.qtype), np.asarray(w.blocks))
        np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_native)(t)), dense)
        x = jnp.asarray(rng.standard_normal((6, n_in)).astype(np.float32))
        ref = np.asarray(jax.jit(qmatmul_reference)(x, w))
        np.testing.assert_array_equal(np.asarray(jax.jit(qmatmul_reference)(x, t)), ref)
        if not build.fixed_point():
            continue  # only the AVX-512 VNNI kernel reads them (and only there are they loaded)
        full = np.asarray(jax.jit(qmatmul)(x, t))
        np.testing.assert_array_equal(full, np.asarray(jax.jit(qmatmul)(x, w)))
        for m in (1, 4, 5):
            np.testing.assert_array_equal(np.asarray(jax.jit(qmatmul)(x[:m], t)), full[:m])
        with pytest.raises(ValueError, match="K-tiled blocks take f32 activations"):
            qmatmul(x, t, int8_activations=True)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES + HALF, ids=lambda t: t.name)
def test_native_dequantize_is_the_reference_bit_for_bit(qtype):
    """Long prefill chunks multiply f32 weights dequantized in the kernel (layers.linear): they must
    be the file's values exactly, as gguf/quants.py's jnp transcription of ggml gives them."""
    rng = np.random.default_rng()
    w, dense = random_matrix(rng, 37, 512, qtype)
    got = np.asarray(jax.jit(dequantize_native)(w))
    np.testing.assert_array_equal(got, np.asarray(dequantize_blocks(w.blocks, w.qtype)).reshape(37, 512))
    np.testing.assert_array_equal(got, dense)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES, ids=lambda t: t.name)
def test_qmatmul_with_8bit_activations_matches_the_reference(qtype):
    """llamacpp numerics: x rounded to Q8_0/Q8_1 blocks (Q8_K per 256 against K-quants) in the
    kernel, integer dot products. The reference is arithmetic.int_linear over the blocks' integer
    parts: the same integer sums, so only the f32 order of the scaled block sums may differ; the
    rounding itself moves the product far more (checked, so the kernel cannot be quietly computing
    the f32 product instead)."""
    rng = np.random.default_rng()
    shapes = (((64, 256, 1), (300, 768, 3), (193, 1536, 9), (1100, 512, 5)) if qtype in K_QTYPES else
              ((64, 32, 1), (576, 576, 3), (193, 1536, 9), (4100, 96, 5)))
    for n_out, n_in, m in shapes:
        w, dense = random_matrix(rng, n_out, n_in, qtype)
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        x[0, :32 if qtype not in K_QTYPES else 256] = 0.0  # an all-zero block: scale 0, no division by it
        x = jnp.asarray(x)
        got = np.asarray(jax.jit(lambda x, w: qmatmul(x, w, int8_activations=True))(x, w))
        ref = np.asarray(jax.jit(lambda x, w: qmatmul_reference(x, w, int8_activations=True))(x, w))
        exact = np.asarray(x, np.float64) @ dense.T.astype(np.float64)
        scale = np.abs(exact).max()
        assert np.abs(got - ref).max() <= 2e-6 * scale * np.sqrt(n_in / 32), (n_out, n_in, m)
        assert np.abs(got - exact).max() >= 1e-4 * scale  # the activations really were rounded


@pytest.mark.parametrize("qtype,int8_activations", [(t, i) for t in QTYPES for i in (False, True)] +
                         [(t, False) for t in HALF], ids=lambda v: getattr(v, "name", {False: "f32", True: "int8"}.get(v)))
def test_qmatmul_row_does_not_depend_on_its_batch(qtype, int8_activations):
    """Rows go through 8-, 4-, 2-row tiles or alone (qmatmul.cc); a row's result must be bit-identical."""
    rng = np.random.default_rng()
    w, _ = random_matrix(rng, 300, 640, qtype)
    x = jnp.asarray(rng.standard_normal((11, 640)).astype(np.float32))

    def f(x, w):
        return qmatmul(x, w, int8_activations=int8_activations)

    full = np.asarray(jax.jit(f)(x, w))
    for m in (1, 2, 4, 5, 8):
        part = np.asarray(jax.jit(f)(x[:m], w))
        np.testing.assert_array_equal(part, full[:m])
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x[7:8], w))[0], full[7])


def test_8bit_activation_rounding_is_ggml_x86s():
    """arithmetic.quantize_q8_0 against a transcription of ggml-cpu's AVX2 quantize_row_q8_1 on
    values built to hit its edges: exact halves (nearest even, not C's roundf), the block maximum
    (exactly +-127) and an all-zero block."""
    from pantheon.gguf.arithmetic import quantize_q8_0

    rng = np.random.default_rng()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, :32] = [127.0] + [k + 0.5 for k in range(-15, 16)]  # scale 127/127 = 1: every other value a half
    x[2, 32:] = 0.0
    q, d, s = (np.asarray(a) for a in quantize_q8_0(jnp.asarray(x)))
    xb = x.reshape(3, 2, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    dd = amax / np.float32(127)
    iv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    want = np.rint((xb * iv).astype(np.float32))  # rint: round half to even, like _mm256_round_ps
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(d, dd.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(s, (dd * want.sum(-1, keepdims=True)).astype(np.float16).astype(np.float32))
    assert np.abs(q).max() == 127 and np.all(q[2, 1] == 0)
    roundf = np.sign(xb) * np.floor(np.abs(xb * iv) + 0.5)
    assert np.sum(roundf != want) >= 15  # the halves, which C's roundf would round away from zero


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_qmatmul_keeps_leading_axes_and_embeds_rows(qtype):
    rng = np.random.default_rng()
    w, dense = random_matrix(rng, 70, 64, qtype)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
    assert qmatmul(x, w).shape == (2, 3, 70)
    ids = jnp.asarray([[5, 69], [0, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(embed_rows(w, ids)), dense[np.asarray(ids)])


@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1), ids=lambda t: t.name)
def test_packed_blocks_read_bit_for_bit_as_their_unpacked_form(qtype):
    """Q4_0/Q4_1/Q5_0/Q5_1 stay at the file's bytes: the kernel splits the codes (nibbles and fifth
    bits) in registers. The result is the unpacked layout's (Q8_0 / U4_1, one byte per code) bit
    for bit, f32 and 8-bit activations alike, at any batch — except f32 activations against Q4_0/
    Q4_1 rows of a multiple of 256 weights where the fixed-point kernel reads them (AVX-512 VNNI:
    test_k_quant_gemm_rows_...)."""
    rng = np.random.default_rng()
    for n_in in (576, 512):
        packed = quantize_np(rng.standard_normal((300, n_in)).astype(np.float32), qtype).reshape(300, -1)
        blocks, layout = unpack_nibbles(packed, int(qtype), UNPACKED)
        wp, wu = QMatrix(jnp.asarray(packed), int(qtype), n_in), QMatrix(jnp.asarray(blocks), layout, n_in)
        for m in (1, 3, 8):
            x = jnp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
            for int8 in (False, True):
                if not int8 and n_in % 256 == 0 and build.fixed_point() and qtype in (Q.Q4_0, Q.Q4_1):
                    continue
                f = jax.jit(lambda x, w, int8=int8: qmatmul(x, w, int8_activations=int8))
                np.testing.assert_array_equal(np.asarray(f(x, wp)), np.asarray(f(x, wu)))


UNPACKED = {Q.Q4_0: Q.Q8_0, Q.Q4_1: U4_1, Q.Q5_0: Q.Q8_0, Q.Q5_1: U4_1}


@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1), ids=lambda t: t.name)
def test_unpacked_codes_hold_the_same_weights(qtype):
    """unpack_nibbles is lossless (Q4_0/Q5_0 -> Q8_0, Q4_1/Q5_1 -> U4_1); the kernel refuses a type
    it does not read with a message rather than misreading it."""
    rng = np.random.default_rng()
    packed = quantize_np(rng.standard_normal((96, 256)).astype(np.float32), qtype).reshape(96, -1)
    blocks, layout = unpack_nibbles(packed, int(qtype), UNPACKED)
    signed = qtype in (Q.Q4_0, Q.Q5_0)
    assert layout == (Q.Q8_0 if signed else U4_1) and blocks.shape[1] == 8 * (34 if signed else 36)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(jnp.asarray(blocks), layout)),
                                  dequantize_np(packed, qtype).reshape(96, 256))
    with pytest.raises(ValueError, match="K-quant blocks, not type 16"):  # IQ2_XXS
        qmatmul(jnp.ones((1, 256), jnp.float32), QMatrix(jnp.asarray(packed), 16, 256))


def as_cache(values, cache_dtype):
    """Random cache values as a cache of this type (--kv-dtype), and the values it holds as f32: a
    q8_0 cache is ggml's blocks (gguf.arithmetic.q8_0_blocks), read back as d * code."""
    if cache_dtype == "q8_0":
        blocks = q8_0_blocks(jnp.asarray(values, jnp.float32))
        return blocks, q8_0_values(blocks)
    cache = jnp.asarray(values, cache_dtype)
    return cache, cache.astype(jnp.float32)


CACHE_TYPES = [jnp.float32, jnp.float16, jnp.bfloat16, "q8_0"]
# f32 summation orders differ between the kernels and the jnp reference: an output near 0.016 of
# values ~N(0, 1) moved 2.9e-6 on the AVX2 build (D = 256, a window of 50; a fresh random case)
ATTENTION_ATOL = 1e-5


def prefill_case(rng, b, t, h, k, d, n_slots, c, start, cache_dtype):
    """A prefill attention case: queries q [b, t, h, d], random caches of n_slots x c positions (as
    the type, and as f32), b distinct slots, and positions start.. (np.int32 [b, t])."""
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    kc, kf = as_cache(rng.standard_normal((n_slots, c, k, d)) * 2, cache_dtype)
    vc, vf = as_cache(rng.standard_normal((n_slots, c, k, d)), cache_dtype)
    slots = jnp.asarray(rng.permutation(n_slots)[:b], jnp.int32)
    return q, kc, kf, vc, vf, slots, np.tile(start + np.arange(t), (b, 1)).astype(np.int32)


@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_attention_decode_matches_the_blocked_reference(cache_dtype):
    """Every cache type the kernel reads (--kv-dtype): the reference reads the same cache widened."""
    rng = np.random.default_rng()
    # rows past 64 keys are attended in pieces, then merged (attention.cc)
    # query heads per kv head 1-6 (groups of four and a remainder), head dims with an odd number of
    # 8-wide vectors (40: five), rows shorter than one 8-position score block and longer than a piece
    for b, h, k, d, n_slots, c in ((1, 9, 3, 64, 4, 300), (5, 8, 2, 128, 6, 700), (3, 4, 4, 16, 3, 17),
                                   (3, 6, 3, 32, 3, 2600), (2, 10, 2, 40, 3, 90), (2, 12, 2, 96, 3, 150)):
        if cache_dtype == "q8_0" and d % 32:
            continue  # q8_0 blocks hold 32 values
        q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
        kc, kf = as_cache(rng.standard_normal((n_slots, c, k, d)) * 2, cache_dtype)
        vc, vf = as_cache(rng.standard_normal((n_slots, c, k, d)), cache_dtype)
        slots = jnp.asarray(rng.integers(0, n_slots, b), jnp.int32)
        pos = rng.integers(0, c, b)
        pos[0] = -1 if b > 1 else pos[0]  # a row that sees no key: zeros
        pos[-1] = c - 1 if c > 2048 else pos[-1]
        pos = jnp.asarray(pos, jnp.int32)
        got = np.asarray(jax.jit(attention_decode)(q, kc, vc, slots, pos + 1))
        ref = np.asarray(jax.jit(cached_attention_blocked)(q[:, None], kf, vf, slots, pos[:, None])[:, 0])
        np.testing.assert_allclose(got, ref, atol=ATTENTION_ATOL, rtol=2e-5)
        one = np.asarray(jax.jit(attention_decode)(q[-1:], kc, vc, slots[-1:], pos[-1:] + 1))
        np.testing.assert_array_equal(one[0], got[-1])  # independent of its batch-mates


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.float16, "q8_0"])
def test_windowed_decode_in_a_ring_matches_the_reference(cache_dtype):
    """A sliding layer's decode (the last `window` keys) from the whole cache and from a ring holding
    the last R positions (p at p % R), rows before and after several wraps, a window longer than one
    key piece (split at multiples of 64 and at the ring's end): the reference over the whole cache."""
    rng = np.random.default_rng()
    n_slots, c, kv, d, r = 4, 6000, 2, 32, 2560
    for window in (7, 1500):
        q = jnp.asarray(rng.standard_normal((4, 6, d)), jnp.float32)
        full_k = rng.standard_normal((n_slots, c, kv, d)).astype(np.float32) * 2
        full_v = rng.standard_normal((n_slots, c, kv, d)).astype(np.float32)
        if cache_dtype == "q8_0":  # the values the cache can hold: the reference reads the same
            full_k, full_v = (np.asarray(as_cache(a, "q8_0")[1]) for a in (full_k, full_v))
        slots = np.array([0, 1, 3, 2], np.int32)  # a ring holds one row's positions: a slot each
        pos = np.array([5999, 3000, 40, 2559], np.int32)
        ring_k, ring_v = (rng.standard_normal((n_slots, r, kv, d)).astype(np.float32) for _ in range(2))  # stale
        for slot, last in zip(slots, pos):
            keep = np.arange(max(last - r + 1, 0), last + 1)
            ring_k[slot, keep % r], ring_v[slot, keep % r] = full_k[slot, keep], full_v[slot, keep]
        want = np.asarray(attention_reference(q[:, None], jnp.asarray(full_k[slots]), jnp.asarray(full_v[slots]),
                                              jnp.asarray(pos[:, None]), window=window)[:, 0])
        lens = jnp.asarray(pos + 1)
        for kc, vc, ring in ((full_k, full_v, False), (ring_k, ring_v, True)):
            kc, vc = as_cache(kc, cache_dtype)[0], as_cache(vc, cache_dtype)[0]
            run = jax.jit(partial(attention_decode, window=window, ring=ring))
            got = np.asarray(run(q, kc, vc, jnp.asarray(slots), lens))
            tol = 5e-3 if cache_dtype == jnp.float16 else 2e-5  # f16 rounds the cache itself (q8_0's hold their values)
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
            one = np.asarray(run(q[1:2], kc, vc, jnp.asarray(slots[1:2]), lens[1:2]))
            np.testing.assert_array_equal(one[0], got[1])  # independent of its batch-mates
    with pytest.raises(Exception, match="ring"):  # a ring must hold its window
        jax.block_until_ready(attention_decode(q, jnp.asarray(ring_k), jnp.asarray(ring_v), jnp.asarray(slots), lens,
                                               window=r + 1, ring=True))


def test_attention_decode_refuses_out_of_range_slots():
    q = jnp.zeros((1, 2, 8))
    kc = jnp.zeros((2, 4, 1, 8))
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(attention_decode(q, kc, kc, jnp.asarray([2], jnp.int32), jnp.asarray([1], jnp.int32)))


def test_decode_attention_defaults_to_native_on_the_cpu():
    assert dispatch.kernel_mode("attention_decode", "cpu", env="") == "native"
    assert dispatch.kernel_mode("attention_prefill", "cpu", env="") == "native"
    assert dispatch.kernel_mode("attention_decode", "cpu", env="native") == "native"
    assert dispatch.kernel_mode("moe_q3k", "cpu", env="native") == "reference"  # a bare native: where one exists
    assert dispatch.kernel_mode("attention_decode", "cuda", env="") == "pallas"
    with pytest.raises(ValueError, match="no native kernel"):
        dispatch.kernel_mode("deltanet", "cpu", env="deltanet=native")
    with pytest.raises(ValueError, match="not available"):
        dispatch.kernel_mode("attention_decode", "cuda", env="native")


def test_disabled_native_kernels_say_why(monkeypatch):
    monkeypatch.setenv(ENV_NATIVE, "0")
    monkeypatch.setattr(build, "_state", {})
    assert not build.available()
    assert build.unavailable_reason() == f"{ENV_NATIVE}=0"
    assert dispatch.kernel_mode("attention_decode", "cpu", env="") == "reference"
    with pytest.raises(ValueError, match="PANTHEON_NATIVE=0"):
        dispatch.kernel_mode("attention_decode", "cpu", env="native")


# llama-quantize's Q4_K_M: Q6_K attn_v and ffn_down in some layers only, so layer 0 holds wq/wk/wv
# apart (types differ: no fused wqkv) and layer 1 fused — one program, two weight layouts.
Q4_K_M_MIX = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K}


@pytest.mark.parametrize("weight_type", (Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q3_K, Q.Q4_K, Q.Q6_K, Q.F16, Q.IQ4_NL,
                                         Q.IQ4_XS, "Q4_K_M"),
                         ids=lambda t: getattr(t, "name", t))
def test_decode_on_quant_blocks_equals_decode_on_f32_weights(tmp_path, weight_type):
    """On the CPU every matrix the kernel reads is held only as its blocks (weights._load_resident):
    decode reads them in the kernel, long prefill chunks dequantize them in the program. A runner
    over f32 weights (the bf16/mesh loader's form, here in f32) gives the same logits up to
    summation order and the same greedy tokens. Layers of one program may differ in their weights'
    types (Q4_K_M): each layout gets its own executable."""
    mix = Q4_K_M_MIX if weight_type == "Q4_K_M" else None
    weight_type = Q.Q4_K if mix else weight_type
    from pantheon.engine.runner import ModelRunner
    from pantheon.gguf import open_gguf
    from pantheon.model import weights
    from pantheon.model.family import family_of
    from pantheon.model.spec import spec_from_gguf
    from tests.fixtures.tiny_models import write_tiny_llama

    g = open_gguf(write_tiny_llama(tmp_path / "m.gguf", weight_type=weight_type, embd_type=Q.Q8_0, n_layer=2,
                                   n_embd=256, n_ff=512, type_overrides=mix))
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    params = fam.load_params(g, spec)
    assert isinstance(params["head"], QMatrix) and "decode" not in params
    assert all(isinstance(m, QMatrix) for layer in params["layers"] for k, m in layer.items() if k.startswith("w"))
    if mix:
        assert "wv" in params["layers"][0] and "wqkv" in params["layers"][1]
    dense_params = weights.load_params(g, spec, device=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))
    assert not isinstance(dense_params["head"], QMatrix)
    runs = []
    for p in (params, dense_params):
        runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), p, n_slots=2, ctx=64)
        prompts = ([1, 72, 101, 108, 108, 111], list(range(3, 40)))  # 37 tokens: a chunk past the kernel's rows
        last = [int(np.argmax(np.asarray(runner.prefill(s, t, 0)))) for s, t in enumerate(prompts)]
        out = []
        for i in range(4):
            logits = np.asarray(runner.decode([0, 1], last, [len(t) + i for t in prompts]))[:2]
            out.append(logits)
            last = [int(t) for t in logits.argmax(-1)]
        runs.append(np.stack(out))
    quant, dense = runs
    assert dense.std() > 0.1
    np.testing.assert_allclose(quant, dense, atol=1e-4, rtol=0)
    assert (quant.argmax(-1) == dense.argmax(-1)).all()


def test_half_rows_refuse_8bit_activations():
    w, _ = random_matrix(np.random.default_rng(), 8, 64, Q.F16)
    with pytest.raises(ValueError, match="f32 activations"):
        qmatmul(jnp.ones((1, 64)), w, int8_activations=True)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES + HALF, ids=lambda t: t.name)
def test_the_prefill_gemm_is_the_dequantized_product_row_by_row(qtype):
    """Long exact prefill chunks on AVX-512 (qmatmul.qgemm): the dequantized weights' product in
    f32 (each output one FMA chain over k), to f32 accuracy against float64; every row's result
    the same bit for bit alone or in any batch (a tail tile's padding, depth spans), trailing zero rows (a
    chunk's padding) zeros; K-tiled blocks give the row-major product exactly; rows of 32-weight
    blocks not a multiple of 256 (576) take a short last depth block."""
    if not build.gemm():
        pytest.skip("the native GEMM is built for AVX-512 only; this build multiplies through XLA's")
    from pantheon.native.qmatmul import qgemm

    rng = np.random.default_rng()
    shapes = ((64, 512), (96, 4096)) if qtype in K_QTYPES else ((64, 576), (32, 1024))
    for n_out, n_in in shapes:
        w, dense = random_matrix(rng, n_out, n_in, qtype)
        x = rng.standard_normal((300, n_in)).astype(np.float32)  # x [300, 4096] runs in three depth spans
        x[290:] = 0.0  # a chunk's padding
        x = jnp.asarray(x)
        got = np.asarray(jax.jit(qgemm)(x, w))
        exact = np.asarray(x, np.float64) @ dense.T.astype(np.float64)
        assert np.abs(got - exact).max() <= 2e-6 * np.abs(exact).max() * np.sqrt(n_in / 32)
        assert not got[290:].any()
        assert not np.asarray(jax.jit(qgemm)(jnp.zeros_like(x[:5]), w)).any()  # all padding: nothing computed
        for a, e in ((0, 1), (5, 19), (14, 28), (280, 290)):
            np.testing.assert_array_equal(np.asarray(jax.jit(qgemm)(x[a:e], w)), got[a:e])
        if qtype in K_QTYPES and qtype != Q.IQ4_XS and n_in >= 4096:
            np.testing.assert_array_equal(np.asarray(jax.jit(qgemm)(x, tile_k(w))), got)


def stacked_experts(rng, n_expert: int, n_out: int, n_in: int, qtype) -> tuple[QMatrix, list[QMatrix]]:
    """Routed experts as the models load them (one QMatrix [X, out, row bytes]) and each one alone."""
    alone = [random_matrix(rng, n_out, n_in, qtype)[0] for _ in range(n_expert)]
    return QMatrix(jnp.stack([w.blocks for w in alone]), int(qtype), n_in), alone


@pytest.mark.parametrize("qtype,int8_activations", [(t, i) for t in QTYPES + K_QTYPES for i in (False, True)] +
                         [(t, False) for t in HALF], ids=lambda v: getattr(v, "name", {False: "f32", True: "int8"}.get(v)))
def test_routed_experts_are_each_experts_own_product(qtype, int8_activations):
    """Routed experts read in place (qmatmul.expert_qmatmul): each assignment's row times its
    expert's rows of the stacked blocks is, bit for bit, the kernel's product of that expert's rows
    (its assignments in order, from a row per token or per assignment) with the expert alone —
    experts spread over the cores (several) or each over all of them (one) — and within f32
    accuracy of the jnp reference; trailing rows of zeros (a chunk's padding, routed last) are
    zeros; exact products of gemm_rows rows or more take the GEMM where it is built, as qgemm."""
    from pantheon.native.qmatmul import qgemm

    rng = np.random.default_rng()
    n_in = 512
    w, alone = stacked_experts(rng, 5, 64, n_in, qtype)
    for experts, per_token in (([[3, 0], [3, 4], [1, 3], [0, 4], [3, 1], [2, 3]], True), ([[2, 0], [2, 1], [0, 2]], False),
                               ([[2], [2], [2]], True)):  # several experts (over the cores), one (each over all)
        ids = np.asarray(experts, np.int32)
        n, k = ids.shape
        tokens = rng.standard_normal((n, n_in)).astype(np.float32)
        tokens[-1] = 0.0  # padding: the last token
        for x in ([tokens] if per_token else [np.repeat(tokens, k, axis=0) * rng.uniform(0.5, 2, (n * k, 1)).astype(np.float32)]):
            rows_of = lambda a: x[a] if x.shape[0] == n * k else x[a // k]  # noqa: E731
            for gemm_rows in ((0, 3) if build.gemm() and not int8_activations else (0,)):
                got = np.asarray(jax.jit(partial(expert_qmatmul, int8_activations=int8_activations, gemm_rows=gemm_rows))(
                    jnp.asarray(x), jnp.asarray(ids), w))
                for e in set(ids.reshape(-1).tolist()):
                    at = np.flatnonzero(ids.reshape(-1) == e)  # its assignments, in order
                    xe = np.stack([rows_of(a) for a in at])
                    live = int(np.flatnonzero(xe.any(axis=1)).max(initial=-1)) + 1
                    want = np.zeros((len(at), 64), np.float32)
                    if live:
                        xl = jnp.asarray(xe[:live])
                        want[:live] = np.asarray(qgemm(xl, alone[e]) if gemm_rows and live >= gemm_rows
                                                 else qmatmul(xl, alone[e], int8_activations=int8_activations))
                    np.testing.assert_array_equal(got[at], want, err_msg=f"expert {e}, gemm_rows {gemm_rows}")
            ref = np.asarray(jax.jit(partial(expert_qmatmul_reference, int8_activations=int8_activations))(
                jnp.asarray(x), jnp.asarray(ids), w))
            assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max() * np.sqrt(n_in / 32)


def test_routed_experts_refuse_an_expert_id_out_of_range_and_a_mismatched_x():
    rng = np.random.default_rng(0)
    w, _ = stacked_experts(rng, 3, 32, 256, Q.Q4_K)
    x = jnp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
    with pytest.raises(Exception, match="expert id out of range"):
        np.asarray(expert_qmatmul(x, jnp.asarray([[0], [3]], jnp.int32), w))
    with pytest.raises(Exception, match="a row per token or per assignment"):
        np.asarray(expert_qmatmul(x, jnp.asarray([[0, 1], [2, 1], [1, 0]], jnp.int32), w))


def test_a_prefill_chunk_holds_no_layer_of_f32_weights(monkeypatch):
    """Long chunks multiply f32 weights dequantized from the blocks (layers.linear). The native GEMM
    dequantizes a tile at a time: two chained 1024 x 1024 products need no temporary matrix; through
    XLA's GEMM each matrix's dequantization waits for its input, so XLA does not dequantize a layer's
    matrices all at the start and hold them together: about one matrix of temporary memory."""
    from pantheon.model.layers import linear

    rng = np.random.default_rng(0)
    w1, w2 = (QMatrix(jnp.asarray(quantize_np(rng.standard_normal((1024, 1024)).astype(np.float32), Q.Q8_0)),
                      int(Q.Q8_0), 1024) for _ in range(2))
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)  # more rows than the kernel takes
    one = 1024 * 1024 * 4

    def temp():
        fn = jax.jit(lambda x, a, b: linear(linear(x, a), b))
        return fn.lower(x, w1, w2).compile().memory_analysis().temp_size_in_bytes

    if build.gemm():
        assert temp() < one / 2  # the intermediate activations only
    monkeypatch.setattr(build, "gemm", lambda: False)
    assert one <= temp() < 1.5 * one


def test_prefill_chunks_go_through_the_kernel_up_to_the_measured_row_counts(monkeypatch):
    """Where the fixed-point K-quant kernel runs (AVX-512 VNNI) it keeps Q4_K/Q5_K chunks of up to
    128 rows (its GEMM; Q4_0/Q4_1 too where a row is a multiple of 256 weights) and Q2_K/Q3_K/Q6_K
    ones of up to 32 from the native f32 GEMM, other types 32; elsewhere 16 (32 for large
    matrices); a K-tiled matrix counts as its block type."""
    from pantheon.native import qmatmul as qm

    def matrix(qtype, n_out, n_in):
        per, size = (256, qm.SUPER_BLOCK_BYTES[qtype]) if qtype in qm.K_TYPES else (32, qm.BLOCK_BYTES[qtype])
        return QMatrix(jnp.zeros((n_out, n_in // per * size), jnp.uint8), int(qtype), n_in)

    small, large = (2048, 1024), (8192, 2048)
    for fixed in (True, False):
        monkeypatch.setattr(qm.build, "fixed_point", lambda fixed=fixed: fixed)
        for qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            gemm = fixed and qtype in (Q.Q4_K, Q.Q5_K)
            small_rows = qm.GEMM_KERNEL_ROWS if gemm else qm.FIXED_KERNEL_ROWS if fixed else 16
            large_rows = qm.GEMM_KERNEL_ROWS if gemm else qm.FIXED_KERNEL_ROWS if fixed else 32
            assert qm.kernel_rows(matrix(qtype, *small)) == small_rows
            assert qm.kernel_rows(matrix(qtype, *large)) == large_rows
            tiled = matrix(qtype, *large)
            assert qm.kernel_rows(QMatrix(tiled.blocks, tiled.qtype + TILED, tiled.n_in)) == large_rows
        other_rows = (32, 32) if fixed else (16, 32)
        assert (qm.kernel_rows(matrix(Q.Q8_0, *small)), qm.kernel_rows(matrix(Q.Q8_0, *large))) == other_rows
        assert (qm.kernel_rows(matrix(Q.IQ4_XS, *small)), qm.kernel_rows(matrix(Q.IQ4_XS, *large))) == other_rows
        for qtype in (Q.Q4_0, Q.Q4_1):  # rows of a multiple of 256 weights: the K-quant GEMM's
            assert qm.kernel_rows(matrix(qtype, *large)) == (qm.GEMM_KERNEL_ROWS if fixed else 32)
            assert qm.kernel_rows(matrix(qtype, 2048, 576)) == other_rows[0]


@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_prefill_attention_matches_the_blocked_reference(cache_dtype):
    """The native prefill attention (a chunk's queries against their slots, read in place) against
    cached_attention_blocked on the same caches widened: query heads per kv head 1-6, head dims 16 to
    256 (on AVX-512 those of a multiple of 16 take the 16-wide kernel, 40 the 8-wide one), chunks starting at 0 and deep in the cache, a row whose queries see no key (zeros) and a
    final chunk's padding positioned past the cache."""
    from pantheon.native.attention import attention_prefill

    rng = np.random.default_rng()
    for b, t, h, k, d, n_slots, c, start in ((1, 37, 9, 3, 64, 3, 300, 0), (2, 70, 8, 2, 128, 4, 400, 200),
                                             (3, 5, 4, 4, 16, 3, 40, 30), (2, 20, 10, 2, 40, 2, 150, 100),
                                             (1, 16, 12, 2, 96, 2, 100, 60), (1, 23, 4, 1, 256, 2, 90, 50)):
        if cache_dtype == "q8_0" and d % 32:
            continue
        q, kc, kf, vc, vf, slots, pos = prefill_case(rng, b, t, h, k, d, n_slots, c, start, cache_dtype)
        if b > 1:
            pos[1] = -1  # a row that sees no key: zeros
        pos = jnp.asarray(pos)
        got = np.asarray(jax.jit(attention_prefill)(q, kc, vc, slots, pos))
        ref = np.asarray(jax.jit(cached_attention_blocked)(q, kf, vf, slots, pos))
        np.testing.assert_allclose(got, ref, atol=ATTENTION_ATOL, rtol=2e-5)
        if b > 1:
            assert not got[1].any()
        alone = np.asarray(jax.jit(attention_prefill)(q[:1], kc, vc, slots[:1], pos[:1]))
        np.testing.assert_array_equal(alone[0], got[0])  # independent of its batch-mates
        split = t // 3  # ... and of the chunk it came in
        parts = [np.asarray(jax.jit(attention_prefill)(q[:1, a:e], kc, vc, slots[:1], pos[:1, a:e]))
                 for a, e in ((0, split), (split, t))]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1)[0], got[0])
    # padding past the cache's end reads no further than the cache
    q = jnp.ones((1, 4, 2, 16), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((1, 8, 1, 16)), jnp.float32)
    out = np.asarray(attention_prefill(q, kc, kc, jnp.zeros(1, jnp.int32), jnp.asarray([[6, 7, 8, 9]], jnp.int32)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 2], out[0, 1])  # positions 8, 9 see the cache's 8 keys, as 7


@pytest.mark.parametrize("cache_dtype", CACHE_TYPES)
def test_windowed_prefill_attention_matches_the_blocked_reference(cache_dtype):
    """A sliding layer's prefill on the native kernel: each query sees its last `window` keys, in a
    cache of whole length or a ring (position p at p % R, R a multiple of the blocks holding the
    window and the chunk), against cached_attention_blocked with the same window; a row's result is
    its own (alone, or split over chunks, bit for bit); a ring too short for its window and chunk
    is refused."""
    from pantheon.native.attention import attention_prefill

    rng = np.random.default_rng()
    # (rows, chunk, heads, kv heads, D, slots, cache or ring length, chunk start, window, ring, context)
    for b, t, h, k, d, n_slots, c, start, window, ring, length in (
            (2, 40, 4, 1, 256, 3, 300, 200, 50, False, 0), (1, 37, 9, 3, 64, 2, 200, 0, 16, False, 0),
            (2, 60, 4, 2, 64, 2, 512, 900, 100, True, 2048), (1, 70, 6, 2, 40, 2, 256, 300, 130, True, 1024)):
        if cache_dtype == "q8_0" and d % 32:
            continue
        q, kc, kf, vc, vf, slots, pos = prefill_case(rng, b, t, h, k, d, n_slots, c, start, cache_dtype)
        pos = jnp.asarray(pos)
        native = jax.jit(attention_prefill, static_argnames=("window", "ring"))
        got = np.asarray(native(q, kc, vc, slots, pos, window=window, ring=ring))
        ref = np.asarray(jax.jit(cached_attention_blocked, static_argnames=("window", "ring", "length"))(
            q, kf, vf, slots, pos, window=window, ring=ring, length=length))
        np.testing.assert_allclose(got, ref, atol=ATTENTION_ATOL, rtol=2e-5)
        alone = np.asarray(native(q[:1], kc, vc, slots[:1], pos[:1], window=window, ring=ring))
        np.testing.assert_array_equal(alone[0], got[0])
        split = t // 3
        parts = [np.asarray(native(q[:1, a:e], kc, vc, slots[:1], pos[:1, a:e], window=window, ring=ring))
                 for a, e in ((0, split), (split, t))]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1)[0], got[0])
    q = jnp.zeros((1, 40, 2, 16))
    kc = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(Exception, match="ring must hold"):
        jax.block_until_ready(attention_prefill(q, kc, kc, jnp.zeros(1, jnp.int32),
                                                jnp.arange(40, dtype=jnp.int32)[None], window=32, ring=True))


def test_prefill_attention_refuses_out_of_range_slots():
    from pantheon.native.attention import attention_prefill

    q = jnp.zeros((1, 2, 2, 8))
    kc = jnp.zeros((2, 4, 1, 8))
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(attention_prefill(q, kc, kc, jnp.asarray([2], jnp.int32), jnp.asarray([[0, 1]], jnp.int32)))


def test_llamacpp_numerics_keep_the_jnp_prefill_attention():
    """`llamacpp` numerics keep the prefill attention their llama.cpp agreement was measured on; the
    decode kernel and `exact` numerics are unchanged (model/kernels.for_numerics)."""
    from pantheon.model import kernels as kern

    chosen = ((kern.ATTENTION_DECODE, "native"), (kern.ATTENTION_PREFILL, "native"), (kern.MOE_Q3K, "reference"))
    assert kern.for_numerics(chosen, "exact") == chosen
    assert dict(kern.for_numerics(chosen, "llamacpp")) == {kern.ATTENTION_DECODE: "native",
                                                           kern.ATTENTION_PREFILL: "reference", kern.MOE_Q3K: "reference"}


def test_products_from_several_threads_at_once_are_each_their_own():
    """The kernels' parallel loops run on helper threads of their own that spin between loops
    (common.h: Helpers), one loop at a time; a loop started while another holds them (a second
    model's device thread) runs on XLA's pool instead. Four threads multiplying at once, many
    times over, each get exactly the product they get alone."""
    import threading

    rng = np.random.default_rng()
    w, _ = random_matrix(rng, 512, 1024, Q.Q4_K)
    xs = [jnp.asarray(rng.standard_normal((m, 1024)).astype(np.float32)) for m in (1, 2, 3, 4)]
    f = jax.jit(qmatmul)
    alone = [np.asarray(f(x, w)) for x in xs]
    wrong = []

    def worker(i):
        for _ in range(40):
            got = np.asarray(f(xs[i], w))
            if not np.array_equal(got, alone[i]):
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and wrong == []
