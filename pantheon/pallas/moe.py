"""The routed mixture-of-experts FFN of a qwen35moe layer (SPEC section 5 steps 1-4) around the
grouped Q3_K kernel of pantheon/pallas/moe_q3k.py.

* `route(router_logits, top_k)`: softmax, top-k, renormalised weights.
* `moe_ffn(x, router_logits, top_k, gate, up, down, impl=...)`: Q3_K gate/up planes (and a Q3_K or
  dense down) through the grouped kernel ("pallas"/"interpret") or its jnp reference.
* `moe_ffn_reference`: the same, computed per token with gathered dense expert weights (tests).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pantheon.gguf.arithmetic import NONE, Q8_K, IntBlocks, int_linear, quantize_activations, quantize_q8_k, silu
from pantheon.pallas import moe_q3k
from pantheon.pallas.moe_q3k import Q3KPlanes

ROUTER_SUM_MIN = 6.1e-5  # llama.cpp clamps the renormalisation sum at >= this
IMPLS = ("pallas", "interpret", "reference")


def route(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """SPEC section 5 steps 1-3: softmax over all experts (float32), top-k, renormalise with the
    sum clamped at >= 6.1e-5. router_logits [T, E] -> (weights float32 [T, k], experts int32 [T, k])."""
    p = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    w, idx = lax.top_k(p, top_k)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), ROUTER_SUM_MIN)
    return w, idx.astype(jnp.int32)


def _schemes(schemes) -> tuple[str, str, str]:
    if schemes is None:
        return (NONE, NONE, NONE)
    schemes = tuple(schemes)
    if len(schemes) != 3:
        raise ValueError(f"moe_ffn: schemes must be (gate, up, down) activation schemes, got {schemes!r}")
    return schemes


def _check_moe_args(x, router_logits, top_k, gate, up, down, what):
    for name, p in (("gate", gate), ("up", up)):
        if p is not None and not isinstance(p, Q3KPlanes):
            raise ValueError(f"{what}: {name} must be Q3KPlanes, got {type(p).__name__}")
    if not isinstance(down, (Q3KPlanes, IntBlocks, jax.Array, np.ndarray)):
        raise ValueError(f"{what}: down must be Q3KPlanes, IntBlocks or an array, got {type(down).__name__}")
    if x.ndim != 2 or router_logits.ndim != 2 or router_logits.shape[0] != x.shape[0]:
        raise ValueError(f"{what}: x must be [T, D] and router_logits [T, E]; got x{tuple(x.shape)}, "
                         f"router_logits{tuple(router_logits.shape)}")
    t, dm = x.shape
    e = router_logits.shape[1]
    if not 1 <= top_k <= e:
        raise ValueError(f"{what}: top_k={top_k} must be in [1, {e}]")
    for p in (gate, up, down):
        if isinstance(p, Q3KPlanes):
            p.validate(what)
    f2 = gate.n_out if up is None else None
    if up is not None and gate.shape != up.shape:
        raise ValueError(f"{what}: gate {gate.shape} and up {up.shape} differ")
    if up is None and f2 % 2:
        raise ValueError(f"{what}: fused gate_up has an odd output size {f2}")
    f = gate.n_out if up is not None else f2 // 2
    if gate.shape[0] != e or gate.shape[2] != dm:
        raise ValueError(f"{what}: gate weights {gate.shape} (E, N, K) do not match {e} experts and hidden {dm}")
    if isinstance(down, Q3KPlanes) and down.shape != (e, dm, f):
        raise ValueError(f"{what}: down weights {down.shape} (E, N, K) must be {(e, dm, f)}")
    if not isinstance(down, Q3KPlanes) and tuple(down.shape) != (e, f, dm):
        raise ValueError(f"{what}: dense down weights {tuple(down.shape)} (E, in, out) must be {(e, f, dm)}")
    return t, dm, e, f


def grouped_dense(x: jax.Array, group_sizes: jax.Array, w, scheme: str = NONE) -> jax.Array:
    """Rows of x [M, K] sorted by expert against a dense stacked weight w [E, K, N] (x rounded per
    `scheme`) or IntBlocks (llama.cpp's integer arithmetic, arithmetic.int_linear): [M, N] f32."""
    if isinstance(w, IntBlocks):
        return int_linear(x, w, group_sizes)
    return lax.ragged_dot(quantize_activations(x, scheme).astype(w.dtype), w, group_sizes.astype(jnp.int32),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def q8k_rows(x: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array | None]:
    """x [M, K] rounded for a Q3_K product: Q8_K gives (integer codes in x's dtype, f32 block scales
    [M, K/256]) for the integer dot (`grouped_matmul_q3k`'s x_scale); any other scheme (x rounded
    per arithmetic.quantize_activations, None)."""
    if scheme != Q8_K:
        return quantize_activations(x, scheme), None
    q, d = quantize_q8_k(x.astype(jnp.float32))
    return q.reshape(x.shape).astype(x.dtype), d[..., 0]


@partial(jax.jit, static_argnames=("top_k", "impl", "schemes", "block_m", "block_n"))
def moe_ffn(x: jax.Array, router_logits: jax.Array, top_k: int, gate: Q3KPlanes, up: Q3KPlanes | None,
            down: Q3KPlanes | IntBlocks | jax.Array, *, impl: str = "reference", schemes: tuple[str, str, str] | None = None,
            block_m: int | None = None, block_n: int = 64) -> jax.Array:
    """Routed experts of a qwen35moe layer (SPEC section 5 steps 1-4; no shared expert).

    x: [T, D] (the post-attention-normed hidden state); router_logits: [T, E] (ffn_gate_inp . x);
    gate, up: Q3KPlanes [E, F, D]; or up=None with gate the fused ffn_gate_up_exps [E, 2F, D] (first
    F rows gate, next F up); down: Q3KPlanes [E, D, F], or (a mixed file, e.g. llama.cpp's Q3_K_M with
    Q4_K/Q5_K down) a dense [E, F, D] array or IntBlocks, run by `grouped_dense` on the sorted rows.
    Returns [T, D] in x's dtype:
    sum over the top_k experts of w_e * down_e(silu(gate_e x) * up_e x).
    schemes: activation rounding before the gate, up and down matmuls (pantheon.model.numerics,
    e.g. ("q8_k",) * 3 to follow llama.cpp's CPU arithmetic; default none). Rounding is per row,
    so it is applied before rows are gathered; padded rows stay zero. Q8_K rows enter the matmuls
    as integer codes with their block scales (llama.cpp's integer dot products, `q8k_rows`).

    The T*k (token, expert) pairs are sorted by expert; impl "pallas"/"interpret" scatters them into
    the kernel's padded row layout once and runs the three grouped Q3_K matmuls on it, "reference"
    runs `grouped_matmul_q3k_reference` on the sorted rows. Results are summed back per token with
    the routing weights."""
    if impl not in IMPLS:
        raise ValueError(f"moe_ffn: impl must be one of {IMPLS}, got {impl!r}")
    t, dm, e, f = _check_moe_args(x, router_logits, top_k, gate, up, down, "moe_ffn")
    weights, experts = route(router_logits, top_k)
    flat_e = experts.reshape(-1)  # [T*k], pair i = (token i // k, expert flat_e[i])
    order = jnp.argsort(flat_e, stable=True)
    tok = (order // top_k).astype(jnp.int32)  # token of each sorted pair
    wsorted = weights.reshape(-1)[order]
    sizes = jnp.zeros((e,), jnp.int32).at[flat_e].add(1)
    m = t * top_k
    cdt = x.dtype
    s_gate, s_up, s_down = _schemes(schemes)
    planes_down = isinstance(down, Q3KPlanes)
    xg = q8k_rows(x, s_gate)
    xu = xg if up is None or s_up == s_gate else q8k_rows(x, s_up)

    def swiglu_rows(g, u):
        h = (silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(cdt)
        return q8k_rows(h, s_down) if planes_down else (h, None)

    if impl == "reference":
        (xg_rows, xg_scale), (xu_rows, xu_scale) = ((a[tok], None if sa is None else sa[tok]) for a, sa in (xg, xu))
        if up is None:
            gu = moe_q3k.grouped_matmul_q3k_reference(xg_rows, sizes, gate, xg_scale)
            g, u = gu[:, :f], gu[:, f:]
        else:
            g = moe_q3k.grouped_matmul_q3k_reference(xg_rows, sizes, gate, xg_scale)
            u = moe_q3k.grouped_matmul_q3k_reference(xu_rows, sizes, up, xu_scale)
        h, h_scale = swiglu_rows(g, u)
        y = moe_q3k.grouped_matmul_q3k_reference(h, sizes, down, h_scale) if planes_down else \
            grouped_dense(h, sizes, down, s_down)
    else:
        interpret = impl == "interpret"
        bm = moe_q3k.default_block_m(m, e) if block_m is None else block_m
        dest, tile_expert, n_tiles = moe_q3k.row_layout(sizes, m, bm)
        rows = n_tiles * bm

        def padded(a):  # sorted pairs' rows of (x, scale), in the kernel's padded layout (padding rows 0)
            pad = lambda v: jnp.zeros((rows, v.shape[1]), v.dtype).at[dest].set(v[tok], mode="drop")  # noqa: E731
            return pad(a[0]), None if a[1] is None else pad(a[1])

        mm = partial(moe_q3k.gmm_padded, tile_expert=tile_expert, block_n=block_n, interpret=interpret,
                     out_dtype=cdt, num_warps=4, num_stages=2)
        xg_pad = padded(xg)
        if up is None:
            gu = mm(xg_pad[0], planes=gate, x_scale=xg_pad[1])
            g, u = gu[:, :f], gu[:, f:]
        else:
            g = mm(xg_pad[0], planes=gate, x_scale=xg_pad[1])
            xu_pad = xg_pad if xu is xg else padded(xu)
            u = mm(xu_pad[0], planes=up, x_scale=xu_pad[1])
        h, h_scale = swiglu_rows(g, u)
        if planes_down:
            y = jnp.take(mm(h, planes=down, x_scale=h_scale), dest, axis=0, mode="fill", fill_value=0)
        else:  # back to the sorted rows, for the dense grouped product
            y = grouped_dense(jnp.take(h, dest, axis=0, mode="fill", fill_value=0), sizes, down, s_down)
    out = jnp.zeros((t, dm), jnp.float32).at[tok].add(y.astype(jnp.float32) * wsorted[:, None])
    return out.astype(x.dtype)


@partial(jax.jit, static_argnames=("top_k", "schemes"))
def moe_ffn_reference(x: jax.Array, router_logits: jax.Array, top_k: int, gate: Q3KPlanes,
                      up: Q3KPlanes | None, down: Q3KPlanes | IntBlocks | jax.Array, schemes: tuple[str, str, str] | None = None) -> jax.Array:
    """Dense, independent `moe_ffn` for tests: per token, argsort the softmax descending, take k,
    renormalise, gather the k dequantised (or, for Q8_K activations, integer) expert matrices and
    apply SwiGLU with einsums (float32).
    Memory is T*k full expert matrices: test sizes only."""
    t, dm, e, f = _check_moe_args(x, router_logits, top_k, gate, up, down, "moe_ffn_reference")
    p = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    idx = jnp.argsort(-p, axis=-1, stable=True)[:, :top_k]  # [T, k]
    w = jnp.take_along_axis(p, idx, axis=-1)
    w = w / jnp.maximum(w.sum(-1, keepdims=True), ROUTER_SUM_MIN)
    s_gate, s_up, s_down = _schemes(schemes)
    halves = (slice(0, f), slice(f, 2 * f)) if up is None else (slice(None), slice(None))
    xk = jnp.broadcast_to(x.astype(jnp.float32)[:, None], (t, top_k, dm))
    g = _dense_expert_product(xk, gate, idx, halves[0], s_gate)
    u = _dense_expert_product(xk, gate if up is None else up, idx, halves[1], s_up)
    h = silu(g) * u
    if isinstance(down, Q3KPlanes):
        y = _dense_expert_product(h, down, idx, slice(None), s_down)
    else:  # every expert on every row, kept where chosen (test sizes)
        each = [int_linear(h, down[ex]) if isinstance(down, IntBlocks) else
                jnp.einsum("tkf,fd->tkd", quantize_activations(h, s_down), down[ex], precision=lax.Precision.HIGHEST)
                for ex in range(e)]
        y = jnp.select([(idx == ex)[..., None] for ex in range(e)], each)
    return jnp.einsum("tk,tkd->td", w, y, precision=lax.Precision.HIGHEST).astype(x.dtype)


def _dense_expert_product(xk, planes: Q3KPlanes, idx, rows: slice, scheme: str):
    """xk [T, k, K] through the chosen experts' weights (output rows `rows`): [T, k, N], the rounded
    product (float32), or for Q8_K the integer block sums times d_x * d_w, block after block."""
    hp = lax.Precision.HIGHEST
    if scheme != Q8_K:
        w = moe_q3k.dequantize_planes(planes)[:, rows][idx]  # [T, k, N, K]
        return jnp.einsum("tkd,tknd->tkn", quantize_activations(xk, scheme), w, precision=hp)
    ints = moe_q3k.planes_int_blocks(planes)
    c, d = ints.c[..., rows][idx], ints.d[..., rows][idx]  # [T, k, K, N], [T, k, nb, N]
    q, dx = quantize_q8_k(xk)  # [T, k, nb, 256], [T, k, nb, 1]
    y = jnp.zeros((*c.shape[:2], c.shape[-1]), jnp.float32)
    for b in range(planes.n_blocks):
        isum = jnp.einsum("tkj,tkjn->tkn", q[:, :, b], c[:, :, b * moe_q3k.QK:(b + 1) * moe_q3k.QK], precision=hp)
        y = y + (dx[:, :, b] * d[:, :, b]) * isum
    return y
