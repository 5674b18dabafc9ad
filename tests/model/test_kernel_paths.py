"""The models call the Pallas kernels through pantheon.pallas.dispatch (model/kernels.py).

* PANTHEON_KERNELS=interpret runs a tiny llama and a tiny qwen35moe with Q3_K experts through the
  interpreted kernels (flash prefill, in-place decode attention, grouped Q3_K MoE), and their
  prefill + decode logits equal the reference path's; spies on the kernel functions and the
  programs' static `kernels` show the kernels really ran.
* Q3_K experts stay Q3_K blocks on the device: the params of the Q3_K-experts reference file take
  the GGUF bytes of its experts + 3.6% (Q3KPlanes), not 4 bytes per weight.
* the planes path and the float32 path of the same Q3_K model agree (one routing function).
* the model programs, with every kernel forced to "pallas", lower for CUDA (Triton) at serving
  shapes (odd slot count, 4k context), without a GPU.

Measured (2 shared CPU cores): interpret vs reference max |Δ| 6e-6 / 8e-6 (llama prefill / decode), 7e-6 / 6e-6
(qwen35moe Q3_K);
this file runs in ~25 s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.engine.graphs import GraphRegistry
from pantheon.config import ENV_FULL_STEP, ENV_KERNELS
from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model import kernels as kern
from pantheon.model import llama, qwen35moe
from pantheon.model.family import family_of
from pantheon.model.numerics import Numerics
from pantheon.model.spec import spec_from_gguf
from pantheon.model.step import StepInputs
from pantheon.model.weights import params_nbytes
from pantheon.pallas import attention, moe, moe_q3k
from pantheon.pallas.moe_q3k import PLANE_BYTES, Q3KPlanes
from tests.fixtures.tiny_models import write_tiny_llama
from tests.fixtures.tiny_qwen35moe import Q3K_SHAPES, Q, write_tiny_qwen35moe
from pantheon.pallas.lowering import lower_for_cuda
from tests.pallas.test_lowering import _assert_triton

TOL = 1e-4
CTX = 32  # >= 16: the decode kernel's smallest cache
PROMPTS = ([1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108], [1, 200, 31, 7, 250, 99, 14, 5, 300])
STEPS = ([40, 41, 42, 43], [310, 3, 77, 120])
_GATE_UP = "exp_gate_up"  # the params key of fused Q3_K gate_up planes


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("kp") / "llama.gguf", weight_type=Q.F32)


@pytest.fixture(scope="module")
def tiny_q3k(tmp_path_factory):
    """2 layers (DeltaNet + attention), 4 experts top-2, Q3_K experts (256 wide), head_dim 16,
    DeltaNet state 32 (the smallest the DeltaNet kernel runs)."""
    return write_tiny_qwen35moe(tmp_path_factory.mktemp("kp") / "q35.gguf", expert_type=Q.Q3_K, seed=3, n_layer=2,
                                full_attention_interval=2, d_state=32, **Q3K_SHAPES)


class Spy:
    """Counts Python calls of module functions (i.e. traces that reach them)."""

    def __init__(self, monkeypatch, targets):
        self.counts = {}
        for module, name in targets:
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return spy


def run_model(path, monkeypatch, mode: str):
    """Prefill PROMPTS into slots 0 and 1 (all logits), then decode STEPS in one batch, under
    PANTHEON_KERNELS=mode. Returns (prefill logits, decode logits [steps, 2, V], {program: kernels})."""
    monkeypatch.setenv(ENV_KERNELS, mode)
    # the per-layer programs, whose static `kernels` the registry sees (the full-step program
    # inlines them: tests/engine/test_full_step.py compares the two)
    monkeypatch.setenv(ENV_FULL_STEP, "0")
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    registry = GraphRegistry()
    seen = {}
    plain_call = registry.call

    def call(key, fn, args, static=None):
        if static and "kernels" in static:
            seen.setdefault(key.program, set()).add(static["kernels"])
        return plain_call(key, fn, args, static)

    registry.call = call
    runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec), n_slots=2, ctx=CTX,
                         registry=registry)
    prefill = [np.asarray(runner.prefill(s, p, 0, all_logits=True)) for s, p in enumerate(PROMPTS)]
    steps = []
    for i, toks in enumerate(zip(*STEPS)):
        logits = runner.decode([0, 1], list(toks), [len(p) + i for p in PROMPTS])
        steps.append(np.asarray(logits)[:2])
    return prefill, np.stack(steps), seen


def max_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def compare(path, monkeypatch, kernel_targets):
    ref_prefill, ref_steps, ref_seen = run_model(path, monkeypatch, "reference")
    jax.clear_caches()  # so the spies see the kernels' traces
    spy = Spy(monkeypatch, kernel_targets)
    got_prefill, got_steps, seen = run_model(path, monkeypatch, "interpret")
    for a, b in zip(got_prefill, ref_prefill):
        assert max_err(a, b) <= TOL
    assert max_err(got_steps, ref_steps) <= TOL
    assert ref_steps.std() > 1.0  # not degenerate
    return spy.counts, seen, ref_seen


def test_tiny_llama_interpreted_kernels_equal_reference(tiny_llama, monkeypatch):
    counts, seen, ref_seen = compare(tiny_llama, monkeypatch, [(attention, "flash_attention"),
                                                               (attention, "decode_attention")])
    assert counts.get("flash_attention", 0) >= 1 and counts.get("decode_attention", 0) >= 1
    assert seen["block"] == {(("attention_prefill", "interpret"),), (("attention_decode", "interpret"),)}
    assert ref_seen["block"] == {(("attention_prefill", "reference"),), (("attention_decode", "reference"),)}


def test_tiny_qwen35moe_q3k_interpreted_kernels_equal_reference(tiny_q3k, monkeypatch):
    counts, seen, ref_seen = compare(tiny_q3k, monkeypatch, [(attention, "flash_attention"),
                                                             (attention, "decode_attention"),
                                                             (moe_q3k, "gmm_padded")])
    assert counts.get("flash_attention", 0) >= 1 and counts.get("decode_attention", 0) >= 1
    assert counts.get("gmm_padded", 0) >= 3 * 2  # gate, up, down x prefill/decode (both layer kinds share a trace)
    assert seen["attn_block"] == {(("attention_prefill", "interpret"), ("moe_q3k", "interpret")),
                                  (("attention_decode", "interpret"), ("moe_q3k", "interpret"))}
    assert seen["ssm_block"] == {(("deltanet", "interpret"), ("moe_q3k", "interpret"))}
    assert ref_seen["ssm_block"] == {(("deltanet", "reference"), ("moe_q3k", "reference"))}


def test_kernel_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_KERNELS, "attention_decode=interpret")
    assert kern.choose({"attention_decode": True, "moe_q3k": True}) == (("attention_decode", "interpret"),
                                                                         ("moe_q3k", "reference"))
    # shapes a kernel cannot run are recorded (and run) as the reference
    assert kern.choose({"attention_decode": False}) == (("attention_decode", "reference"),)
    assert not kern.attention_supported("attention_prefill", 96, (3, 64, 2, 96))  # phi3's head_dim
    assert not kern.attention_supported("attention_decode", 64, (3, 8, 2, 64))  # cache under 16
    assert kern.attention_supported("attention_decode", 256, (9, 4096, 2, 256))
    # the in-place decode kernel does not depend on kv_len: its programs share one trace per cache
    assert kern.program_kv_len((("attention_decode", "interpret"),), 128, 4096) == 4096
    # so does the blocked jnp path (reference mode), for prefill and decode alike; only the flash
    # prefill kernel is traced per kv_len bucket
    assert kern.program_kv_len((("attention_decode", "reference"),), 128, 4096) == 4096
    assert kern.program_kv_len((("attention_prefill", "reference"),), 128, 4096) == 4096
    assert kern.program_kv_len((("attention_prefill", "interpret"),), 128, 4096) == 128
    assert kern.program_kv_len((("attention_prefill", "pallas"),), 128, 4096) == 128


# ---- Q3_K experts as planes ----------------------------------------------------------------------------
def test_q3k_experts_take_the_gguf_bytes_on_the_device(qwen35moe_q3k_experts_gguf):
    g = open_gguf(qwen35moe_q3k_experts_gguf)
    spec = spec_from_gguf(g)
    params = qwen35moe.load_params(g, spec)
    expert_names = [n for n in g.tensors if "_exps." in n]
    assert len(expert_names) == 3 * spec.n_layer
    assert all(g.tensor_info(n).ggml_type == Q.Q3_K for n in expert_names)
    file_bytes = sum(g.tensor_data(n).nbytes for n in expert_names)
    planes = [p for w in params["layers"] for p in w.values() if isinstance(p, Q3KPlanes)]
    assert len(planes) == 3 * spec.n_layer
    assert all(isinstance(a, jax.Array) for p in planes for a in jax.tree_util.tree_leaves(p))
    device_bytes = sum(p.nbytes for p in planes)
    assert device_bytes == file_bytes * PLANE_BYTES // 110  # +3.6%: the 12 scale bytes padded to 16
    # everything else in this file is F32 and stays so: the whole params are the file's tensor bytes + padding
    all_file = sum(g.tensor_data(n).nbytes for n in g.tensors)
    assert params_nbytes(params) == all_file + device_bytes - file_bytes
    # the float32 experts this replaces: 4 bytes per weight
    assert file_bytes * 4 * 256 // 110 == sum(int(np.prod(p.shape)) * 4 for p in planes)


def test_q3k_expert_roles_become_planes(qwen35moe_q3k_experts_gguf, qwen35moe_f32_gguf, qwen35moe_q3_k_m_gguf):
    both, gate_up = {qwen35moe.GATE_UP, qwen35moe.DOWN}, {qwen35moe.GATE_UP}
    for path, want in ((qwen35moe_q3k_experts_gguf, both), (qwen35moe_f32_gguf, set()),
                       (qwen35moe_q3_k_m_gguf, gate_up)):  # q3_k_m: Q3_K gate/up, Q4_K down
        g = open_gguf(path)
        assert qwen35moe.q3k_experts(g, spec_from_gguf(g)) == want, path.name
    Q3, Q4 = Q.Q3_K, Q.Q4_K
    roles = qwen35moe.q3k_expert_roles
    assert roles([("gate_up", Q3), ("down", Q3), ("gate_up", Q3), ("down", Q4)]) == gate_up  # one down layer off
    assert roles([("gate_up", Q3), ("gate_up", Q4), ("down", Q3)]) == set()  # no kernel entry without gate/up
    assert roles([]) == set()


def test_planes_path_equals_float32_path(tiny_q3k, tmp_path, monkeypatch):
    """The same Q3_K model with its experts as planes (dispatch.moe_ffn, reference), dequantized
    to float32 (layers.grouped_experts), and with planes for gate/up only and a float32 down: one routing
    function (moe.route, SPEC §5) serves all; a fused gate_up file gives the same logits."""
    assert qwen35moe.route is moe.route and not hasattr(qwen35moe, "_route")
    monkeypatch.setenv(ENV_KERNELS, "reference")
    fused = write_tiny_qwen35moe(tmp_path / "fused.gguf", expert_type=Q.Q3_K, seed=3, n_layer=2,
                                 full_attention_interval=2, fused_gate_up=True, d_state=32, **Q3K_SHAPES)

    def logits(path, planes=True, roles=None):
        g = open_gguf(path)
        spec = spec_from_gguf(g)
        with monkeypatch.context() as m:
            if not planes or roles is not None:
                m.setattr(qwen35moe, "q3k_experts", lambda g, spec: frozenset(roles or ()))
            params = qwen35moe.load_params(g, spec)
        assert isinstance(params["layers"][0]["exp_down"], Q3KPlanes) is (planes and roles is None)
        state = qwen35moe.allocate_state(spec, n_slots=1, ctx=CTX)
        toks = np.array([PROMPTS[0] + [0] * 4], np.int32)
        inputs = StepInputs(toks, np.arange(16, dtype=np.int32)[None], np.zeros(1, np.int32),
                            np.array([len(PROMPTS[0]) - 1], np.int32))
        out, _ = qwen35moe.forward(params, state, inputs, spec=spec, numerics=Numerics("exact"), kv_len=CTX,
                                   all_logits=True)
        return np.asarray(out)[0, :len(PROMPTS[0])], params

    planes, params = logits(tiny_q3k)
    assert _GATE_UP not in params["layers"][0]
    dense, _ = logits(tiny_q3k, planes=False)
    fused_logits, fused_params = logits(fused)
    assert isinstance(fused_params["layers"][0][_GATE_UP], Q3KPlanes) and "exp_gate" not in fused_params["layers"][0]
    assert planes.std() > 1.0
    assert max_err(planes, dense) <= TOL
    assert max_err(fused_logits, planes) <= 1e-5
    # gate/up planes through the kernel entry, down dense (a Q3_K_M-style mix)
    mixed, mixed_params = logits(tiny_q3k, roles={qwen35moe.GATE_UP})
    assert isinstance(mixed_params["layers"][0]["exp_gate"], Q3KPlanes)
    assert max_err(mixed, planes) <= TOL



# ---- lowering for CUDA --------------------------------------------------------------------------------------
PALLAS_SLOTS, PALLAS_CTX = 8, 4096  # 9 cache rows (8 slots + scratch)


def _lower(fn, *args, n_kernels: int):
    _assert_triton(lower_for_cuda(fn, *args), n_kernels)


@pytest.mark.parametrize("t", [1, 64], ids=["decode", "prefill"])
def test_llama_block_lowers_with_pallas_kernels(tiny_llama, t):
    g = open_gguf(tiny_llama)
    spec = spec_from_gguf(g)
    w = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                               family_of(spec).load_params(g, spec)["layers"][0])
    cache = jax.ShapeDtypeStruct((PALLAS_SLOTS + 1, PALLAS_CTX, spec.n_head_kv, spec.head_dim), jnp.float32)
    b = 4 if t == 1 else 1
    x = jax.ShapeDtypeStruct((b, t, spec.n_embd), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    kernels = ((kern.attention_kernel(t), "pallas"),)
    _lower(lambda *a: llama.block(*a, spec=spec, numerics=Numerics("exact"), kv_len=512, kernels=kernels),
           w, (cache, cache), x, i32(b, t), i32(b), i32(b), n_kernels=1)


@pytest.mark.parametrize("t", [1, 64], ids=["decode", "prefill"])
def test_qwen35moe_blocks_lower_with_pallas_kernels(qwen35moe_q3k_experts_gguf, t):
    g = open_gguf(qwen35moe_q3k_experts_gguf)
    spec = spec_from_gguf(g)
    params = qwen35moe.load_params(g, spec)
    shapes = lambda tree: jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    state = jax.eval_shape(lambda: qwen35moe.allocate_state(spec, n_slots=PALLAS_SLOTS, ctx=PALLAS_CTX))
    b = 4 if t == 1 else 1
    x = jax.ShapeDtypeStruct((b, t, spec.n_embd), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    num = Numerics("exact")
    attn_kernels = tuple(sorted([(kern.attention_kernel(t), "pallas"), ("moe_q3k", "pallas")]))
    attn_w = shapes(params["layers"][spec.attention_layers[0]])
    _lower(lambda *a: qwen35moe.attn_block(*a, spec=spec, numerics=num, kv_len=512, kernels=attn_kernels),
           attn_w, state.k[0], state.v[0], x, i32(b, t), i32(b), n_kernels=4)  # attention + 3 grouped matmuls
    ssm_w = shapes(params["layers"][spec.recurrent_layers[0]])
    _lower(lambda *a: qwen35moe.ssm_block(*a, spec=spec, numerics=num, kernels=(("moe_q3k", "pallas"),)),
           ssm_w, state.conv[0], state.ssm[0], x, i32(b, t), i32(b), i32(b), n_kernels=3)
