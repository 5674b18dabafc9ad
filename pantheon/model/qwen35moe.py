"""Qwen3.5-MoE (llama.cpp architecture `qwen35moe`) as pure functions.

A hybrid: most layers mix tokens with a Gated DeltaNet (a linear-attention recurrence with a
per-slot state), every `full_attention_interval`-th layer with gated full attention (a KV cache),
and every layer ends in a routed MoE plus a sigmoid-gated shared expert. The math follows SPEC.md
of the reference data (shared/reference/qwen35moe), section numbers below refer to it.

Like llama.py, a step is a chain of compiled programs: `embed`, one `attn_block` or `ssm_block`
per layer (one executable per layer kind, shared by all layers of that kind), and `head`;
`forward` chains them and routes each through `call(name, layer, fn, args, static)` (step.LayerCall).

Recurrent state rules (the runner relies on them):
* a row whose first position is 0 starts a new sequence: its conv and delta-rule state are zeroed
  before use, so a slot needs no explicit reset;
* tokens after `logit_index[b]` are padding: they never reach row b's recurrent state (their K/V
  writes are harmless, as nothing attends past a row's own position);
* so logit_index must be n_valid - 1 of each row, also with all_logits.

All matmuls are traced with "highest" precision: on accelerators the default (tf32/bf16) would
flip top-2 router choices, whose smallest margin on the tiny reference model is 1.2e-4.

Kernels (model/kernels.py): attention and, for Q3_K experts, the routed MoE run through
pantheon.pallas.dispatch; each layer program's static `kernels` records the implementation it was
traced with. When every layer's expert gate and up tensors (or the fused gate_up) are Q3_K, they
stay Q3_K blocks on the device (`Q3KPlanes`, 114 bytes per 110 GGUF bytes) instead of being
dequantized to float32, and so does down where it is Q3_K too (`q3k_expert_roles`); other experts
keep the float32 path (`layers.grouped_experts`). Both paths route with pantheon.pallas.moe.route
(SPEC §5). With `llamacpp` numerics every other
quantized matrix loads as arithmetic.IntBlocks and multiplies in llama.cpp's integer arithmetic
(the Q3_K kernel has its own integer mode)."""

from __future__ import annotations

from functools import partial, wraps

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGMLQuantizationType
from jax import lax

from pantheon.gguf.reader import GGUFFile
from pantheon.model import kernels as kern
from pantheon.model.layers import grouped_experts, linear, rms_norm, rope, swiglu
from pantheon.gguf.quants import SCALE_FIELDS
from pantheon.gguf.arithmetic import IntBlocks, int_linear, quantize_activations, scheme_for, silu
from pantheon.model.numerics import Numerics
from pantheon.model.spec import ROPE_NEOX, HybridSpec
from pantheon.model.state import HybridState, allocate_hybrid_state, kv_write
from pantheon.model.step import LayerCall, StepInputs, direct
from pantheon.model.weights import load_blocks, load_tensor
from pantheon.native import build as native_build
from pantheon.native.qmatmul import QMatrix, embed_rows
from pantheon.pallas import dispatch
from pantheon.pallas.deltanet import kernel_supports
from pantheon.pallas.moe import route
from pantheon.pallas.moe_q3k import Q3KPlanes, q3k_planes_from_blocks

# ---- weights --------------------------------------------------------------------------------------
# params key -> GGUF tensor name inside blk.N. Matrices are stored [in, out] (x @ W), experts
# [n_expert, in, out], the conv taps [d_conv, conv_dim].
_FFN = {"attn_norm": "attn_norm.weight", "post_norm": "post_attention_norm.weight",
        "router": "ffn_gate_inp.weight", "exp_gate": "ffn_gate_exps.weight", "exp_up": "ffn_up_exps.weight",
        "exp_down": "ffn_down_exps.weight", "sh_gate": "ffn_gate_shexp.weight", "sh_up": "ffn_up_shexp.weight",
        "sh_down": "ffn_down_shexp.weight", "sh_gate_inp": "ffn_gate_inp_shexp.weight"}
_ATTENTION = {"wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "q_norm": "attn_q_norm.weight",
              "k_norm": "attn_k_norm.weight", "wo": "attn_output.weight"}
