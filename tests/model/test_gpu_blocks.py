"""On a GPU the layer matrices stay in their quant blocks (QPlanes, pantheon/pallas/qmatmul.py) and the
model multiplies them through the Pallas kernel (dispatch.quantized_matmul). Here on the CPU:
`load_params(device_blocks=True)` loads them as on a GPU, and the kernel runs interpreted
(PANTHEON_KERNELS=qmatmul=interpret) or as its jnp reference; a tiny llama with a Q4_K_M-like mix of
types, and a Mixtral-style one with Q4_K experts through the grouped kernel, give the logits of the
CPU's own path (the native kernel over the same blocks)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pantheon.config import ENV_FULL_STEP, ENV_KERNELS
from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import load_params, params_nbytes
from pantheon.pallas import qmatmul as gpu_qmatmul
from pantheon.pallas.qmatmul import QPlanes
from tests.fixtures.tiny_models import Q, write_tiny_llama

TOL = 1e-4
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]
STEPS = [40, 41, 42]
# a Q4_K_M-like file: Q4_K, with Q6_K / Q5_K / Q8_0 / Q4_0 here and there, and one Q5_0 matrix (no
# GPU kernel reads Q5_0: it stays a dense matrix beside the blocks)
MIX = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_output.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q8_0,
       "blk.1.ffn_up.weight": Q.Q4_0, "blk.0.attn_q.weight": Q.Q5_0}


PAD_TOKENS = tuple(f"<pad{i}>" for i in range(15))  # 321 + 15 = 336 tokens: the head's rows tile by 16


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gb") / "mixed.gguf", n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            weight_type=Q.Q4_K, embd_type=Q.Q8_0, type_overrides=MIX, seed=5,
                            extra_tokens=PAD_TOKENS)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """An output matrix apart from the embedding (Q6_K head, Q4_0 embedding)."""
    return write_tiny_llama(tmp_path_factory.mktemp("gb") / "untied.gguf", n_embd=256, n_head=4, n_head_kv=2,
                            n_ff=512, weight_type=Q.Q8_0, tied=False, seed=7, extra_tokens=PAD_TOKENS,
                            type_overrides={"output.weight": Q.Q6_K, "token_embd.weight": Q.Q4_0})


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gb") / "moe.gguf", n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            weight_type=Q.Q4_K, embd_type=Q.Q8_0, n_expert=4, n_expert_used=2, n_ff_exp=256, seed=6,
                            type_overrides={"blk.1.ffn_down_exps.weight": Q.Q6_K})


def run(path, monkeypatch, device_blocks: bool, mode: str = "reference"):
    """Prefill PROMPT, decode STEPS: (prefill logits, decode logits, params)."""
    monkeypatch.setenv(ENV_KERNELS, f"qmatmul={mode}")
    monkeypatch.setenv(ENV_FULL_STEP, "0")
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    params = load_params(g, spec, device_blocks=device_blocks)
    runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), params, n_slots=1, ctx=32)
    prefill = np.asarray(runner.prefill(0, PROMPT, 0, all_logits=True))
    steps = [np.asarray(runner.decode([0], [t], [len(PROMPT) + i]))[0] for i, t in enumerate(STEPS)]
    return prefill, np.stack(steps), params


def err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def test_dense_matrices_stay_blocks_and_answer_as_the_cpu_path(mixed, monkeypatch):
    want_prefill, want_steps, _ = run(mixed, monkeypatch, device_blocks=False)
    calls = []
    padded = gpu_qmatmul._padded
    monkeypatch.setattr(gpu_qmatmul, "_padded", lambda *a, **k: calls.append(1) or padded(*a, **k))
    for mode in ("reference", "interpret"):
        jax.clear_caches()
        prefill, steps, params = run(mixed, monkeypatch, device_blocks=True, mode=mode)
        assert err(prefill, want_prefill) <= TOL and err(steps, want_steps) <= TOL, mode
    assert want_steps.std() > 0.5  # not degenerate
    assert calls, "the interpreted kernel never ran"
    l0, l1 = params["layers"]
    types = {k: (m.type.name if isinstance(m, QPlanes) else "dense") for k, m in {**l0, **l1}.items() if k.startswith("w")}
    assert {k: l0[k].type.name for k in ("wk", "wv", "wo", "w_gate", "w_up", "w_down")} == \
        {"wk": "Q4_K", "wv": "Q8_0", "wo": "Q4_K", "w_gate": "Q4_K", "w_up": "Q4_K", "w_down": "Q6_K"}
    assert not isinstance(l0["wq"], QPlanes)  # Q5_0: dense
    assert l1["wo"].type.name == "Q5_K" and l1["w_up"].type.name == "Q4_0", types
    assert params["head"].type.name == "Q8_0" and params["head"].shape == (1, 336, 256)  # tied: looked up by row too
    g = open_gguf(mixed)
    names = [f"blk.{i}.{n}.weight" for i in (0, 1) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                               "ffn_up", "ffn_down")]
    file_bytes = sum(np.asarray(g.tensor_data(n)).nbytes for n in names if n != "blk.0.attn_q.weight")
    held = [m for layer in (l0, l1) for m in layer.values() if isinstance(m, QPlanes)]
    file_bytes += np.asarray(g.tensor_data("token_embd.weight")).nbytes
    held.append(params["head"])
    planes_bytes = sum(m.nbytes for m in held)
    assert sum(m.gguf_nbytes for m in held) == file_bytes and planes_bytes <= 1.03 * file_bytes  # not 4 a weight
    assert params_nbytes(params) > planes_bytes


def test_routed_q4k_experts_go_through_the_grouped_kernel(experts, monkeypatch):
    want_prefill, want_steps, _ = run(experts, monkeypatch, device_blocks=False)
    calls = []
    grouped = gpu_qmatmul.grouped_qmatmul
    monkeypatch.setattr(gpu_qmatmul, "grouped_qmatmul", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    jax.clear_caches()
    prefill, steps, params = run(experts, monkeypatch, device_blocks=True, mode="interpret")
    assert err(prefill, want_prefill) <= TOL and err(steps, want_steps) <= TOL
    assert calls, "the grouped kernel never ran"
    for layer, down in zip(params["layers"], ("Q4_K", "Q6_K")):
        assert [layer[k].type.name for k in ("exp_gate", "exp_up", "exp_down")] == ["Q4_K", "Q4_K", down]
        assert layer["exp_gate"].shape == (4, 256, 256)


@pytest.mark.parametrize("t", [1, 64], ids=["decode", "prefill"])
def test_block_with_blocks_lowers_for_cuda(mixed, t):
    """A layer program over QPlanes weights, kernels chosen as on CUDA: the attention kernel and a
    Triton quantized product per distinct QPlanes matrix shape and type (wk, wv, wo, w_gate and w_up
    — one program for the two —, w_down; its Q5_0 wq is dense)."""
    import jax.numpy as jnp

    from pantheon.model import kernels as kern
    from pantheon.model import llama
    from pantheon.model.numerics import Numerics
    from pantheon.pallas import dispatch
    from pantheon.pallas.lowering import lower_for_cuda, triton_calls

    g = open_gguf(mixed)
    spec = spec_from_gguf(g)
    w = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                               load_params(g, spec, dtype=jnp.bfloat16, device_blocks=True)["layers"][0])
    cache = jax.ShapeDtypeStruct((9, 512, spec.n_head_kv, spec.head_dim), jnp.bfloat16)
    b = 4 if t == 1 else 1
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    kernels = ((kern.attention_kernel(t), "pallas"),)
    with dispatch.lowering_for("cuda"):
        text = lower_for_cuda(lambda *a: llama.block(*a, spec=spec, numerics=Numerics("exact"), kv_len=512,
                                                     kernels=kernels),
                              w, (cache, cache), jax.ShapeDtypeStruct((b, t, spec.n_embd), jnp.float32), i32(b, t), i32(b),
                              i32(b))
    assert text is None or triton_calls(text) >= 6


def test_admission_charges_what_one_gpu_holds(mixed, monkeypatch):
    """On a GPU the estimate counts the planes' bytes for the matrices the kernel reads (and bf16
    for the rest): what load_params places, within 2 %; a mesh of dies still expands them."""
    import jax.numpy as jnp

    from pantheon.engine.pool import estimate_device_bytes

    g = open_gguf(mixed)
    actual = params_nbytes(load_params(g, spec_from_gguf(g), dtype=jnp.bfloat16, device_blocks=True))
    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    per_slot = estimate_device_bytes(str(mixed), 64, 1) - estimate_device_bytes(str(mixed), 64, 0)
    weights = estimate_device_bytes(str(mixed), 64, 0) - per_slot
    assert abs(weights - actual) <= 0.02 * actual, (weights, actual)
    assert estimate_device_bytes(str(mixed), 64, 0, mesh=True) - per_slot > 1.5 * weights


def test_an_untied_head_and_embedding_stay_blocks(untied, monkeypatch):
    want_prefill, want_steps, _ = run(untied, monkeypatch, device_blocks=False)
    prefill, steps, params = run(untied, monkeypatch, device_blocks=True, mode="interpret")
    assert err(prefill, want_prefill) <= TOL and err(steps, want_steps) <= TOL
    assert params["head"].type.name == "Q6_K" and params["embed"].type.name == "Q4_0"


def test_a_bf16_load_multiplies_bf16_activations(mixed, monkeypatch):
    """On a GPU the activations enter the product in the compute dtype (bf16), as the dense bf16
    path's did; the result stays f32 and within bf16 rounding of the f32 product."""
    import jax.numpy as jnp

    from pantheon.model.layers import linear

    monkeypatch.setenv(ENV_KERNELS, "qmatmul=interpret")
    g = open_gguf(mixed)
    w = load_params(g, spec_from_gguf(g), dtype=jnp.bfloat16, device_blocks=True)["layers"][0]["w_gate"]
    assert w.compute == "bfloat16"
    seen = []
    padded = gpu_qmatmul._padded
    monkeypatch.setattr(gpu_qmatmul, "_padded", lambda x, *a, **k: seen.append(x.dtype) or padded(x, *a, **k))
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    got = np.asarray(linear(jnp.asarray(x), w))
    want = x.astype(np.float64) @ np.asarray(gpu_qmatmul.dequantize_planes(w))[0].T.astype(np.float64)
    assert got.dtype == np.float32 and seen == [jnp.bfloat16]
    assert err(got, want) <= 2e-2 * np.abs(want).max()


def test_phi3_fused_projections_split_into_blocks(tmp_path, monkeypatch):
    """phi3 files fuse q/k/v and gate/up: the loader splits the planes' rows (a part whose rows do
    not tile by 16 becomes dense) and the model answers as the CPU path."""
    path = write_tiny_llama(tmp_path / "phi3.gguf", arch="phi3", n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            weight_type=Q.Q8_0, seed=9, extra_tokens=("<|end|>", "<s>", "</s>", "<unk>", *PAD_TOKENS[:11]))
    want_prefill, want_steps, _ = run(path, monkeypatch, device_blocks=False)
    prefill, steps, params = run(path, monkeypatch, device_blocks=True, mode="interpret")
    assert err(prefill, want_prefill) <= TOL and err(steps, want_steps) <= TOL
    layer = params["layers"][0]
    assert all(isinstance(layer[k], QPlanes) for k in ("wq", "wk", "wv", "w_gate", "w_up"))
