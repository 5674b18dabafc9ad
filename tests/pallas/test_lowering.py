"""Every Pallas kernel lowers for CUDA (Triton) at production-like shapes, on this CPU-only jaxlib;
and the dispatch rules.

pantheon.pallas.lowering.lower_for_cuda runs the Pallas -> Triton lowering without a GPU, which
enforces the Triton rules (power-of-2 values, supported primitives, no scalar prefetch); see its
docstring for jaxlib > 0.10.2. Shapes follow Qwen3.5-35B-A3B:
hidden 2048, 16 query / 2 kv heads, head_dim 256 (and 128), 256 experts / 8 used, expert FFN 512,
8 decode slots, 4k context; Gated DeltaNet with 32 value heads, Dk = Dv = 128, 512-token chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pantheon.config import ENV_KERNELS
from pantheon.native import build as native_build
from pantheon.pallas import dispatch, lowering
from pantheon.pallas.attention import decode_attention, flash_attention
from pantheon.pallas.deltanet import gated_delta_rule, gated_delta_rule_step
from pantheon.pallas.lowering import lower_for_cuda, triton_calls
from pantheon.pallas.moe import moe_ffn
from pantheon.pallas.moe_q3k import Q3KPlanes, grouped_matmul_q3k

S = jax.ShapeDtypeStruct
HIDDEN, N_HEAD, N_KV, EXPERTS, TOP_K, FFN, SLOTS, CTX = 2048, 16, 2, 256, 8, 512, 8, 4096
DN_HEADS, DN_DIM, DN_CHUNK = 32, 128, 512


def _assert_triton(text: str | None, n_kernels: int):
    if text is None:
        return
    found = triton_calls(text)
    assert found >= n_kernels, f"expected {n_kernels} Triton custom calls, found {found}"


def _planes(e, n, k):
    nb = k // 256
    return Q3KPlanes(S((e, n, nb * 64), jnp.uint8), S((e, n, nb * 32), jnp.uint8),
                     S((e, n, nb * 16), jnp.uint8), S((e, n, nb), jnp.float16))


def test_lowering_check_is_live():
    """The CPU-side lowering really applies Triton's rules: a 24-wide value is rejected."""
    def bad(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    call = pl.pallas_call(bad, out_shape=S((24,), jnp.float32), grid=(1,),
                          in_specs=[pl.BlockSpec((24,), lambda i: (0,))],
                          out_specs=pl.BlockSpec((24,), lambda i: (0,)),
                          compiler_params=lowering.triton_params(4, 2))
    with pytest.raises(Exception, match="power of 2"):
        lower_for_cuda(call, S((24,), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [128, 256])
def test_flash_attention_lowers(d, dtype):
    text = lower_for_cuda(lambda q, k, v, p: flash_attention(q, k, v, p),
                          S((1, 512, N_HEAD, d), dtype), S((1, CTX, N_KV, d), dtype), S((1, CTX, N_KV, d), dtype),
                          S((1, 512), jnp.int32))
    _assert_triton(text, 1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [128, 256])
def test_decode_attention_lowers(d, dtype):
    cache = S((SLOTS + 1, CTX, N_KV, d), dtype)
    text = lower_for_cuda(lambda q, k, v, s, n: decode_attention(q, k, v, s, n),
                          S((SLOTS, N_HEAD, d), dtype), cache, cache, S((SLOTS,), jnp.int32), S((SLOTS,), jnp.int32))
    _assert_triton(text, 1)


@pytest.mark.parametrize("ring", [False, True])
def test_sliding_window_decode_attention_lowers(ring):
    """Gemma 3's sliding layers: a window of 512, in the whole cache or in a ring of 1536 (model/state.py)."""
    cache = S((SLOTS + 1, 1536 if ring else CTX, 1, 256), jnp.bfloat16)
    text = lower_for_cuda(lambda q, k, v, s, n: decode_attention(q, k, v, s, n, window=512, ring=ring),
                          S((SLOTS, 4, 256), jnp.bfloat16), cache, cache, S((SLOTS,), jnp.int32), S((SLOTS,), jnp.int32))
    _assert_triton(text, 1)


@pytest.mark.parametrize("m", [SLOTS * TOP_K, 512 * TOP_K])  # a decode step, a 512-token prefill chunk
@pytest.mark.parametrize("n,k", [(FFN, HIDDEN), (HIDDEN, FFN)])  # gate/up, down
def test_grouped_matmul_q3k_lowers(m, n, k):
    text = lower_for_cuda(lambda x, g, p: grouped_matmul_q3k(x, g, p), S((m, k), jnp.bfloat16),
                          S((EXPERTS,), jnp.int32), _planes(EXPERTS, n, k))
    _assert_triton(text, 1)


@pytest.mark.parametrize("fused", [False, True])
def test_moe_ffn_lowers(fused):
    gate = _planes(EXPERTS, 2 * FFN if fused else FFN, HIDDEN)
    up = None if fused else _planes(EXPERTS, FFN, HIDDEN)
    text = lower_for_cuda(lambda x, r, g, u, d: moe_ffn(x, r, TOP_K, g, u, d, impl="pallas"),
                          S((SLOTS, HIDDEN), jnp.float32), S((SLOTS, EXPERTS), jnp.float32), gate, up,
                          _planes(EXPERTS, HIDDEN, FFN))
    _assert_triton(text, 2 if fused else 3)


def _deltanet_args(b, t, dtype):
    tok, gate = S((b, t, DN_HEADS, DN_DIM), dtype), S((b, t, DN_HEADS), jnp.float32)
    return tok, tok, tok, gate, gate, S((b, DN_HEADS, DN_DIM, DN_DIM), jnp.float32), S((b,), jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("chunk", [1, 64])  # sequential in-kernel loop; chunked (two kernels)
def test_gated_delta_rule_lowers(chunk, dtype):
    text = lower_for_cuda(lambda *a: gated_delta_rule(*a, chunk=chunk), *_deltanet_args(1, DN_CHUNK, dtype))
    _assert_triton(text, 1 if chunk == 1 else 2)


@pytest.mark.parametrize("chunk", [1, 32])
def test_gated_delta_rule_ragged_batch_lowers(chunk):
    """B > 1 and T not a multiple of the chunk (padded inside)."""
    text = lower_for_cuda(lambda *a: gated_delta_rule(*a, chunk=chunk), *_deltanet_args(4, 300, jnp.float32))
    _assert_triton(text, 1 if chunk == 1 else 2)


def test_gated_delta_rule_step_lowers_in_place():
    tok, gate = S((SLOTS, DN_HEADS, DN_DIM), jnp.float32), S((SLOTS, DN_HEADS), jnp.float32)
    cache = S((SLOTS + 1, DN_HEADS, DN_DIM, DN_DIM), jnp.float32)
    text = lower_for_cuda(lambda *a: gated_delta_rule_step(*a), tok, tok, tok, gate, gate, cache,
                          S((SLOTS,), jnp.int32))
    _assert_triton(text, 1)
    if text is not None:  # the cache operand (index 6) is the kernel's second output: updated in place
        assert "output_operand_aliases" in text and "operand_index = 6" in text


# ---- dispatch ----------------------------------------------------------------------------------------
def test_dispatch_defaults():
    for name in dispatch.KERNELS:
        # the CPU's decode attention is the native kernel (tests/native) where it is built
        assert dispatch.kernel_mode(name, "cpu", env="") == ("native" if name in dispatch.NATIVE_KERNELS
                                                             and native_build.available() else "reference")
        assert dispatch.kernel_mode(name, "cuda", env="") == "pallas"
        assert dispatch.kernel_mode(name, "gpu", env="") == "pallas"
        assert dispatch.kernel_mode(name, "tpu", env="") == "reference"
    assert set(dispatch.kernel_choices("cpu", env="")) == {"attention_prefill", "attention_decode", "moe_q3k",
                                                          "deltanet", "qmatmul"}


def test_dispatch_overrides(monkeypatch):
    assert dispatch.kernel_choices("cpu", env="interpret") == dict.fromkeys(dispatch.KERNELS, "interpret")
    assert dispatch.kernel_choices("cuda", env="reference, moe_q3k=pallas") == {
        "attention_prefill": "reference", "attention_decode": "reference", "moe_q3k": "pallas", "deltanet": "reference",
        "qmatmul": "reference"}
    assert dispatch.kernel_mode("attention_decode", "cpu", env="attention_decode=interpret") == "interpret"
    # the others keep the CPU default: the native kernel where it is built
    assert dispatch.kernel_mode("attention_prefill", "cpu", env="attention_decode=interpret") == \
        dispatch.default_mode("cpu", "attention_prefill") in ("native", "reference")
    monkeypatch.setenv(ENV_KERNELS, "interpret")
    assert dispatch.kernel_mode("moe_q3k") == "interpret"
    assert dispatch.kernel_choices()["deltanet"] == "interpret"
    assert dispatch.interpret_flag("interpret") is True and dispatch.interpret_flag("pallas") is False


def test_dispatch_errors():
    with pytest.raises(ValueError, match="backend is 'cpu'"):
        dispatch.kernel_mode("moe_q3k", "cpu", env="pallas")
    assert dispatch.kernel_choices("cpu", env="pallas")["moe_q3k"].startswith("error:")
    with pytest.raises(ValueError, match="unknown mode 'triton'"):
        dispatch.kernel_mode("moe_q3k", "cpu", env="triton")
    with pytest.raises(ValueError, match="unknown kernel 'mlp'"):
        dispatch.kernel_mode("moe_q3k", "cpu", env="mlp=reference")
    with pytest.raises(ValueError, match="unknown kernel 'mlp'"):
        dispatch.kernel_mode("mlp", "cpu", env="")
    with pytest.raises(ValueError, match="does not run a Pallas kernel"):
        dispatch.interpret_flag("reference")


def test_dispatch_entry_points(monkeypatch):
    """The model's entry points call the implementation kernel_mode picks."""
    from pantheon.gguf.quants import quantize_np
    from pantheon.pallas.attention import attention_reference, decode_attention_reference
    from pantheon.pallas.moe import moe_ffn as moe_direct
    from pantheon.pallas.moe_q3k import q3k_planes_from_blocks

    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((1, 4, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
    pos = jnp.arange(4, dtype=jnp.int32)[None] + 2
    cache = jnp.asarray(rng.standard_normal((3, 32, 2, 16)), jnp.float32)
    slots, lengths = jnp.array([2], jnp.int32), jnp.array([17], jnp.int32)
    planes = [q3k_planes_from_blocks(quantize_np(rng.standard_normal(shape).astype(np.float32), 11))
              for shape in ((4, 256, 256), (4, 256, 256), (4, 256, 256))]
    x, logits = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32), jnp.asarray(rng.standard_normal((3, 4)))

    monkeypatch.setenv(ENV_KERNELS, "reference")
    assert jnp.array_equal(dispatch.attention_prefill(q, kv, kv, pos), attention_reference(q, kv, kv, pos))
    want = decode_attention_reference(q[:, 0], cache, cache, slots, lengths)
    assert jnp.array_equal(dispatch.attention_decode(q[:, 0], cache, cache, slots, lengths), want)
    assert jnp.array_equal(dispatch.moe_ffn(x, logits, 2, *planes), moe_direct(x, logits, 2, *planes, impl="reference"))

    monkeypatch.setenv(ENV_KERNELS, "attention_decode=interpret")
    got = dispatch.attention_decode(q[:, 0], cache, cache, slots, lengths)
    assert float(jnp.abs(got - want).max()) <= 5e-5

    monkeypatch.setenv(ENV_KERNELS, "pallas")
    with pytest.raises(ValueError, match="backend is 'cpu'"):
        dispatch.attention_prefill(q, kv, kv, pos, backend="cpu")
