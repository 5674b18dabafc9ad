"""GGUF tensors -> a params pytree of device arrays.

CPU path (f32, native kernel built): the matrices stay as the file holds them. Every matrix of a
type the native kernel reads (pantheon/native/qmatmul.py: Q8_0, Q4_0/Q4_1 and the K-quants
Q2_K..Q6_K as they are, Q5_0/Q5_1 with each code in a byte) is a QMatrix of its blocks, the only
copy: decode and short prefill chunks read the blocks in the kernel, longer prefill chunks
dequantize one matrix at a time inside the program and run XLA's f32 GEMM (layers.linear). Other
matrices (F32/F16/BF16) are f32, stored [in, out] (x @ W), which XLA:CPU's GEMV streams faster
than x @ W^T. `params["layers"]` is a list with one dict per layer. One GPU (bf16): the layer
matrices and routed experts of the types pantheon/pallas/qmatmul.py reads (Q8_0, Q4_0, Q4_K, Q5_K,
Q6_K) stay in their blocks as QPlanes, the rest in the compute dtype (`_load_planes`). A mesh of
dies: every matrix in the compute dtype (blocks split over dies are not built)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.gguf.quants import dequantize_np
from pantheon.gguf.reader import GGUFFile
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pantheon.gguf.arithmetic import scheme_for
from pantheon.model.numerics import Numerics
from pantheon.native import build as native_build
from pantheon.native import qmatmul as native
from pantheon.pallas import qmatmul as gpu_qmatmul
from pantheon.pallas.dispatch import GPU_BACKENDS
from pantheon.pallas.qmatmul import QPlanes
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


def load_blocks(g: GGUFFile, name: str) -> native.QMatrix | None:
    """A matrix [out, in] as quant blocks (host uint8 [out, row bytes]), where the native kernel
    reads its type (pantheon/native/qmatmul.py), in both numerics modes, as the GGUF holds them;
    else None. Routed experts [X, out, in] come as one QMatrix of blocks [X, out, row bytes]:
    `blocks[e]` is expert e's matrix, read in place by `qmatmul.expert_qmatmul`."""
    info = g.tensor_info(name)
    if len(info.shape) not in (2, 3) or not native.supported(info.ggml_type):
        return None
    rows = info.shape[:-1]
    data = np.asarray(g.tensor_data(name))  # F16/BF16 come typed: the kernel reads their bytes
    return native.QMatrix(data.view(np.uint8).reshape(*rows, -1), int(info.ggml_type), int(info.shape[-1]))


def _split_rows(a, sections: list[int]) -> list:
    """np.split along the output rows, for an f32 matrix or a QMatrix (None stays None)."""
    if a is None:
        return [None] * (len(sections) + 1)
    if isinstance(a, native.QMatrix):
        return [native.QMatrix(b, a.qtype, a.n_in) for b in np.split(a.blocks, sections)]
    if isinstance(a, QPlanes):  # rows split in every plane; a part whose rows do not tile by 16 is dense
        parts = zip(*(np.split(np.asarray(p), sections, axis=1) for p in a.planes))
        return [dataclasses.replace(a, planes=tuple(ps)) if ps[0].shape[1] % 16 == 0
                else np.asarray(gpu_qmatmul.dequantize_planes(dataclasses.replace(a, planes=tuple(ps))))[0] for ps in parts]
    return np.split(a, sections)


