"""Random-weight models at real shapes, built in memory on the device: no file to read.

The GPU check (profiles/gpu_check.py) decodes a Qwen3.5-35B-A3B-shaped model through the runner
without a 15 GB GGUF, and lowers its programs for CUDA from abstract shapes (`jax.eval_shape` of
`hybrid_params`) on a CPU. The params pytrees have exactly the structure, shapes and dtypes the
loaders produce (qwen35moe.load_params, weights.load_params: tests/model/test_synthetic.py
compares them): matrices [in, out] in the compute dtype, 1-D tensors and qwen35moe._KEEP_F32 in
f32, routed experts as Q3KPlanes with random quants and small fp16 scales."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pantheon.model.spec import ROPE_NORM, HybridSpec, ModelSpec
from pantheon.pallas.moe_q3k import QK, Q3KPlanes


def qwen35_35b_a3b(n_layer: int = 40) -> HybridSpec:
    """Qwen3.5-35B-A3B's shapes: hidden 2048, 256 experts (8 used) of 512, shared expert 512, full
    attention every 4th layer (16 query / 2 kv heads of 256), Gated DeltaNet with 16 key / 32
    value heads of 128, vocabulary 248320."""
    return HybridSpec(arch="qwen35moe", n_layer=n_layer, n_embd=2048, n_vocab=248320, ctx_train=262144, rms_eps=1e-6,
                      tied_embeddings=False, recurrent=tuple((i + 1) % 4 != 0 for i in range(n_layer)), n_head=16,
                      n_head_kv=2, head_dim=256, rope_dim=64, rope_base=1e7, rope_sections=(11, 11, 10, 0),
                      n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, ssm_d_conv=4, ssm_d_state=128,
                      ssm_n_group=16, ssm_dt_rank=32)


def scaled_down(spec: HybridSpec | ModelSpec) -> HybridSpec | ModelSpec:
    """The same architecture at a few-MB size (4 or 2 layers, small widths): for checking code
    paths on a CPU, where the real shapes would take minutes."""
    if isinstance(spec, HybridSpec):
        return dataclasses.replace(spec, n_layer=4, recurrent=(True, True, True, False), n_vocab=512, n_embd=256,
                                   n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=128, ssm_n_group=2,
                                   ssm_dt_rank=4, ssm_d_state=32, n_head=4, head_dim=64, rope_dim=16)
    return dataclasses.replace(spec, n_layer=2, n_vocab=512, n_embd=128, n_head=2, n_head_kv=1, n_ff=256)


def smollm2_135m() -> ModelSpec:
    return ModelSpec(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                     n_vocab=49152, ctx_train=8192, rope_base=100000.0, rope_dim=64, rope_style=ROPE_NORM,
                     rms_eps=1e-5, tied_embeddings=True)


class _Draw:
    """Fresh keys from one seed; normal matrices scaled 1/sqrt(fan-in) so activations stay O(1)."""

    def __init__(self, seed: int, dtype):
        self.key, self.dtype = jax.random.PRNGKey(seed), dtype

    def _next(self):
        self.key, k = jax.random.split(self.key)
        return k

    def matrix(self, n_in: int, n_out: int, dtype=None, scale: float | None = None):
        scale = n_in ** -0.5 if scale is None else scale
        return (jax.random.normal(self._next(), (n_in, n_out), jnp.float32) * scale).astype(dtype or self.dtype)

    def vector(self, n: int, scale: float = 0.1, offset: float = 1.0):
        return offset + scale * jax.random.normal(self._next(), (n,), jnp.float32)

    def planes(self, e: int, n_out: int, n_in: int) -> Q3KPlanes:
        """Q3_K experts [e, n_out, n_in]: random 2-bit quants, high bits and 6-bit scales; fp16 block
        scales ~1/(32 sqrt(n_in)) so a row's dot stays O(1) (a Q3_K weight is d * scale * q)."""
        nb = n_in // QK
        bits = lambda last: jax.random.bits(self._next(), (e, n_out, nb * last), jnp.uint8)  # noqa: E731
        d = jnp.full((e, n_out, nb), n_in ** -0.5 / 32, jnp.float16)
        return Q3KPlanes(bits(64), bits(32), bits(16), d)


def hybrid_params(spec: HybridSpec, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """qwen35moe params with Q3_K experts (fused gate_up planes), as qwen35moe.load_params lays them out."""
    r = _Draw(seed, dtype)
    e, x, f, fs = spec.n_embd, spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
    layers = []
    for i in range(spec.n_layer):
        w = {"attn_norm": r.vector(e), "post_norm": r.vector(e), "router": r.matrix(e, x, jnp.float32),
             "exp_gate_up": r.planes(x, 2 * f, e), "exp_down": r.planes(x, e, f),
             "sh_gate": r.matrix(e, fs), "sh_up": r.matrix(e, fs), "sh_down": r.matrix(fs, e),
             "sh_gate_inp": r.vector(e, 1.0, 0.0) * e ** -0.5}
        if spec.recurrent[i]:
            hv = spec.ssm_dt_rank
            w.update(w_qkv=r.matrix(e, spec.conv_dim), w_z=r.matrix(e, spec.value_dim), w_beta=r.matrix(e, hv),
                     w_alpha=r.matrix(e, hv), conv=r.matrix(spec.ssm_d_conv, spec.conv_dim, jnp.float32),
                     dt_bias=r.vector(hv, 0.5, 0.0), a=-jnp.exp(r.vector(hv, 0.5, 0.0)),
                     ssm_norm=r.vector(spec.ssm_d_state), w_out=r.matrix(spec.value_dim, e))
        else:
            d = spec.head_dim
            w.update(wq=r.matrix(e, spec.n_head * 2 * d), wk=r.matrix(e, spec.kv_dim), wv=r.matrix(e, spec.kv_dim),
                     q_norm=r.vector(d), k_norm=r.vector(d), wo=r.matrix(spec.n_head * d, e))
        layers.append(w)
    params = {"embed": r.matrix(spec.n_vocab, e, scale=1.0),
              "output_norm": r.vector(e), "layers": layers}
    if not spec.tied_embeddings:
        params["output"] = r.matrix(spec.n_vocab, e)
    return params


def dense_params(spec: ModelSpec, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """llama-family params (fused wqkv and w_gate_up, as weights.load_params on one die)."""
    r = _Draw(seed, dtype)
    e, d = spec.n_embd, spec.head_dim
    layers = [{"attn_norm": r.vector(e), "ffn_norm": r.vector(e),
               "wqkv": r.matrix(e, (spec.n_head + 2 * spec.n_head_kv) * d), "wo": r.matrix(spec.n_head * d, e),
               "w_gate_up": r.matrix(e, 2 * spec.n_ff), "w_down": r.matrix(spec.n_ff, e)}
              for _ in range(spec.n_layer)]
    head = r.matrix(e, spec.n_vocab)
    params = {"head": head, "output_norm": r.vector(e), "layers": layers}
    if not spec.tied_embeddings:
        params["embed"] = r.matrix(spec.n_vocab, e, scale=1.0)
    return params


def abstract(tree):
    """The ShapeDtypeStructs of a params pytree (for lowering without the arrays)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

