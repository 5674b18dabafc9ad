"""What serves a model: the dense llama family or the hybrid qwen35moe, one class each.

The runner and engine see only this interface (`family_of(spec)`), so a new architecture is one
more class. `forward(params, state, inputs, *, spec, numerics, kv_len, all_logits, hidden, call)`
runs each compiled program through `call(name, layer, fn, args, static)` (model/step.py), naming
the layer it serves."""

from __future__ import annotations

from typing import Callable

from pantheon.model import llama, qwen35moe, weights
from pantheon.model.spec import HybridSpec
from pantheon.model.state import allocate_kv_cache


class Family:
    """A model family's functions, and what the runner must know of its state."""

    kv_programs: tuple[str, ...]  # programs whose executables depend on the attended length
    can_truncate: bool  # the state can resume from any common prefix (attention-only caches)
    load_params: Callable  # (gguf, spec, *, dtype, device, numerics) -> params
    numerics_for: Callable  # (gguf, spec, mode) -> Numerics
    allocate_state: Callable  # (spec, n_slots, ctx, *, dtype, sharding) -> state
    forward: Callable  # (params, state, inputs, *, spec, numerics, kv_len, all_logits, hidden, call) -> (logits, state)


class Dense(Family):
    """llama, mistral, qwen2/3 (and their MoE), phi3, minicpm, gemma3: attention layers and a KV cache."""

    kv_programs = ("block",)
    can_truncate = True
    load_params = staticmethod(weights.load_params)
    numerics_for = staticmethod(weights.numerics_for)
    allocate_state = staticmethod(allocate_kv_cache)
    forward = staticmethod(llama.forward)


class Hybrid(Family):
    """qwen35moe: Gated-DeltaNet layers (a recurrent state per slot) and gated attention layers."""

    kv_programs = ("attn_block",)
    can_truncate = False
    load_params = staticmethod(qwen35moe.load_params)
    numerics_for = staticmethod(qwen35moe.numerics_for)
    allocate_state = staticmethod(qwen35moe.allocate_state)
    forward = staticmethod(qwen35moe.forward)


DENSE, HYBRID = Dense(), Hybrid()


def family_of(spec) -> Family:
    return HYBRID if isinstance(spec, HybridSpec) else DENSE
