"""Admission estimates the bytes a model will really occupy (tensor by tensor, as the loaders place
them) and compares them with the memory of its target: its dies' budgets on an accelerator, the
host's available memory on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pantheon.config import ModelConfig
from pantheon.engine import pool as pool_mod
from pantheon.engine.dies import Die
from pantheon.engine.pool import ModelPool, PoolError, estimate_device_bytes
from pantheon.gguf import open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import params_nbytes
from pantheon.native import build as native_build
from tests.fixtures.reference_qwen35moe import write_f32, write_q3_k_m, write_q3k_experts
from tests.fixtures.tiny_models import Q, write_tiny_llama


def weight_bytes(path) -> int:
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    return params_nbytes(family_of(spec).load_params(g, spec))


@pytest.mark.parametrize("make", [
    lambda d: write_q3k_experts(d / "q3k.gguf"), lambda d: write_f32(d / "f32.gguf"),
    lambda d: write_q3_k_m(d / "q3_k_m.gguf"),  # Q3_K gate/up in blocks, Q4_K down dequantized
    lambda d: write_tiny_llama(d / "q41.gguf", weight_type=Q.Q4_1, embd_type=Q.Q8_0)],
    ids=["qwen35moe-q3k-experts", "qwen35moe-f32", "qwen35moe-q3_k_m", "llama-q4_1"])
def test_the_estimate_is_what_the_loader_places(tmp_path, make):
    path = make(tmp_path)
    per_slot = estimate_device_bytes(str(path), 64, 1) - estimate_device_bytes(str(path), 64, 0)
    weights = estimate_device_bytes(str(path), 64, 0) - per_slot  # n_slots=0 still holds the scratch slot
    actual = weight_bytes(path)
    assert abs(weights - actual) <= 0.02 * actual, (weights, actual)


def test_q3k_experts_are_charged_as_blocks(tmp_path):
    blocks = estimate_device_bytes(str(write_q3k_experts(tmp_path / "q.gguf")), 64, 0)
    dense = estimate_device_bytes(str(write_f32(tmp_path / "f.gguf")), 64, 0)
    assert blocks < 0.5 * dense


def test_an_accelerator_admits_against_its_dies_budget(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    config = ModelConfig(path=str(path), name="m")
    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    need = estimate_device_bytes(str(path), 4096, 5)  # in the GPU's compute dtype (bf16)
    die = lambda budget: [Die(0, 0, "gpu", budget, 0, "device")]
    monkeypatch.setattr(pool_mod, "visible_dies", lambda: die(4 * need))
    pool = ModelPool()
    pool.admit(config)  # fits
    monkeypatch.setattr(pool_mod, "visible_dies", lambda: die(need // 2))
    with pytest.raises(PoolError) as e:
        pool.admit(config)
    assert e.value.status == 507 and "on dies [0]" in e.value.message


def qwen35_35b_a3b_tensors(expert_type) -> dict:
    """Tensor infos shaped like Qwen3.5-35B-A3B (40 layers, hidden 2048, 256 experts of 512, head
    dim 256, vocab 248k): the estimate needs no 15 GB file."""
    from gguf.constants import GGML_QUANT_SIZES

    def info(shape, kind=Q.F32):
        block, size = GGML_QUANT_SIZES[kind]
        n = 1
        for d in shape:
            n *= d
        return (shape, kind, n // block * size)

    e, x, f, v = 2048, 256, 512, 248320
    t = {"token_embd.weight": info((v, e), Q.Q8_0), "output.weight": info((v, e), Q.Q6_K)}
    for i in range(40):
        p = f"blk.{i}."
        t |= {p + "attn_qkv.weight": info((8192, e), Q.Q8_0), p + "attn_out.weight": info((e, 4096), Q.Q8_0),
              p + "ffn_gate_inp.weight": info((x, e)), p + "ffn_gate_shexp.weight": info((f, e), Q.Q8_0),
              p + "ffn_up_shexp.weight": info((f, e), Q.Q8_0), p + "ffn_down_shexp.weight": info((e, f), Q.Q8_0)}
        for name in ("ffn_gate_exps", "ffn_up_exps"):
            t[p + name + ".weight"] = info((x, f, e), expert_type)
        t[p + "ffn_down_exps.weight"] = info((x, e, f), expert_type)
    return t


def test_a_35b_a3b_shaped_model_is_admitted_on_an_h200_die_only_with_q3k_experts(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    monkeypatch.setattr(pool_mod, "visible_dies", lambda: [Die(0, 0, "gpu", 141 * 10 ** 9, 0, "device")])
    pool, config = ModelPool(), ModelConfig(path="synthetic", name="qwen35-35b-a3b")
    q3k = pool_mod.estimate_bytes("qwen35moe", qwen35_35b_a3b_tensors(Q.Q3_K), 40, 2, 256, 32768, 4, itemsize=4)
    assert 20e9 < q3k < 60e9  # experts in blocks (~14 GB), the rest f32, KV for 5 x 32k positions
    pool.check_fits(config, q3k)
    bf16 = pool_mod.estimate_bytes("qwen35moe", qwen35_35b_a3b_tensors(Q.Q3_K), 40, 2, 256, 32768, 4, itemsize=2)
    assert 14e9 < bf16 < 0.7 * q3k  # the GPU's compute dtype (model/dtypes.py) halves all but the blocks
    pool.check_fits(config, bf16)
    f32 = pool_mod.estimate_bytes("qwen35moe", qwen35_35b_a3b_tensors(Q.Q5_K), 40, 2, 256, 32768, 4, itemsize=4)
    assert f32 > 130e9  # experts of another type are dequantized: ~129 GB of them alone
    with pytest.raises(PoolError) as e:
        pool.check_fits(config, f32)
    assert e.value.status == 507
    if native_build.available():  # on the CPU its layers' matrices stay in the file's blocks (weights: ctx 1)
        weights = lambda **cpu: pool_mod.estimate_bytes("qwen35moe", qwen35_35b_a3b_tensors(Q.Q5_K), 40, 2, 256, 1, 4,  # noqa: E731
                                                        itemsize=4, **cpu)
        assert weights(on_cpu=True) < 0.3 * weights()


def test_bytes_per_device_survives_buffers_donated_by_a_running_step(tmp_path):
    """/admin/dies and /metrics ask from the event loop while the device thread donates the cache
    and sampler state to a step: the count comes from shapes and shardings, never from buffers
    that may already be gone (found by the dashboard polling during traffic: 'Array has been
    deleted')."""
    from pantheon.engine.engine import Engine

    engine = Engine(ModelConfig(str(write_tiny_llama(tmp_path / "m.gguf")), ctx_cap=64, max_sessions=1))
    before = engine.bytes_per_device()
    assert sum(before.values()) == params_nbytes(engine.runner.params) + engine.runner.cache.nbytes + sum(
        a.nbytes for a in jax.tree_util.tree_leaves(engine.runner.sampler_state))
    for a in engine.runner.cache.k + jax.tree_util.tree_leaves(engine.runner.sampler_state):
        a.delete()  # what a donating step leaves behind until it replaces them
    assert engine.bytes_per_device() == before


@pytest.mark.parametrize("kv_dtype,itemsize", [("f32", 4), ("f16", 2), ("bf16", 2), ("auto", 2), ("q8_0", 34 / 32)])
def test_the_kv_cache_is_charged_in_its_type(tmp_path, kv_dtype, itemsize):
    from pantheon.engine.engine import Engine
    from pantheon.model.dtypes import kv_value_bytes

    path = write_tiny_llama(tmp_path / "m.gguf", n_embd=128)  # head dim 32: q8_0's blocks
    per_slot = (estimate_device_bytes(str(path), 64, 1, kv_dtype=kv_dtype)
                - estimate_device_bytes(str(path), 64, 0, kv_dtype=kv_dtype))
    spec = spec_from_gguf(open_gguf(path))
    assert per_slot == 2 * spec.n_layer * 64 * spec.n_head_kv * spec.head_dim * itemsize
    engine = Engine(ModelConfig(str(path), ctx_cap=64, max_sessions=1, kv_dtype=kv_dtype))
    try:
        assert engine.kv_bytes == 2 * per_slot  # one session and the scratch slot
        assert kv_value_bytes(engine.runner.cache.k[0].dtype) == itemsize
        assert engine.kv_dtype_name == (kv_dtype if kv_dtype != "auto" else "f16")  # the CPU's default
    finally:
        engine.stop()


def test_an_unknown_kv_type_is_refused(tmp_path, monkeypatch):
    from pantheon.config import ENV_KV_DTYPE, ServeConfig
    from pantheon.model.dtypes import kv_cache_dtype

    with pytest.raises(ValueError, match="q4_0"):
        kv_cache_dtype("cpu", "q4_0")
    # auto: f16 on the CPU, f32 with llamacpp numerics (its tokens are llama.cpp's with f32), bf16 on a GPU
    assert kv_cache_dtype("cpu") == jnp.float16 and kv_cache_dtype("cpu", "auto", "llamacpp") == jnp.float32
    assert kv_cache_dtype("cuda") == jnp.bfloat16 and kv_cache_dtype("cpu", "f16", "llamacpp") == jnp.float16
    with pytest.raises(ValueError, match="CPU"):  # the Pallas kernels read no q8_0 cache
        kv_cache_dtype("cuda", "q8_0")
    monkeypatch.setenv(ENV_KV_DTYPE, "q4_0")
    with pytest.raises(ValueError, match="PANTHEON_KV_DTYPE"):
        ServeConfig.from_env()
    monkeypatch.setenv(ENV_KV_DTYPE, "F32")
    assert ServeConfig.from_env().model_config("m.gguf", None).kv_dtype == "f32"


def test_a_model_past_the_host_budget_is_refused_before_loading(tmp_path, monkeypatch):
    """CPU admission plans with MemAvailable, capped by PANTHEON_HOST_MEMORY_BYTES: a model whose
    load would not fit is refused (507) before a byte of it is read."""
    from pantheon.config import ENV_HOST_MEMORY

    path = write_tiny_llama(tmp_path / "m.gguf")
    config = ModelConfig(path=str(path), name="m", ctx_cap=64, max_sessions=1)
    need = estimate_device_bytes(str(path), 64, 1)
    monkeypatch.setenv(ENV_HOST_MEMORY, str(4 * need))
    ModelPool().admit(config)  # fits
    monkeypatch.setenv(ENV_HOST_MEMORY, str(need))  # over 90 % of the budget
    with pytest.raises(PoolError) as e:
        ModelPool().admit(config)
    assert e.value.status == 507 and "admission refused" in e.value.message and ENV_HOST_MEMORY in e.value.message


def test_a_q8_0_cache_needs_heads_of_whole_blocks(tmp_path):
    """q8_0 holds 32 values a block: a model whose head dimension is not a multiple of 32 is refused
    at load with the reason, not misread."""
    from pantheon.engine.engine import Engine

    path = write_tiny_llama(tmp_path / "m.gguf")  # head dim 16
    with pytest.raises(ValueError, match="divisible by 32"):
        Engine(ModelConfig(str(path), ctx_cap=64, max_sessions=1, kv_dtype="q8_0"))
