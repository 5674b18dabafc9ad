"""Per-slot decode state. Dense models hold a KV cache; the hybrid model (HybridState) adds recurrent state.

Layout: k, v are lists of L per-layer arrays [slots + 1, ctx, K, D] (separate buffers, so each
layer program donates and updates its own in place). The extra last slot is scratch: padded batch rows
write there, so a padded row can never disturb a live conversation.

A sliding-window layer (gemma3's; every layer of a mistral file) whose window is much shorter than
the context holds a ring instead, [slots + 1, R, K, D] with R = ring_len(): position p lives at
p % R, and the ring keeps the last R positions written, which hold the window of every query a
program can bring (R >= window + RING_WRITES). Its memory is bounded by the window, as llama.cpp's
SWA cache is. A slot can then only resume from a prefix whose window the ring still holds: `rewind`
positions back from its end."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.gguf.arithmetic import q8_0_blocks
from pantheon.model.dtypes import Q8_0_KV, kv_head_width
from pantheon.model.spec import HybridSpec, ModelSpec

# The most positions one program writes to a row (the runner's largest prefill chunk), and the
# positions a ring keeps beyond the window and one such write: how far a slot can rewind.
RING_WRITES = 512
RING_SPARE = 512
RING_ALIGN = 256  # the blocked jnp attention's key blocks divide it: a block never wraps


def ring_len(spec: ModelSpec, ctx: int) -> int:
    """The length of a sliding layer's ring for a context of ctx, or 0 where the whole context is
    held (no sliding layers, or a window not much shorter than the context)."""
    if not any(spec.swa_layers) or not spec.swa_window:
        return 0
    r = -(-(spec.swa_window + RING_WRITES + RING_SPARE) // RING_ALIGN) * RING_ALIGN
    return r if r < ctx else 0


def rewind(spec: ModelSpec, ctx: int) -> int | None:
    """How many positions back from the end of its history a slot can resume (None: any): the
    positions [n - window, n) a resumed prefix needs were overwritten in a ring once positions
    R - window - RING_WRITES past n (a write's padding included) were written."""
    r = ring_len(spec, ctx)
    return r - spec.swa_window - RING_WRITES if r else None


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: list[jax.Array]  # L x [slots + 1, ctx (or a sliding layer's ring), K, D]
    v: list[jax.Array]
    ctx: int = field(metadata=dict(static=True), default=0)

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of a layer holding the whole context (kernels are chosen from it)."""
        return (self.k[0].shape[0], self.ctx, *self.k[0].shape[2:])

    def is_ring(self, layer: int) -> bool:
        return self.k[layer].shape[1] < self.ctx

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def kv_cache_shape(spec: ModelSpec, n_slots: int, ctx: int, dtype=jnp.float32) -> tuple[int, ...]:
    """One layer's buffer (a q8_0 cache holds each head's values as D / 32 * 34 bytes)."""
    return (n_slots + 1, ctx, spec.n_head_kv, kv_head_width(dtype, spec.head_dim))


def kv_write(values: jax.Array, dtype) -> jax.Array:
    """Keys or values [..., D] as a cache of `dtype` stores them: cast, or q8_0's bytes."""
    return q8_0_blocks(values) if jnp.dtype(dtype) == Q8_0_KV else values.astype(dtype)


def layer_lengths(spec: ModelSpec, ctx: int, windowed: bool = True) -> list[int]:
    """Each layer's cache length: ctx, or a sliding layer's ring (windowed=False: ctx everywhere)."""
    r = ring_len(spec, ctx) if windowed else 0
    return [r if r and spec.swa_layers[i] else ctx for i in range(spec.n_layer)]


def allocate_kv_cache(spec: ModelSpec, n_slots: int, ctx: int, dtype=jnp.float32, sharding=None,
                      windowed: bool = True) -> KVCache:
    """Zeroed buffers; sliding layers as rings unless windowed=False (the whole context: tests
    compare the two)."""
    def zeros(n):
        shape = kv_cache_shape(spec, n_slots, n, dtype)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    lengths = layer_lengths(spec, ctx, windowed)
    return KVCache([zeros(n) for n in lengths], [zeros(n) for n in lengths], ctx)


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
    def layer_shape(self) -> tuple[int, ...]:
        return tuple(self.k[0].shape)

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
    kv = (n, ctx, spec.n_head_kv, kv_head_width(dtype, spec.head_dim))
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
# recurrent buffers and rings export the slot's whole row.
POSITIONAL = ("k", "v")


def _by_position(state, name: str, buf) -> bool:
    return name in POSITIONAL and buf.shape[1] >= state.ctx


def _buffers(state):
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, list):
            yield f.name, value


def positional(state) -> frozenset[str]:
    """The names of the buffers exported by position (their first n_tok rows)."""
    return frozenset(f"{name}.{i}" for name, bufs in _buffers(state) for i, buf in enumerate(bufs)
                     if _by_position(state, name, buf))


def export_slot(state, slot: int, n_tok: int) -> dict[str, np.ndarray]:
    out = {}
    for name, bufs in _buffers(state):
        for i, buf in enumerate(bufs):
            out[f"{name}.{i}"] = np.asarray(buf[slot, :n_tok] if _by_position(state, name, buf) else buf[slot])
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


def export_rows(state, slot: int) -> dict[str, np.ndarray]:
    """The slot's buffers held as whole rows (sliding rings, recurrent states): what a prefix's
    attention positions do not hold, so they cannot be rewound; {} where every buffer is positional."""
    return {f"{name}.{i}": np.asarray(buf[slot]) for name, bufs in _buffers(state) for i, buf in enumerate(bufs)
            if not _by_position(state, name, buf)}


def import_slot(state, slot: int, arrays: dict):
    """Install exported arrays into `slot` (shapes already validated by the caller); buffers not
    in `arrays` keep what they hold (export_rows' arrays install the rows alone)."""
    updates = {name: [_install(buf, slot, arrays[f"{name}.{i}"]) if f"{name}.{i}" in arrays else buf
                      for i, buf in enumerate(bufs)] for name, bufs in _buffers(state)}
    return dataclasses.replace(state, **updates)


def slot_layout(state, n_tok: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) that an exported slot of n_tok positions has."""
    out = {}
    for name, bufs in _buffers(state):
        for i, buf in enumerate(bufs):
            row = buf.shape[1:]
            out[f"{name}.{i}"] = ((n_tok, *row[1:]) if _by_position(state, name, buf) else tuple(row), str(buf.dtype))
    return out