def _matrices(g: GGUFFile, spec: ModelSpec, i: int, load) -> dict:
    """One layer's matrices [out, in] as `load(g, name)` gives them (rows split where the GGUF
    fuses them)."""
    p = f"blk.{i}."
    t = {"wo": load(g, p + "attn_output.weight")}
    if spec.n_expert:  # routed experts instead of the FFN: their own tensors (`_layer_tensors`)
        for key, name in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v")):
            t[key] = load(g, p + name + ".weight")
        return t
    t["w_down"] = load(g, p + "ffn_down.weight")
    if spec.arch == "phi3":  # fused projections: split them so one block function serves all
        qkv, up = load(g, p + "attn_qkv.weight"), load(g, p + "ffn_up.weight")
        q_rows = spec.n_head * spec.head_dim
        t["wq"], t["wk"], t["wv"] = _split_rows(qkv, [q_rows, q_rows + spec.kv_dim])
        rows = up.n_out if isinstance(up, QPlanes) else up.shape[0] if up is not None else 0
        t["w_gate"], t["w_up"] = _split_rows(up, [rows // 2])
    else:
        for key, name in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
                          ("w_gate", "ffn_gate"), ("w_up", "ffn_up")):
            t[key] = load(g, p + name + ".weight")
    return t


def _layer_tensors(g: GGUFFile, spec: ModelSpec, i: int, matrices: bool = True,
                   expert_blocks=None) -> dict[str, np.ndarray]:
    """One layer's tensors as f32 numpy (without its matrices when `matrices` is False); routed
    experts as `expert_blocks(g, name)` gives them where it gives them (blocks a kernel reads:
    load_blocks on the CPU, load_planes on a GPU), else f32."""
    p = f"blk.{i}."
    t = {"attn_norm": load_tensor(g, p + "attn_norm.weight"), "ffn_norm": load_tensor(g, p + "ffn_norm.weight"),
         **(_matrices(g, spec, i, load_tensor) if matrices else {})}
    if spec.qk_norm:
        t["q_norm"] = load_tensor(g, p + "attn_q_norm.weight")
        t["k_norm"] = load_tensor(g, p + "attn_k_norm.weight")
    if spec.post_norms:
        t["attn_post_norm"] = load_tensor(g, p + "post_attention_norm.weight")
        t["ffn_post_norm"] = load_tensor(g, p + "post_ffw_norm.weight")
    if spec.n_expert:
        # The router [E, X] (f32: a rounding can swap two close experts) and the experts as f32
        # [X, in, out] for layers.grouped_experts (their blocks are not read by a kernel yet).
        t["router"] = np.ascontiguousarray(load_tensor(g, p + "ffn_gate_inp.weight").T)
        for key, name in (("exp_gate", "ffn_gate_exps"), ("exp_up", "ffn_up_exps"), ("exp_down", "ffn_down_exps")):
            blocks = expert_blocks(g, p + name + ".weight") if expert_blocks else None
            t[key] = blocks if blocks is not None else \
                np.ascontiguousarray(np.swapaxes(load_tensor(g, p + name + ".weight"), 1, 2))
    if p + "attn_q.bias" in g.tensors:
        for key, name in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
            t[key] = load_tensor(g, p + name + ".bias")
    return t


def load_params(g: GGUFFile, spec: ModelSpec, dtype=jnp.float32, device=None, numerics: Numerics | None = None,
                device_blocks: bool | None = None) -> dict:
    """The params pytree for `pantheon.model.llama.forward`. `device`: None (the default device),
    a Device, or a Mesh — then layer matrices are split over its dies (see sharding.py). Arrays go
    to the device straight from host numpy (resharding a device array costs a compile). `numerics`
    is the Family interface's (qwen35moe loads IntBlocks for it); the dense family's products need
    no other weights for it (native kernel, or rounded f32: see model/numerics.py).

    On the CPU in f32 with the native kernel built, every matrix of a type the kernel reads stays
    in its quant blocks and no f32 copy of it exists, ever (`_load_resident`). On one GPU
    (`device_blocks`, default: a GPU backend and no mesh) every layer matrix of a type the Pallas
    kernel reads (pantheon/pallas/qmatmul.py: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) stays in its blocks as
    QPlanes (`_load_planes`); tests set it on the CPU, where the kernel runs interpreted."""
    if device_blocks is None:
        device_blocks = not isinstance(device, Mesh) and jax.default_backend() in GPU_BACKENDS
    if device_blocks:
        return _load_planes(g, spec, dtype, device)
    if not isinstance(device, Mesh) and dtype == jnp.float32 and native_build.available():
        return _load_resident(g, spec, device, numerics)
    layers = [{k: (a.T if a.ndim == 2 and k != "router" else a) for k, a in _layer_tensors(g, spec, i).items()}
              for i in range(spec.n_layer)]
    if not isinstance(device, Mesh):  # a mesh splits q/k/v and gate/up by heads and columns: kept apart
        fusing = numerics_for(g, spec)  # by the file's types, whatever the numerics mode
        layers = [fuse_projections(w, fusing) for w in layers]
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
# (A Q4_K_M file often holds attn_v in another type than attn_q and attn_k: those two still fuse, one
# call a layer fewer — each small native call costs ~15 us beyond its arithmetic.)
FUSED = {"wqkv": ("wq", "wk", "wv"), "wqk": ("wq", "wk"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(w: dict, numerics: Numerics) -> dict:
    """One layer's matrices with FUSED groups concatenated, where the group shares one activation
    rounding scheme (llamacpp numerics rounds each input per weight type) and one form: f32 [in, out]
    along the outputs, or QMatrix blocks of one type along their rows."""
    w = dict(w)
    for fused, parts in FUSED.items():
        got = [w.get(p) for p in parts]
        if any(m is None or isinstance(m, QPlanes) for m in got) or len({numerics.scheme(p) for p in parts}) != 1:
            continue  # (QPlanes stay apart: one kernel call each)
        if all(isinstance(m, native.QMatrix) for m in got):
            if len({(m.qtype, m.n_in) for m in got}) == 1:
                w[fused] = native.QMatrix(np.concatenate([np.asarray(m.blocks) for m in got]), got[0].qtype, got[0].n_in)
                for p in parts:
                    del w[p]
        elif not any(isinstance(m, native.QMatrix) for m in got):
            w[fused] = np.concatenate([w.pop(p) for p in parts], axis=1)
    return w


def _load_resident(g: GGUFFile, spec: ModelSpec, device, numerics: Numerics | None) -> dict:
    """load_params on the CPU with the native kernel: each matrix the kernel reads (its Q8_0,
    4/5-bit and K-quant types) is a QMatrix of the file's blocks, read by the kernel for decode and
    short prefill chunks (and, with llamacpp numerics, for every chunk: its integer dot products
    over 8-bit activations are llama.cpp's arithmetic) and dequantized inside the program, one
    matrix at a time, for longer exact ones (layers.linear). Other matrices are f32 [in, out].
    Loaded and placed layer by layer, so the host holds one layer's arrays at a time."""
    fusing = numerics_for(g, spec)  # by the file's types, whatever the numerics mode
    blocks_or_f32 = lambda g, name: load_blocks(g, name) or load_tensor(g, name)  # noqa: E731
    put = lambda tree: jax.device_put(tree, device)  # noqa: E731
    # Long rows' K-quant blocks K-tile-major for the fixed-point kernel (exact numerics; qmatmul.tile_k)
    tiling = numerics is not None and numerics.mode == "exact" and native_build.fixed_point()
    tiled = lambda m: native.tile_k(m) if tiling and native.tiles(m) else m  # noqa: E731
    layers = []
    for i in range(spec.n_layer):
        mats = {k: m if isinstance(m, native.QMatrix) else np.ascontiguousarray(m.T)
                for k, m in _matrices(g, spec, i, blocks_or_f32).items()}
        mats = {k: tiled(m) for k, m in fuse_projections(mats, fusing).items()}
        layers.append(jax.block_until_ready(put({**_layer_tensors(g, spec, i, matrices=False, expert_blocks=load_blocks),
                                                 **mats})))
        g.release_pages()  # the layer is copied out: its file pages leave the RSS
    head_name = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    head = load_blocks(g, head_name)
    params = {"head": put(head) if head is not None else put(np.ascontiguousarray(load_tensor(g, head_name).T)),
              "output_norm": put(load_tensor(g, "output_norm.weight")), "layers": layers}
    if not spec.tied_embeddings:  # looked up by row: blocks where the kernel's types allow, else f32 [V, E]
        table = load_blocks(g, "token_embd.weight")
        params["embed"] = put(table if table is not None else load_tensor(g, "token_embd.weight"))
    jax.block_until_ready(params)
    g.release_pages()
    return params


def load_planes(g: GGUFFile, name: str, dtype=jnp.float32) -> QPlanes | None:
    """A matrix [out, in] (or experts [X, out, in]) as QPlanes of its blocks, where the Pallas
    kernel reads its type and its rows tile (out a multiple of 16); else None. dtype: the compute
    dtype its activations enter the product in."""
    info = g.tensor_info(name)
    if not gpu_qmatmul.holds(info.ggml_type, info.shape):
        return None
    rows = info.shape[:-1]
    raw = np.asarray(g.tensor_data(name)).view(np.uint8).reshape(rows[0] if len(rows) == 2 else 1, rows[-1], -1)
    return gpu_qmatmul.planes_from_blocks(raw, info.ggml_type, jnp.dtype(dtype).name)


def _load_planes(g: GGUFFile, spec: ModelSpec, dtype, device) -> dict:
    """load_params for one GPU: the matrices the Pallas kernel reads as QPlanes (no dequantized copy),
    the head and embedding too (rows looked up from the planes: qmatmul.embed_rows); every other
    matrix in `dtype` [in, out] (experts [X, in, out], a head [E, V]), norms f32. Layer by layer."""
    host = lambda a: np.ascontiguousarray(a.astype(dtype) if a.ndim > 1 else a)  # noqa: E731
    put = lambda tree: jax.device_put(tree, device)  # noqa: E731
    planes = lambda g, name: load_planes(g, name, dtype)  # noqa: E731
    layers = []
    for i in range(spec.n_layer):
        mats = {k: m if isinstance(m, QPlanes) else host(m.T)
                for k, m in _matrices(g, spec, i, lambda g, name: planes(g, name) or load_tensor(g, name)).items()}
        rest = {k: a if isinstance(a, QPlanes) else host(a)
                for k, a in _layer_tensors(g, spec, i, matrices=False, expert_blocks=planes).items()}
        layers.append(jax.block_until_ready(put({**rest, **mats})))
        g.release_pages()
    head_name = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    head = load_planes(g, head_name, dtype)  # [V, E] blocks: multiplied by the kernel, looked up by row when tied
    params = {"head": put(head if head is not None else host(load_tensor(g, head_name).T)),
              "output_norm": put(load_tensor(g, "output_norm.weight")), "layers": layers}
    if not spec.tied_embeddings:
        table = load_planes(g, "token_embd.weight", dtype)
        params["embed"] = put(table if table is not None else host(load_tensor(g, "token_embd.weight")))
    g.release_pages()
    return params


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
    if spec.n_expert:
        sources.update(w_gate="blk.0.ffn_gate_exps.weight", w_up="blk.0.ffn_up_exps.weight",
                       w_down="blk.0.ffn_down_exps.weight")
    sources["head"] = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    schemes = tuple((k, scheme_for(g.tensor_info(name).ggml_type)) for k, name in sorted(sources.items()))
    return Numerics(mode, schemes)
