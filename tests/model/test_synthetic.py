"""Random-weight params at real shapes (pantheon/model/synthetic.py) have exactly the structure,
shapes and dtypes the loaders give a GGUF of the same spec — so the GPU check's in-memory 35B-A3B
model runs the very programs a loaded file runs — and they decode to finite, non-degenerate logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model import qwen35moe, synthetic, weights
from pantheon.model.numerics import Numerics
from pantheon.model.spec import spec_from_gguf
from tests.fixtures.tiny_models import write_tiny_llama
from tests.fixtures.tiny_qwen35moe import Q3K_SHAPES, Q, write_tiny_qwen35moe


def layout(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves]


def test_hybrid_params_match_the_loader(tmp_path):
    path = write_tiny_qwen35moe(tmp_path / "q.gguf", expert_type=Q.Q3_K, fused_gate_up=True, n_layer=4,
                                full_attention_interval=2, d_state=32, **Q3K_SHAPES)
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    for dtype in (jnp.float32, jnp.bfloat16):
        loaded = qwen35moe.load_params(g, spec, dtype=dtype)
        assert layout(synthetic.hybrid_params(spec, dtype)) == layout(loaded)


def test_dense_params_match_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("PANTHEON_NATIVE", "0")  # the f32 CPU path adds decode blocks; compare the rest
    g = open_gguf(write_tiny_llama(tmp_path / "l.gguf", weight_type=Q.F32))
    spec = spec_from_gguf(g)
    loaded = weights.load_params(g, spec, dtype=jnp.bfloat16)
    assert layout(synthetic.dense_params(spec, jnp.bfloat16)) == layout(loaded)


def test_real_shaped_specs_and_a_scaled_down_decode():
    big = synthetic.qwen35_35b_a3b()
    assert (big.n_layer, sum(not r for r in big.recurrent), big.conv_dim) == (40, 10, 8192)
    shapes = jax.eval_shape(lambda: synthetic.hybrid_params(big))  # no memory: abstract arrays
    n = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(shapes))
    assert 14e9 < n < 22e9  # ~14 GB of Q3_K experts + bf16 rest
    small = synthetic.scaled_down(big)
    runner = ModelRunner(small, Numerics("exact"), synthetic.hybrid_params(small, jnp.float32), n_slots=2, ctx=64)
    logits = np.asarray(runner.prefill(0, list(range(1, 20)), 0))
    assert np.isfinite(logits).all() and logits.std() > 0.1
    step = np.asarray(runner.decode([0], [int(logits.argmax())], [19]))[0]
    assert np.isfinite(step).all() and step.std() > 0.1
