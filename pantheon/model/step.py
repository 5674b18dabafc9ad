"""The per-die full-step program (the contract's `segment` graph class): one decode step of every
layer — embed, all blocks, head — traced into a single executable per batch bucket.

The per-layer programs (`llama.forward` / `qwen35moe.forward` calling each program separately) stay
the prefill path and this program's fallback. One program per step removes ~30 program dispatches
(and their argument handling and thread-pool round trips) per token: on a 2-core CPU a SmolLM2
decode step went from 44 to 37 ms; on a GPU it is the difference between launch-bound and
bandwidth-bound decode. Compile time grows with the layer count (2-4 s for SmolLM2's 30 layers on
2 cores); the persistent compilation cache pays it once."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax


class StepInputs(NamedTuple):
    """One step's rows, as every family's `forward` takes them (a pytree)."""

    tokens: Any  # int32 [B, T]
    positions: Any  # int32 [B, T], absolute
    slots: Any  # int32 [B], the cache slot each row writes and reads
    logit_index: Any  # int32 [B], the position in T whose logits are returned (the row's last real token)


# How a family's `forward` runs each of its compiled programs: call(name, layer, fn, args, static),
# layer the model layer it serves (-1: embed, head). The runner passes its own (graph registry,
# per-layer keys, fault injection); `direct` just calls.
LayerCall = Callable[[str, int, Callable, tuple, dict], Any]


def direct(name: str, layer: int, fn: Callable, args: tuple, static: dict):
    return fn(*args, **static)


@partial(jax.jit, static_argnames=("forward", "spec", "numerics", "kv_len"), donate_argnames=("state",))
def full_step(params, state, inputs: StepInputs, *, forward: Callable, spec, numerics, kv_len: int):
    """`forward` (a family's, with its default direct calls) as one program: the nested jitted
    layer functions are inlined into it. Returns (logits [B, V], the new state); `state` is donated."""
    return forward(params, state, inputs, spec=spec, numerics=numerics, kv_len=kv_len)
