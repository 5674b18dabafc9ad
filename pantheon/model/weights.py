"""GGUF tensors -> a params pytree of device arrays.

CPU path: every matrix is dequantized to float32 at load. XLA:CPU decode is bandwidth-bound and no
int8/bf16 formulation streams faster there (research/jax_feasibility.md §4), so f32 is both the
fastest and the most exact choice. Layer matrices are stored [in, out] (x @ W), which XLA:CPU's
GEMV streams faster than x @ W^T; `params["layers"]` is a list with one dict per layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.gguf.quants import dequantize_np
from pantheon.gguf.reader import GGUFFile
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pantheon.model.numerics import Numerics, scheme_for
from pantheon.model.sharding import check_divisible, layer_spec
from pantheon.model.spec import ModelSpec

# params key -> GGUF tensor name (in layer 0) whose type decides the activation rounding.
_NUMERICS_SOURCES = {"wq": "blk.0.attn_q.weight", "wk": "blk.0.attn_k.weight", "wv": "blk.0.attn_v.weight",
                     "wo": "blk.0.attn_output.weight", "w_gate": "blk.0.ffn_gate.weight",
                     "w_up": "blk.0.ffn_up.weight", "w_down": "blk.0.ffn_down.weight"}


def load_tensor(g: GGUFFile, name: str) -> np.ndarray:
    """One tensor as float32 numpy, in numpy (PyTorch) shape."""
    info = g.tensor_info(name)
    out = dequantize_np(g.tensor_data(name), info.ggml_type)
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def _layer_tensors(g: GGUFFile, spec: ModelSpec, i: int) -> dict[str, np.ndarray]:
    p = f"blk.{i}."
    t = {"attn_norm": load_tensor(g, p + "attn_norm.weight"), "ffn_norm": load_tensor(g, p + "ffn_norm.weight"),
         "wo": load_tensor(g, p + "attn_output.weight"), "w_down": load_tensor(g, p + "ffn_down.weight")}
    if spec.arch == "phi3":  # fused projections: split them so one block function serves all
        qkv = load_tensor(g, p + "attn_qkv.weight")
        q_rows = spec.n_head * spec.head_dim
        t["wq"], t["wk"], t["wv"] = np.split(qkv, [q_rows, q_rows + spec.kv_dim])
        t["w_gate"], t["w_up"] = np.split(load_tensor(g, p + "ffn_up.weight"), 2)
    else:
        for key, name in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
                          ("w_gate", "ffn_gate"), ("w_up", "ffn_up")):
            t[key] = load_tensor(g, p + name + ".weight")
    if spec.qk_norm:
        t["q_norm"] = load_tensor(g, p + "attn_q_norm.weight")
        t["k_norm"] = load_tensor(g, p + "attn_k_norm.weight")
    if p + "attn_q.bias" in g.tensors:
        for key, name in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
            t[key] = load_tensor(g, p + name + ".bias")
    return t


def load_params(g: GGUFFile, spec: ModelSpec, dtype=jnp.float32, device=None) -> dict:
    """The params pytree for `pantheon.model.llama.forward`. `device`: None (the default device),
    a Device, or a Mesh — then layer matrices are split over its dies (see sharding.py). Arrays go
    to the device straight from host numpy (resharding a device array costs a compile)."""
    layers = [{k: (a.T if a.ndim == 2 else a) for k, a in _layer_tensors(g, spec, i).items()}
              for i in range(spec.n_layer)]
    if not isinstance(device, Mesh):  # a mesh splits q/k/v and gate/up by heads and columns: kept apart
        numerics = numerics_for(g, spec)
        layers = [fuse_projections(w, numerics) for w in layers]
    # The head is stored [E, V] (x @ W streams ~20% faster than against [V, E] on XLA:CPU); a tied
    # embedding is that same array, looked up by column (llama.embed), so it is held once.
    table = load_tensor(g, "token_embd.weight")
    params = {"head": (table if spec.tied_embeddings else load_tensor(g, "output.weight")).T,
              "output_norm": load_tensor(g, "output_norm.weight"), "layers": layers}
    if not spec.tied_embeddings:
        params["embed"] = table
    host = lambda a: np.ascontiguousarray(a.astype(dtype) if a.ndim > 1 else a)
    if not isinstance(device, Mesh):
        return jax.tree_util.tree_map(lambda a: jax.device_put(host(a), device), params)
    check_divisible(spec, device.size)
    placed = lambda a, pspec: jax.device_put(host(a), NamedSharding(device, pspec))
    out = {k: placed(v, PartitionSpec()) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: placed(a, layer_spec(k)) for k, a in layer.items()} for layer in params["layers"]]
    return out


# Matrices that read the same input, concatenated along their outputs into one [in, sum(out)] matrix:
# on XLA:CPU one wider GEMV streams its weights faster than three narrow ones (a SmolLM2 batch-1
# decode step: 27 -> 20 ms of matrix time); the model splits the product (llama._project, _tail).
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(w: dict, numerics: Numerics) -> dict:
    """One layer's matrices with FUSED groups concatenated, where the group shares one activation
    rounding scheme (llamacpp numerics rounds each input per weight type)."""
    w = dict(w)
    for fused, parts in FUSED.items():
        if len({numerics.scheme(p) for p in parts}) == 1:
            w[fused] = np.concatenate([w.pop(p) for p in parts], axis=1)
    return w


def params_nbytes(params) -> int:
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(params))


def numerics_for(g: GGUFFile, spec: ModelSpec, mode: str = "llamacpp") -> Numerics:
    """Activation rounding per weight, from the GGUF tensor types (see numerics.py)."""
    if mode not in ("llamacpp", "exact"):
        raise ValueError(f"unknown numerics mode {mode!r} (llamacpp or exact)")
    sources = dict(_NUMERICS_SOURCES)
    if spec.arch == "phi3":
        sources.update(wq="blk.0.attn_qkv.weight", wk="blk.0.attn_qkv.weight", wv="blk.0.attn_qkv.weight",
                       w_gate="blk.0.ffn_up.weight")
    sources["head"] = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    schemes = tuple((k, scheme_for(g.tensor_info(name).ggml_type)) for k, name in sorted(sources.items()))
    return Numerics(mode, schemes)
