"""Per-slot decode state. Dense models hold a KV cache; the hybrid model adds recurrent state.

Layout: k, v are [L, slots + 1, ctx, K, D]. The extra last slot is scratch: padded batch rows
write there, so a padded row can never disturb a live conversation."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pantheon.model.spec import ModelSpec


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, slots + 1, ctx, K, D]
    v: jax.Array

    @property
    def n_slots(self) -> int:
        return self.k.shape[1] - 1

    @property
    def scratch_slot(self) -> int:
        return self.k.shape[1] - 1

    @property
    def ctx(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def kv_cache_shape(spec: ModelSpec, n_slots: int, ctx: int) -> tuple[int, ...]:
    return (spec.n_layer, n_slots + 1, ctx, spec.n_head_kv, spec.head_dim)


def allocate_kv_cache(spec: ModelSpec, n_slots: int, ctx: int, dtype=jnp.float32, sharding=None) -> KVCache:
    shape = kv_cache_shape(spec, n_slots, ctx)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(zeros(), zeros())
