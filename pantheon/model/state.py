"""Per-slot decode state. Dense models hold a KV cache; the hybrid model (HybridState) adds recurrent state.

Layout: k, v are lists of L per-layer arrays [slots + 1, ctx, K, D] (separate buffers, so each
layer program donates and updates its own in place). The extra last slot is scratch: padded batch rows
write there, so a padded row can never disturb a live conversation."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp

from pantheon.model.spec import HybridSpec, ModelSpec


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


@jax.tree_util.register_dataclass
@dataclass
class HybridState:
    """Decode state of a hybrid (attention + Gated DeltaNet) model, slot-indexed like KVCache with the
    last slot as scratch. `k`/`v` hold one buffer per *attention* layer, `conv`/`ssm` one per DeltaNet
    layer, in layer order. Unlike a KV cache the recurrent state summarises the whole prefix: it
    cannot be rewound to an earlier position, only replaced."""

    k: list[jax.Array]  # n_attn x [slots + 1, ctx, K, D]
    v: list[jax.Array]
    conv: list[jax.Array]  # n_rec x [slots + 1, d_conv - 1, conv_dim]: the last pre-conv inputs
    ssm: list[jax.Array]  # n_rec x [slots + 1, H_v, D_k, D_v] float32: the delta-rule matrix
    ctx: int = field(metadata=dict(static=True), default=0)

    @property
    def n_slots(self) -> int:
        return (self.k + self.conv)[0].shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.n_slots

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v + self.conv + self.ssm)

    @property
    def recurrent_nbytes_per_slot(self) -> int:
        """Bytes of one slot's conv + SSM state: what a prefix snapshot of one sequence costs."""
        return sum(a[0].nbytes for a in self.conv + self.ssm)


def allocate_hybrid_state(spec: HybridSpec, n_slots: int, ctx: int, dtype=jnp.float32, sharding=None) -> HybridState:
    """Zeroed buffers for n_slots conversations plus the scratch slot. K/V use `dtype`; the
    recurrent state is always float32 (llama.cpp keeps it F32 too)."""
    n = n_slots + 1
    kv = (n, ctx, spec.n_head_kv, spec.head_dim)
    conv = (n, spec.ssm_d_conv - 1, spec.conv_dim)
    ssm = (n, spec.ssm_dt_rank, spec.ssm_d_state, spec.ssm_d_state)

    def zeros(shape, dt):
        return jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)()
    n_attn, n_rec = len(spec.attention_layers), len(spec.recurrent_layers)
    return HybridState(k=[zeros(kv, dtype) for _ in range(n_attn)], v=[zeros(kv, dtype) for _ in range(n_attn)],
                       conv=[zeros(conv, jnp.float32) for _ in range(n_rec)],
                       ssm=[zeros(ssm, jnp.float32) for _ in range(n_rec)], ctx=ctx)


def export_kv(cache: KVCache, slot: int, n_tok: int) -> dict[str, "np.ndarray"]:
    """The first n_tok positions of one slot, per layer, as host arrays named k.<layer>, v.<layer>."""
    import numpy as np

    out = {}
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        out[f"k.{i}"] = np.asarray(k[slot, :n_tok])
        out[f"v.{i}"] = np.asarray(v[slot, :n_tok])
    return out


@partial(jax.jit, donate_argnums=(0,))
def _write_rows(buf, slot, rows):
    return jax.lax.dynamic_update_slice(buf, rows[None].astype(buf.dtype), (slot, 0, 0, 0))


def import_kv(cache: KVCache, slot: int, arrays: dict) -> KVCache:
    """Install exported rows into `slot` (shapes already validated by the caller)."""
    ks = [_write_rows(k, slot, arrays[f"k.{i}"]) for i, k in enumerate(cache.k)]
    vs = [_write_rows(v, slot, arrays[f"v.{i}"]) for i, v in enumerate(cache.v)]
    return KVCache(ks, vs)


def kv_slot_layout(cache: KVCache, n_tok: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) an exported slot of n_tok positions must have."""
    row = cache.k[0].shape[2:]
    dtype = str(cache.k[0].dtype)
    return {f"{kind}.{i}": ((n_tok, *row), dtype) for i in range(len(cache.k)) for kind in ("k", "v")}