_DELTANET = {"w_qkv": "attn_qkv.weight", "w_z": "attn_gate.weight", "w_beta": "ssm_beta.weight",
             "w_alpha": "ssm_alpha.weight", "conv": "ssm_conv1d.weight", "dt_bias": "ssm_dt.bias", "a": "ssm_a",
             "ssm_norm": "ssm_norm.weight", "w_out": "ssm_out.weight"}
_FUSED_GATE_UP = "ffn_gate_up_exps.weight"  # optional: gate rows, then up rows
_EXPERTS = ("exp_gate", "exp_up", "exp_down")
# Q3_K experts as planes: "exp_gate", "exp_up", "exp_down" Q3KPlanes [X, out, in] (GGUF orientation),
# or "exp_gate_up" [X, 2F, E] (gate rows, then up rows) instead of the first two.
_GATE_UP_PLANES = "exp_gate_up"


def _layer_names(g: GGUFFile, spec: HybridSpec, i: int) -> dict[str, str]:
    """params key -> full GGUF tensor name for layer i."""
    names = {**_FFN, **(_DELTANET if spec.recurrent[i] else _ATTENTION)}
    if f"blk.{i}.{_FUSED_GATE_UP}" in g.tensors:
        names["exp_gate"] = names["exp_up"] = _FUSED_GATE_UP
    return {k: f"blk.{i}.{n}" for k, n in names.items()}


GATE_UP, DOWN = "gate_up", "down"  # the roles of the routed expert tensors


def expert_role(tensor_name: str) -> str | None:
    """The role of a routed expert GGUF tensor (ffn_gate/up/down_exps, ffn_gate_up_exps), else None."""
    return None if "_exps." not in tensor_name else DOWN if "ffn_down_exps" in tensor_name else GATE_UP


def q3k_experts(g: GGUFFile, spec: HybridSpec) -> frozenset[str]:
    """The routed-expert roles whose tensors stay Q3_K blocks on the device (`q3k_expert_roles`)."""
    return q3k_expert_roles((expert_role(name), g.tensor_info(name).ggml_type)
                            for i in range(spec.n_layer) for key, name in _layer_names(g, spec, i).items()
                            if key in _EXPERTS)


def q3k_expert_roles(typed_roles) -> frozenset[str]:
    """(role, ggml type) of every layer's routed expert tensors -> the roles that stay Q3_K blocks
    (Q3KPlanes) for the grouped Q3_K kernel: GATE_UP (gate and up, or the fused gate_up) when all of
    them are Q3_K, and DOWN as well when every down tensor is too. Decided for the whole model, so
    all layers of a kind share one program (and one params structure). A Q3_K_M mix (Q3_K gate/up,
    Q4_K/Q5_K down) keeps gate/up in blocks and runs its downs dense; experts without Q3_K gate/up
    keep the float32 path. Admission (engine/pool.py) charges the experts by the same rule."""
    q3k: dict[str, bool] = {}
    for role, kind in typed_roles:
        q3k[role] = q3k.get(role, True) and kind == GGMLQuantizationType.Q3_K
    if not q3k.get(GATE_UP):
        return frozenset()
    return frozenset({GATE_UP} | ({DOWN} if q3k.get(DOWN) else set()))


