"""Per-slot decode state. Dense models hold a KV cache; the hybrid model (HybridState) adds recurrent state.

Layout: k, v are lists of L per-layer arrays [slots + 1, ctx, K, D] (separate buffers, so each
layer program donates and updates its own in place). The extra last slot is scratch: padded batch rows
write there, so a padded row can never disturb a live conversation."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

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


# ---- one slot's state as host arrays (session export / restore) -------------------------------------
# Buffers are the list-valued fields of a state dataclass (k, v, and for hybrid models conv, ssm),
# exported as "<field>.<i>". Position-indexed buffers (k, v) export their first n_tok positions;
# recurrent buffers export the slot's whole row.
POSITIONAL = ("k", "v")


def _buffers(state):
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, list):
            yield f.name, value


def export_slot(state, slot: int, n_tok: int) -> dict[str, np.ndarray]:
    out = {}
    for name, bufs in _buffers(state):
        for i, buf in enumerate(bufs):
            out[f"{name}.{i}"] = np.asarray(buf[slot, :n_tok] if name in POSITIONAL else buf[slot])
    return out


@partial(jax.jit, donate_argnums=(0,))
def _write_row(buf, slot, row):
    return jax.lax.dynamic_update_slice(buf, row[None].astype(buf.dtype), (slot,) + (0,) * (buf.ndim - 1))


def _install(buf, slot: int, row):
    if isinstance(buf, np.ndarray):  # a host-resident layer (the KV allocation fallback)
        buf[slot] = 0
        buf[slot, :row.shape[0]] = row
        return buf
    return _write_row(buf, slot, row)


def import_slot(state, slot: int, arrays: dict):
    """Install exported arrays into `slot` (shapes already validated by the caller)."""
    updates = {name: [_install(buf, slot, arrays[f"{name}.{i}"]) for i, buf in enumerate(bufs)]
               for name, bufs in _buffers(state)}
    return dataclasses.replace(state, **updates)


def slot_layout(state, n_tok: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) that an exported slot of n_tok positions has."""
    out = {}
    for name, bufs in _buffers(state):
        for i, buf in enumerate(bufs):
            row = buf.shape[1:]
            out[f"{name}.{i}"] = ((n_tok, *row[1:]) if name in POSITIONAL else tuple(row), str(buf.dtype))
    return out
