"""arithmetic.IntBlocks / int_linear: llama.cpp's CPU arithmetic for a quantized matmul, in jnp.

Checked against an independent numpy transcription of ggml-cpu: activations rounded per row
(quantize_row_q8_K_ref / quantize_row_q8_0 / _q8_1), integer block sums in int64, then each block's
sum scaled by d_x * d_w in float32 (and the min term: Q8_K block sums against the integer mins,
or Q8_1's fp16 block sum times m). Only the final adds over blocks may round differently: 2e-6
relative. Weights and inputs are fresh random draws each run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pantheon.gguf.quants import SCALE_FIELDS, dequantize_np, integer_parts, quantize_np
from pantheon.model.layers import linear
from pantheon.gguf.arithmetic import IntBlocks, int_linear


def ggml_q8(x: np.ndarray, block: int):
    """numpy float32 transcription of ggml's activation rounding -> (q int64 [R, nb, block], d [R, nb], s [R, nb])."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    if block == 256:  # Q8_K: iscale = -127 / (signed extreme), d = 1 / iscale
        mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
        iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
        q = np.minimum(np.rint(xb * iscale[..., None]), 127)
        d = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
        return q.astype(np.int64), d, None
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(xb * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)[..., None].astype(np.float32))
    s = (d * q.sum(-1)).astype(np.float16).astype(np.float32)
    return q.astype(np.int64), d.astype(np.float16).astype(np.float32), s


def ggml_matmul(x: np.ndarray, raw: np.ndarray, qtype) -> np.ndarray:
    c, dw, mn, dmin = (None if a is None else np.asarray(a) for a in integer_parts(raw, qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    q, dx, s = ggml_q8(x, block)
    nb = dw.shape[-1]
    c = c.astype(np.int64).reshape(c.shape[0], nb, block)  # [out, nb, block]
    isum = np.einsum("rbk,obk->rob", q, c)  # exact
    y = (dx[:, None, :] * dw[None]).astype(np.float32) * isum.astype(np.float32)
    if mn is not None:
        if s is not None and mn.shape[-1] == nb:  # Q8_1: m * fp16 block sum
            y = y + dmin[None] * s[:, None, :]
        else:
            sums = q.reshape(q.shape[0], nb, -1, block * nb // mn.shape[-1]).sum(-1)  # [r, nb, groups]
            msum = np.einsum("rbj,obj->rob", sums, mn.astype(np.int64).reshape(mn.shape[0], nb, -1))
            y = y + (dx[:, None, :] * dmin[None]).astype(np.float32) * msum.astype(np.float32)
    return y.astype(np.float64).sum(-1)


@pytest.mark.parametrize("qtype", sorted(SCALE_FIELDS, key=int), ids=lambda t: t.name)
def test_int_linear_is_ggml_integer_arithmetic(qtype):
    rng = np.random.default_rng()
    n_out, n_in = 24, 512
    raw = quantize_np((rng.standard_normal((n_out, n_in)) * 0.1).astype(np.float32), qtype)
    x = (rng.standard_normal((3, 5, n_in)) * rng.uniform(0.1, 10)).astype(np.float32)
    w = IntBlocks.from_gguf(raw, qtype, n_in)
    assert w.c.shape == (n_in, n_out) and w.block == GGML_QUANT_SIZES[qtype][0]
    got = np.asarray(linear(jnp.asarray(x), w))  # layers.linear routes IntBlocks to int_linear
    want = ggml_matmul(x.reshape(-1, n_in), raw, qtype).reshape(3, 5, n_out)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-6 * scale, (qtype.name, np.abs(got - want).max() / scale)
    # and it is not the float product of the dequantized weights (the activations really are rounded)
    plain = x @ dequantize_np(raw, qtype).T
    assert np.abs(plain - want).max() > 1e-4 * scale


def test_int_blocks_split_experts_and_refuse_a_wrong_width():
    rng = np.random.default_rng()
    raw = quantize_np(rng.standard_normal((3, 8, 256)).astype(np.float32), T.Q4_K)  # 3 experts [8, 256]
    w = IntBlocks.from_gguf(raw, T.Q4_K, 256)
    assert w.c.shape == (3, 256, 8) and w.mn.shape == (3, 8, 8) and w[1].c.shape == (256, 8)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    assert np.allclose(int_linear(jnp.asarray(x), w[1]), ggml_matmul(x, raw[1], T.Q4_K), rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="inputs decoded, expected 512"):
        IntBlocks.from_gguf(raw, T.Q4_K, 512)