def _layer_tensors(g: GGUFFile, spec: HybridSpec, i: int, q3k: frozenset[str] = frozenset(),
                   int_blocks: bool = False, blocks: bool = False) -> dict[str, np.ndarray | Q3KPlanes | IntBlocks | QMatrix]:
    """Layer i's tensors: the expert roles in `q3k` as planes; with `int_blocks` (llamacpp numerics)
    every other quantized matrix as IntBlocks; with `blocks` (the CPU's native kernels) every
    matrix of a type they read as the file's blocks (QMatrix; routed experts one stacked QMatrix a
    role, unless Q3_K planes take gate/up, whose grouped path wants a dense down), except the
    _KEEP_F32 ones; the rest dequantized float32."""
    out = {}
    for key, name in _layer_names(g, spec, i).items():
        if key in _EXPERTS and expert_role(name) in q3k:  # raw [X, out, row bytes] blocks -> planes, never dequantized
            if name.endswith(_FUSED_GATE_UP):
                if key == "exp_gate":
                    out[_GATE_UP_PLANES] = q3k_planes_from_blocks(g.tensor_data(name))
            else:
                out[key] = q3k_planes_from_blocks(g.tensor_data(name))
            continue
        info = g.tensor_info(name)
        m = load_blocks(g, name) if blocks and held_in_blocks(name, q3k) else None
        if m is not None:
            if name.endswith(_FUSED_GATE_UP):  # rows: gate, then up
                f = m.blocks.shape[-2] // 2
                m = QMatrix(m.blocks[..., f:, :] if key == "exp_up" else m.blocks[..., :f, :], m.qtype, m.n_in)
            out[key] = m
            continue
        if int_blocks and key not in _KEEP_F32 and len(info.shape) >= 2 and info.ggml_type in SCALE_FIELDS:
            a = IntBlocks.from_gguf(g.tensor_data(name), info.ggml_type, int(info.shape[-1]))
            if name.endswith(_FUSED_GATE_UP):  # outputs: gate, then up
                f = a.c.shape[-1] // 2
                a = jax.tree_util.tree_map(lambda v: v[..., f:] if key == "exp_up" else v[..., :f], a)
            out[key] = a
            continue
        a = load_tensor(g, name)
        if name.endswith(_FUSED_GATE_UP):
            gate, up = np.split(a, 2, axis=1)
            a = up if key == "exp_up" else gate
        # [out, in] -> [in, out]; conv [C, d_conv] -> [d_conv, C]; experts keep their leading axis
        out[key] = a.T if a.ndim == 2 else np.swapaxes(a, 1, 2) if a.ndim == 3 else a
    return out


# Matrices kept float32 whatever the compute dtype (model/dtypes.py): the router and shared-expert
# gate decide which weights run (a bf16 rounding can swap two close experts), and the conv taps
# feed the recurrent state.
_KEEP_F32 = frozenset({"router", "sh_gate_inp", "conv"})
_KEEP_F32_NAMES = tuple({**_FFN, **_DELTANET}[k] for k in sorted(_KEEP_F32))  # their tensors' names in blk.N


def held_in_blocks(tensor_name: str, q3k: frozenset[str]) -> bool:
    """Whether load_params keeps this matrix (of a type the native kernels read) as the file's blocks
    on the CPU: the embedding, the head and the layers' matrices, but not the _KEEP_F32 ones nor
    routed experts beside Q3_K planes. The loader (`_layer_tensors`) and admission's estimate ask."""
    if tensor_name in ("token_embd.weight", "output.weight"):
        return True
    return (tensor_name.startswith("blk.") and not tensor_name.endswith(_KEEP_F32_NAMES)
            and not (q3k and expert_role(tensor_name)))


def load_params(g: GGUFFile, spec: HybridSpec, dtype=jnp.float32, device=None, numerics: Numerics | None = None) -> dict:
    """The params pytree for `forward`: every matrix dequantized to `dtype` (1-D tensors and
    _KEEP_F32 stay f32), except Q3_K experts (`q3k_experts`), kept as Q3KPlanes, and, for `llamacpp`
    numerics, every other quantized matrix kept as IntBlocks (llama.cpp's integer arithmetic).
    `device` may be a Device or a Sharding."""
    q3k = q3k_experts(g, spec)
    int_blocks = numerics is not None and numerics.mode == "llamacpp"
    # On the CPU with the native kernels: the file's blocks, as the dense family holds them (its
    # integer products over 8-bit activations are llama.cpp's arithmetic, as IntBlocks')
    blocks = (dtype == jnp.float32 and jax.default_backend() == "cpu" and native_build.available()
              and not (isinstance(device, jax.sharding.Sharding) and len(device.device_set) > 1))

    def put(a, key=""):
        if isinstance(a, (Q3KPlanes, IntBlocks, QMatrix)):
            return jax.device_put(a, device)
        keep = a.ndim < 2 or key in _KEEP_F32
        return jax.device_put(np.ascontiguousarray(a if keep else a.astype(dtype)), device)

    layers = [{k: put(a, k) for k, a in _layer_tensors(g, spec, i, q3k, int_blocks, blocks).items()}
              for i in range(spec.n_layer)]
    embed_blocks = load_blocks(g, "token_embd.weight") if blocks else None  # looked up by row (embed_rows)
    params = {"embed": put(embed_blocks if embed_blocks is not None else load_tensor(g, "token_embd.weight")),
              "output_norm": put(load_tensor(g, "output_norm.weight")), "layers": layers}
    head = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    info = g.tensor_info(head)
    head_blocks = embed_blocks if spec.tied_embeddings else load_blocks(g, head) if blocks else None
    if head_blocks is not None:  # the native products (`linear`); a tied head is the embedding's blocks
        if not spec.tied_embeddings:
            params["output"] = put(head_blocks)
    elif int_blocks and info.ggml_type in SCALE_FIELDS:  # the head's product in integer arithmetic
        params["output"] = put(IntBlocks.from_gguf(g.tensor_data(head), info.ggml_type, int(info.shape[1])))
    elif not spec.tied_embeddings:
        params["output"] = put(load_tensor(g, head))
    return params


