"""Per-slot decode state. Dense models hold a KV cache; the hybrid model adds recurrent state.

Layout: k, v are lists of L per-layer arrays [slots + 1, ctx, K, D] (separate buffers, so each
layer program donates and updates its own in place). The extra last slot is scratch: padded batch rows
write there, so a padded row can never disturb a live conversation."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pantheon.model.spec import ModelSpec


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: list[jax.Array]  # L x [slots + 1, ctx, K, D]
    v: list[jax.Array]

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def ctx(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def kv_cache_shape(spec: ModelSpec, n_slots: int, ctx: int) -> tuple[int, ...]:
    """One layer's buffer."""
    return (n_slots + 1, ctx, spec.n_head_kv, spec.head_dim)


def allocate_kv_cache(spec: ModelSpec, n_slots: int, ctx: int, dtype=jnp.float32, sharding=None) -> KVCache:
    shape = kv_cache_shape(spec, n_slots, ctx)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache([zeros() for _ in range(spec.n_layer)], [zeros() for _ in range(spec.n_layer)])
