"""Which kernel implementation each model program runs, and the attention step both models share.

Every layer program (llama `block`, qwen35moe `attn_block` / `ssm_block`) takes a static argument
`kernels`: a sorted tuple of (kernel name, mode) pairs, one per pantheon.pallas.dispatch kernel the
program calls, mode "reference", "interpret", "pallas" or "native" (a C++ CPU kernel, pantheon/native). `forward` resolves it with `choose` before
each call (dispatch.kernel_mode: GPU -> pallas, else reference, PANTHEON_KERNELS overrides) and the
program hands each mode to its dispatch entry point. So:

* the choice is visible: it is in the program's static arguments (the `static` dict the runner's
  `call` receives), which a residency counter can report per program class;
* it is part of the jit cache key: changing PANTHEON_KERNELS traces new programs instead of
  silently reusing ones traced under the old setting;
* a kernel that cannot run a model's shapes (head_dim not a power of 2 in [16, 512], a cache
  under 16 positions or over 2**31 elements) is recorded as "reference" for that model instead of
  failing: the record says what runs.

The decode kernel reads each row's slot in place up to its length, and so does the jnp path
(`reference` mode: attention_reference's math in key blocks, `cached_attention_blocked`), so those
programs are traced with kv_len = the cache length (`program_kv_len`): one executable for every
kv_len bucket the runner keys them by. Only the Pallas flash prefill keeps the bucket's kv_len.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pantheon.model.dtypes import Q8_0_KV
from pantheon.pallas import dispatch

ATTENTION_PREFILL, ATTENTION_DECODE, MOE_Q3K, DELTANET = "attention_prefill", "attention_decode", "moe_q3k", "deltanet"
Kernels = tuple[tuple[str, str], ...]
NATIVE_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), Q8_0_KV)


def attention_kernel(t: int) -> str:
    """The attention kernel of a program with t queries per row: one token is a decode step."""
    return ATTENTION_DECODE if t == 1 else ATTENTION_PREFILL


def attention_supported(name: str, head_dim: int, cache_shape: tuple[int, ...]) -> bool:
    """Whether the Pallas attention kernel `name` runs these shapes (pantheon.pallas.attention)."""
    if not (16 <= head_dim <= 512 and head_dim & (head_dim - 1) == 0):
        return False
    if name == ATTENTION_DECODE:
        return cache_shape[1] >= 16 and math.prod(cache_shape) < 2 ** 31
    return True


def choose(wanted: dict[str, bool], dtype=jnp.float32) -> Kernels:
    """{kernel name: whether its Pallas kernel runs this program's shapes} -> the static `kernels`
    argument: dispatch's mode per kernel, "reference" where the kernel cannot run the shapes (the
    native decode attention runs a superset of the Pallas kernel's shapes — head dims % 8 — but
    only a float32, float16, bfloat16 or q8_0 cache, and the Pallas kernels no q8_0 one: with a
    `dtype` (the KV cache's) they cannot read it is "reference")."""
    def mode(name: str, ok: bool) -> str:
        chosen = dispatch.kernel_mode(name) if ok else "reference"
        if chosen == "native" and jnp.dtype(dtype) not in NATIVE_CACHE_DTYPES:
            return "reference"
        # the Pallas kernels read f32/f16/bf16 caches; a q8_0 one takes the jnp path there
        return "reference" if chosen in ("pallas", "interpret") and jnp.dtype(dtype) == Q8_0_KV else chosen

    return tuple(sorted((name, mode(name, ok)) for name, ok in wanted.items()))


def _query(q, k_cache):
    """q as the decode kernels take it: in the cache's dtype (bf16 on a GPU: tensor-core dots), or
    f32 against a q8_0 cache (its bytes are not a float type)."""
    return q.astype(jnp.float32 if k_cache.dtype == Q8_0_KV else k_cache.dtype)


def attend(q, k_cache, v_cache, positions, slots, kv_len: int, kernels: Kernels, window: int = 0,
           ring: bool = False) -> jax.Array:
    """Causal GQA attention of this step's queries against the slot cache (already holding this
    step's keys/values). q: [B, T, H, D]; caches [N_slots, C, K, D]; positions int32 [B, T]
    absolute; slots int32 [B]. Returns [B, T, H, D] in q's dtype.

    T == 1 (decode): dispatch.attention_decode reads each row's slot in place, up to its position
    (the reference gathers the first kv_len positions). Otherwise dispatch.attention_prefill on the
    first kv_len positions of the rows' slots. window > 0 (a sliding-window layer): the decode
    kernels (native and Pallas) and the native prefill kernel, which take the window, or the jnp
    path, whose masks take it (the flash prefill kernel does not, yet: `windowed` gives it the
    reference mode); ring: the caches are a sliding layer's rings (state.ring_len) and kv_len the
    model's context."""
    modes = dict(kernels)
    if (window or ring) and q.shape[1] == 1 and modes[ATTENTION_DECODE] != "reference":  # the kernels take both
        out = dispatch.attention_decode(_query(q[:, 0], k_cache), k_cache, v_cache, slots, positions[:, 0] + 1,
                                        mode=modes[ATTENTION_DECODE], window=window, ring=ring)
        return out[:, None].astype(q.dtype)
    if q.shape[1] > 1 and modes[ATTENTION_PREFILL] == "native":
        # the native CPU kernel reads each row's slot in place up to each query's position
        return dispatch.cached_attention_prefill(q, k_cache, v_cache, slots, positions, window, ring)
    if window or modes[attention_kernel(q.shape[1])] == "reference":
        # The jnp path reads each row's slot in key blocks up to its position (the reference's
        # math, blocked): no kv_len gather, cost follows the positions attended.
        from pantheon.pallas.attention import cached_attention_blocked

        return cached_attention_blocked(q, k_cache, v_cache, slots, positions, window=window, ring=ring, length=kv_len)
    # The kernels take q in the cache's dtype (bf16 on a GPU: tensor-core dots, f32 softmax and
    # accumulation inside) and return it in that dtype.
    if q.shape[1] == 1:
        out = dispatch.attention_decode(_query(q[:, 0], k_cache), k_cache, v_cache, slots, positions[:, 0] + 1,
                                        kv_len=kv_len, mode=modes[ATTENTION_DECODE])
        return out[:, None].astype(q.dtype)
    keys, values = k_cache[slots, :kv_len], v_cache[slots, :kv_len]  # [B, S, K, D]
    out = dispatch.attention_prefill(q.astype(keys.dtype), keys, values, positions, mode=modes[ATTENTION_PREFILL])
    return out.astype(q.dtype)


def for_numerics(kernels: Kernels, mode: str) -> Kernels:
    """`llamacpp` numerics keep the jnp prefill attention their agreement with llama.cpp was measured
    on: under 8-bit activation rounding the native kernel's other (equally f32) summation order
    flips near-ties (SmolLM2's "capital" prompt at a llama.cpp top-2 margin of 0.24; Gemma 3's
    teacher-forced top-1 386 -> 380 of 400). `exact` takes the native kernel."""
    if mode != "llamacpp":
        return kernels
    return tuple((name, "reference" if name == ATTENTION_PREFILL and m == "native" else m) for name, m in kernels)


def windowed(kernels: Kernels) -> Kernels:
    """A sliding-window layer's kernels: the decode kernels and the native prefill kernel take a
    window and a ring; a GPU's flash prefill kernel does not, so there prefill takes the reference
    (jnp) path."""
    return tuple((name, "reference" if name == ATTENTION_PREFILL and mode != "native" else mode)
                 for name, mode in kernels)


def attention_modes(t: int, head_dim: int, cache_shape: tuple[int, ...]) -> dict[str, bool]:
    """The attention entry of `choose`'s argument for a program with t queries per row."""
    name = attention_kernel(t)
    return {name: attention_supported(name, head_dim, tuple(cache_shape))}


def program_kv_len(kernels: Kernels, kv_len: int, ctx: int) -> int:
    """The static kv_len a program is traced with. The in-place decode kernel reads each row's cache
    up to its length whatever kv_len is, so its programs all take the cache length: the runner's
    per-kv_len program keys then share one trace and executable instead of compiling one per bucket."""
    modes = dict(kernels)
    if modes.get(ATTENTION_DECODE) is not None or modes.get(ATTENTION_PREFILL) in ("reference", "native"):
        return ctx  # the decode kernel, the native prefill one and the blocked jnp path read the cache in place
    return kv_len
