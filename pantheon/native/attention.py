"""Decode and prefill attention read in place from the slot cache, on the CPU (attention.cc, built by
build.py). The caches hold f32, f16, bf16 or q8_0 blocks (uint8, gguf.arithmetic.q8_0_blocks: a head's
D values in D / 32 * 34 bytes), both alike, read as f32.

`attention_decode` and `attention_prefill` are the custom calls; their reference is the jnp path the CPU otherwise runs,
`pantheon.pallas.attention.cached_attention_blocked` (attention_reference's math), which the tests
compare it with on fresh random caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "pantheon_attention_decode"


def attention_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array,
                     lens: jax.Array, window: int = 0, ring: bool = False) -> jax.Array:
    """q [B, H, D]; caches [N_slots, C, K, D] (see above); slots, lens int32 [B]: row b attends to keys
    0..lens[b]-1 of slot slots[b] (none: zeros). Returns [B, H, D] in q's dtype. window > 0: only
    the last `window` keys (a sliding layer); ring: the caches are rings, position p at p % C."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, slots.astype(jnp.int32), lens.astype(jnp.int32),
               window=np.int64(window), ring=np.int64(ring))
    return out.astype(q.dtype)


PREFILL_TARGET = "pantheon_attention_prefill"


def attention_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array,
                      q_pos: jax.Array, window: int = 0, ring: bool = False) -> jax.Array:
    """Causal attention of a prefill chunk read in place from the slot cache: q [B, T, H, D]; caches
    [N_slots, C, K, D] (see above), already holding the chunk's keys
    and values; slots int32 [B]; q_pos int32 [B, T] absolute positions: query t of row b attends to
    keys 0..q_pos[b, t] of slot slots[b] (none, for q_pos < 0: zeros). Returns [B, T, H, D] in q's
    dtype. window > 0: only keys q_pos - window + 1.. (a sliding layer); ring: the caches are rings,
    position p at p % C, holding the window and the chunk. The reference is cached_attention_blocked."""
    call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, slots.astype(jnp.int32), q_pos.astype(jnp.int32),
               window=np.int64(window), ring=np.int64(ring))
    return out.astype(q.dtype)
