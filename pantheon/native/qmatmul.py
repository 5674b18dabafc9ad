"""Matrix products against weights kept in ggml's quant blocks, on the CPU.

XLA:CPU has no quantized matmul, and no int8/bf16 formulation of its own streams faster than f32
(research/jax_feasibility.md §4); but batch decode reads every weight once per token, so the bytes
read bound it: SmolLM2-135M is 538 MB as f32 and 85 MB as Q4_1/Q8_0 blocks. `qmatmul` is an XLA FFI
custom call (qmatmul.cc) that reads the blocks and dequantizes in registers, inside the compiled
program like any other op. `qmatmul_reference` is the same product in plain jnp (dequantize, then
einsum): the kernel is tested against it.

Where the native library cannot be built (build.py: no compiler, no AVX2, PANTHEON_NATIVE=0),
`build.available()` is False and the models keep their f32 weights only."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.gguf.quants import dequantize

TARGET = "pantheon_qmatmul"
# ggml type id -> bytes per 32-weight block
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class QMatrix:
    """A weight W [n_out, n_in] as ggml blocks: `blocks` uint8 [n_out, n_in / 32 * block bytes], each
    row the blocks of one output (the GGUF layout). qtype: the ggml type id."""

    blocks: jax.Array
    qtype: int
    n_in: int

    @property
    def n_out(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    def tree_flatten(self):
        return (self.blocks,), (self.qtype, self.n_in)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def supported(ggml_type: int) -> bool:
    return int(ggml_type) in BLOCK_BYTES


def qmatmul(x: jax.Array, w: QMatrix) -> jax.Array:
    """x [..., n_in] f32 -> x W^T [..., n_out], through the native kernel."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.n_in).astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.n_out), jnp.float32))
    return call(x2, w.blocks, qtype=np.int64(w.qtype)).reshape(*lead, w.n_out)


def qmatmul_reference(x: jax.Array, w: QMatrix) -> jax.Array:
    """The product in plain jnp: dequantize (pantheon.gguf.quants), then einsum."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dequantize(w.blocks, w.qtype),
                      precision=jax.lax.Precision.HIGHEST)


def embed_rows(w: QMatrix, ids: jax.Array) -> jax.Array:
    """Rows `ids` of W, dequantized: the embedding lookup of a tied, quantized head."""
    return dequantize(jnp.take(w.blocks, ids, axis=0), w.qtype)
