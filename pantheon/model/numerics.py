"""How closely the forward follows llama.cpp's arithmetic: per weight, whether its activations are
rounded as ggml's CPU backend rounds them (gguf/arithmetic.py) before the product.

"llamacpp" numerics round every quantized matmul's activations to the weight type's vec_dot type
(Q8_0/Q8_1 or Q8_K blocks, f16/bf16 rows) and reproduce the integer dot products exactly up to f32
summation order: on SmolLM2-135M Q4_1 that halves the gap to llama.cpp (last-prompt max |Δ| 1.05 ->
0.69, mean 0.29 -> 0.12). "exact" keeps f32 activations: the mathematically exact product of the
dequantized weights, batch-invariant."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.gguf.arithmetic import NONE


@dataclass(frozen=True)
class Numerics:
    mode: str = "llamacpp"  # or "exact"
    schemes: tuple[tuple[str, str], ...] = ()  # (weight key, activation scheme: gguf.arithmetic.scheme_for)

    def scheme(self, key: str) -> str:
        if self.mode == "exact":
            return NONE
        return dict(self.schemes).get(key, NONE)