def numerics_for(g: GGUFFile, spec: HybridSpec, mode: str = "llamacpp") -> Numerics:
    """Activation rounding per params key, from the tensor types of the first layer of each kind."""
    if mode not in ("llamacpp", "exact"):
        raise ValueError(f"unknown numerics mode {mode!r} (llamacpp or exact)")
    sources = {}
    for i in (spec.recurrent_layers[:1] + spec.attention_layers[:1]):
        sources.update(_layer_names(g, spec, i))
    sources["head"] = "token_embd.weight" if spec.tied_embeddings else "output.weight"
    schemes = tuple((k, scheme_for(g.tensor_info(n).ggml_type)) for k, n in sorted(sources.items()))
    return Numerics(mode, schemes)


def allocate_state(spec: HybridSpec, n_slots: int, ctx: int, dtype=jnp.float32, sharding=None) -> HybridState:
    """K/V (in `dtype`) per attention layer, conv + delta-rule state (f32) per DeltaNet layer; slot
    n_slots is scratch."""
    return allocate_hybrid_state(spec, n_slots, ctx, dtype=dtype, sharding=sharding)


# ---- building blocks --------------------------------------------------------------------------------
def _f32_dots(fn):
    """Trace fn with every matmul at full f32 precision (see the module docstring)."""
    @wraps(fn)
    def traced(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)
    return traced


def _l2_norm(x, eps):
    return x * lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _causal_conv(prev, x, taps, lengths):
    """Depthwise causal conv over time, then silu (SPEC §4.4).

    prev: [B, K-1, C] the inputs just before this chunk; x: [B, T, C]; taps: [K, C], tap K-1 hits the
    current token; lengths: [B] valid tokens per row. Returns (silu(conv(x)) [B, T, C], the new
    state [B, K-1, C]: the last K-1 *valid* inputs, so padding never enters it)."""
    n_taps, t = taps.shape[0], x.shape[1]
    window = jnp.concatenate([prev, x], axis=1)  # [B, K-1+T, C]; token t sits at row t + K-1
    out = sum(window[:, i:i + t] * taps[i] for i in range(n_taps))
    keep = lengths[:, None] + jnp.arange(n_taps - 1)  # rows of tokens lengths-K+1 .. lengths-1
    return silu(out), jnp.take_along_axis(window, keep[..., None], axis=1)


