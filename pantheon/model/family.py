"""Which functions serve a model: the dense llama family or the hybrid qwen35moe.

The runner and engine only see this table, so a new architecture is one more row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pantheon.model import llama, qwen35moe, weights
from pantheon.model.spec import HybridSpec
from pantheon.model.state import allocate_kv_cache


@dataclass(frozen=True)
class Family:
    load_params: Callable  # (gguf, spec, dtype=, device=, numerics=) -> params
    numerics_for: Callable  # (gguf, spec, mode) -> Numerics
    allocate_state: Callable  # (spec, n_slots, ctx, dtype=, sharding=) -> state
    forward: Callable  # (params, state, tokens, positions, slots, logit_index, *, spec, numerics, kv_len, ...)
    kv_programs: tuple[str, ...]  # programs whose executables depend on the attended length
    can_truncate: bool  # the state can resume from any common prefix (attention-only caches)


DENSE = Family(weights.load_params, weights.numerics_for, allocate_kv_cache, llama.forward, ("block",), True)
HYBRID = Family(qwen35moe.load_params, qwen35moe.numerics_for, qwen35moe.allocate_state, qwen35moe.forward,
                ("attn_block",), False)


def family_of(spec) -> Family:
    return HYBRID if isinstance(spec, HybridSpec) else DENSE