def _deltanet(w, conv_state, ssm_state, h, positions, slots, lengths, spec: HybridSpec, num: Numerics,
              kernels: kern.Kernels):
    """Gated DeltaNet mixer (SPEC §4). h: [B, T, E]. Returns (out [B, T, E], conv_state, ssm_state).
    The delta rule runs through dispatch: a decode step updates each row's slot of the state cache in
    place (rows there are never at position 0: prefill starts every sequence); a prefill chunk runs
    from the gathered (or, at position 0, zero) state and is scattered back."""
    b, t, _ = h.shape
    nk, nv, d = spec.ssm_n_group, spec.ssm_dt_rank, spec.ssm_d_state
    mixed = linear(h, w["w_qkv"], num.scheme("w_qkv"))  # [B, T, C]: q | k | v channels, before the conv
    z = linear(h, w["w_z"], num.scheme("w_z")).reshape(b, t, nv, d)  # output gate
    beta = jax.nn.sigmoid(linear(h, w["w_beta"], num.scheme("w_beta")))  # [B, T, Hv]
    # a = -exp(A_log) < 0, so g <= 0 is a log-decay per value head and token
    g = jax.nn.softplus(linear(h, w["w_alpha"], num.scheme("w_alpha")) + w["dt_bias"]) * w["a"]

    fresh = positions[:, 0] == 0  # a new sequence starts from zero state
    conv0 = jnp.where(fresh[:, None, None], 0.0, conv_state[slots])  # [B, K-1, C]
    s0 = jnp.where(fresh[:, None, None, None], 0.0, ssm_state[slots])  # [B, Hv, Dk, Dv]
    u, conv_new = _causal_conv(conv0, mixed, w["conv"], lengths)

    q, k, v = jnp.split(u, [spec.key_dim, 2 * spec.key_dim], axis=-1)
    q = _l2_norm(q.reshape(b, t, nk, d), spec.rms_eps) * d ** -0.5
    k = _l2_norm(k.reshape(b, t, nk, d), spec.rms_eps)
    # The converter orders value heads so that value head j reads key head j mod nk: tile, not repeat.
    q, k = jnp.tile(q, (1, 1, nv // nk, 1)), jnp.tile(k, (1, 1, nv // nk, 1))  # [B, T, Hv, Dk]
    v = v.reshape(b, t, nv, d)
    mode = dict(kernels).get(kern.DELTANET, "reference")
    if t == 1:
        o, ssm_state = dispatch.deltanet_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm_state, slots,
                                              mode=mode)
        o = o[:, None]
    else:
        o, s_new = dispatch.deltanet(q, k, v, g, beta, s0, lengths, chunk=16 if t <= 16 else 64, mode=mode)
        ssm_state = ssm_state.at[slots].set(s_new)

    y = rms_norm(o, w["ssm_norm"], spec.rms_eps) * silu(z)  # norm first, then gate
    out = linear(y.reshape(b, t, nv * d), w["w_out"], num.scheme("w_out"))
    return out, conv_state.at[slots].set(conv_new), ssm_state


def _attention(w, k_cache, v_cache, h, positions, slots, spec: HybridSpec, num: Numerics, kv_len: int,
               kernels: kern.Kernels):
    """Gated full attention (SPEC §3.1). h: [B, T, E]; caches [slots+1, ctx, K, D]."""
    b, t, _ = h.shape
    d = spec.head_dim
    qg = linear(h, w["wq"], num.scheme("wq")).reshape(b, t, spec.n_head, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]  # per head [query | gate], not all queries then all gates
    k = linear(h, w["wk"], num.scheme("wk")).reshape(b, t, spec.n_head_kv, d)
    v = linear(h, w["wv"], num.scheme("wv")).reshape(b, t, spec.n_head_kv, d)
    # IMROPE with text positions (p, p, p, 0) is plain NEOX rope on the first rope_dim dims (§3.2).
    q = rope(rms_norm(q, w["q_norm"], spec.rms_eps), positions, spec.rope_base, spec.rope_dim, ROPE_NEOX)
    k = rope(rms_norm(k, w["k_norm"], spec.rms_eps), positions, spec.rope_base, spec.rope_dim, ROPE_NEOX)

    rows = slots[:, None]  # positions past the cache (padding of a last chunk) are dropped
    k_cache = k_cache.at[rows, positions].set(kv_write(k, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, positions].set(kv_write(v, v_cache.dtype), mode="drop")
    o = kern.attend(q, k_cache, v_cache, positions, slots, kv_len, kernels) * jax.nn.sigmoid(gate)  # [B, T, H, D]
    return linear(o.reshape(b, t, -1), w["wo"], num.scheme("wo")), k_cache, v_cache


def _ffn(w, x, spec: HybridSpec, num: Numerics, kernels: kern.Kernels):
    """x + MoE(h) + shared expert(h), h = RMSNorm(x) * post_attention_norm (SPEC §5). x: [B, T, E].
    Q3_K gate/up experts (Q3KPlanes) run through dispatch.moe_ffn (with Q3_K planes or a dense down),
    other experts through `layers.grouped_experts`."""
    h = rms_norm(x, w["post_norm"], spec.rms_eps).reshape(-1, x.shape[-1])  # [N, E]
    router_logits = h @ w["router"]  # [N, X], f32 (_KEEP_F32)
    schemes = tuple(num.scheme(key) for key in _EXPERTS)
    if _GATE_UP_PLANES in w or isinstance(w["exp_gate"], Q3KPlanes):
        gate, up = (w[_GATE_UP_PLANES], None) if _GATE_UP_PLANES in w else (w["exp_gate"], w["exp_up"])
        routed = dispatch.moe_ffn(h, router_logits, spec.n_expert_used, gate, up, w["exp_down"], schemes=schemes,
                                  mode=dict(kernels)[kern.MOE_Q3K])
    else:
        weights, experts = route(router_logits, spec.n_expert_used)
        routed = jnp.einsum("nk,nke->ne", weights, grouped_experts(h, experts, w["exp_gate"], w["exp_up"],
                                                                     w["exp_down"], schemes))
    schemes = tuple(num.scheme(key) for key in ("sh_gate", "sh_up", "sh_down"))
    shared = swiglu(h, w["sh_gate"], w["sh_up"], w["sh_down"], schemes) * jax.nn.sigmoid(h @ w["sh_gate_inp"])[:, None]
    return x + (routed + shared).reshape(x.shape)


# ---- compiled programs ------------------------------------------------------------------------------
@jax.jit
def embed(table, tokens):
    """tokens int32 [B, T] -> x [B, T, E] (the residual stream is f32 whatever the table's dtype);
    table [V, E], or its blocks (QMatrix: the rows dequantized)."""
    if isinstance(table, QMatrix):
        return embed_rows(table, tokens).astype(jnp.float32)
    return table[tokens].astype(jnp.float32)


@partial(jax.jit, static_argnames=("spec", "numerics", "kv_len", "kernels"), donate_argnames=("k_cache", "v_cache"))
@_f32_dots
def attn_block(w, k_cache, v_cache, x, positions, slots, *, spec: HybridSpec, numerics: Numerics, kv_len: int,
               kernels: kern.Kernels):
    """Full-attention layer. x: [B, T, E]; positions: int32 [B, T]; slots: int32 [B].
    kernels: the modes of its attention kernel and, with Q3_K experts, moe_q3k (`layer_kernels`)."""
    a, k_cache, v_cache = _attention(w, k_cache, v_cache, rms_norm(x, w["attn_norm"], spec.rms_eps), positions,
                                     slots, spec, numerics, kv_len, kernels)
    return _ffn(w, x + a, spec, numerics, kernels), k_cache, v_cache


@partial(jax.jit, static_argnames=("spec", "numerics", "kernels"), donate_argnames=("conv_state", "ssm_state"))
@_f32_dots
def ssm_block(w, conv_state, ssm_state, x, positions, slots, logit_index, *, spec: HybridSpec, numerics: Numerics,
              kernels: kern.Kernels):
    """Gated DeltaNet layer. Row b's tokens after logit_index[b] are padding and leave its state alone.
    kernels: the deltanet mode and, with Q3_K experts, the moe_q3k mode (`layer_kernels`)."""
    a, conv_state, ssm_state = _deltanet(w, conv_state, ssm_state, rms_norm(x, w["attn_norm"], spec.rms_eps),
                                         positions, slots, logit_index + 1, spec, numerics, kernels)
    return _ffn(w, x + a, spec, numerics, kernels), conv_state, ssm_state


@partial(jax.jit, static_argnames=("spec", "numerics", "all_logits", "hidden"))
@_f32_dots
def head(table, output_norm, x, logit_index, *, spec: HybridSpec, numerics: Numerics, all_logits: bool,
         hidden: bool = False):
    """x [B, T, E] -> logits [B, V] at logit_index per row (or [B, T, V] with all_logits). table: the
    head [V, E] (maybe the embedding), its blocks (QMatrix [V, E]), or IntBlocks [E, V]. hidden: the final-normed hidden states
    [B, T, E] instead (embeddings)."""
    if hidden:
        return rms_norm(x, output_norm, spec.rms_eps).astype(jnp.float32)
    if not all_logits:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]  # [B, E]
    x = rms_norm(x, output_norm, spec.rms_eps)
    if isinstance(table, IntBlocks):  # [E, V], llamacpp numerics
        return int_linear(x, table)
    if isinstance(table, QMatrix):  # the file's blocks [V, E] (the CPU's native products)
        return linear(x, table, numerics.scheme("head"))
    x = quantize_activations(x, numerics.scheme("head"))
    # table [V, E]: maybe the embedding; bf16 operands accumulate in f32 (model/dtypes.py)
    return jnp.einsum("...i,vi->...v", x.astype(table.dtype), table, preferred_element_type=jnp.float32)


def layer_kernels(spec: HybridSpec, params, state: HybridState, t: int) -> dict[str, kern.Kernels]:
    """The static `kernels` of "attn_block" and "ssm_block" for t tokens per row (model/kernels.py)."""
    moe = {kern.MOE_Q3K: _moe_supported(params["layers"][0])} if _has_q3k_experts(params) else {}
    out = {}
    if state.ssm:
        d = spec.ssm_d_state
        out["ssm_block"] = kern.choose({**moe, kern.DELTANET: kernel_supports(d, d, tuple(state.ssm[0].shape))})
    if state.k:
        out["attn_block"] = kern.choose({**kern.attention_modes(t, spec.head_dim, state.k[0].shape), **moe},
                                        state.k[0].dtype)
    return out


def _has_q3k_experts(params) -> bool:
    w = params["layers"][0]
    return isinstance(w.get(_GATE_UP_PLANES, w.get("exp_gate")), Q3KPlanes)


def _moe_supported(w) -> bool:
    """The Pallas grouped Q3_K matmul addresses a weight with int32 element offsets."""
    return all(p.qs.size < 2 ** 31 for p in w.values() if isinstance(p, Q3KPlanes))


def forward(params, state: HybridState, inputs: StepInputs, *, spec: HybridSpec, numerics: Numerics, kv_len: int,
            all_logits: bool = False, hidden: bool = False, call: LayerCall = direct):
    """inputs: the rows (step.StepInputs); logit_index must be n_valid - 1 of each row (later tokens
    are padding). kv_len: static number of cache positions attended, >= max valid
    position + 1. Returns (logits [B, V], or [B, T, V] with all_logits, or the final-normed hidden
    states [B, T, E] with hidden, and the new state). The
    state's buffers are donated: use the returned state."""
    tokens, positions, slots, logit_index = inputs
    x = call("embed", -1, embed, (params["embed"], tokens), {})
    # Updated in place, layer by layer, so that a failure mid-forward leaves `state` naming every
    # live buffer (see llama.forward).
    ks, vs, convs, ssms = state.k, state.v, state.conv, state.ssm
    kernels = {name: kern.for_numerics(k, numerics.mode)
               for name, k in layer_kernels(spec, params, state, tokens.shape[1]).items()}
    ia = ir = 0  # index into the attention / DeltaNet state lists
    for i, w in enumerate(params["layers"]):
        if spec.recurrent[i]:
            x, convs[ir], ssms[ir] = call("ssm_block", i, ssm_block, (w, convs[ir], ssms[ir], x, positions, slots,
                                                                   logit_index),
                                          dict(spec=spec, numerics=numerics, kernels=kernels["ssm_block"]))
            ir += 1
        else:
            x, ks[ia], vs[ia] = call("attn_block", i, attn_block, (w, ks[ia], vs[ia], x, positions, slots),
                                     dict(spec=spec, numerics=numerics, kernels=kernels["attn_block"],
                                          kv_len=kern.program_kv_len(kernels["attn_block"], kv_len, state.ctx)))
            ia += 1
    table = params.get("output", params["embed"])
    logits = call("head", -1, head, (table, params["output_norm"], x, logit_index),
                  dict(spec=spec, numerics=numerics, all_logits=all_logits, hidden=hidden))
    return logits, HybridState(ks, vs, convs, ssms, ctx=state.ctx)
