"""Lowering for CUDA without a GPU: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
runs the Pallas -> Triton lowering on a CPU-only jaxlib (compute capability 9.0 assumed), which
enforces Triton's rules (power-of-2 block values, supported primitives, no scalar prefetch).

jaxlib > 0.10.2 also compiles the Triton module to PTX during lowering, through a handler only the
CUDA plugin registers. Without it lowering fails *after* the Triton module was built, with exactly
"Platform CUDA does not have a Triton compilation handler": that error (and only that one, and only
on such a jaxlib) counts as "lowered to Triton" — `lower_for_cuda` returns None, with a warning."""

from __future__ import annotations

import importlib.metadata
import warnings

import jax

NO_HANDLER = "Platform CUDA does not have a Triton compilation handler"
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def jaxlib_version() -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:3] if p.isdigit())


def lower_for_cuda(fn, *args) -> str | None:
    """StableHLO text of fn(*args) lowered for CUDA (args may be ShapeDtypeStructs), or None when
    this jaxlib built the Triton module but has no CUDA plugin to compile it to PTX."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - narrowed right below
        if NO_HANDLER in str(e) and jaxlib_version() > (0, 10, 2):
            warnings.warn(f"jaxlib {jaxlib_version()}: Triton module built, PTX compile needs the CUDA plugin")
            return None
        raise


def triton_calls(text: str | None) -> int | None:
    """Triton custom calls in a lowered module (None: not countable, see lower_for_cuda)."""
    return None if text is None else sum(text.count(name) for name in TRITON_CALLS)


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params, or None when this jax has no Triton Pallas backend.

    The class was renamed (TritonCompilerParams -> CompilerParams); look up either by feature."""
    try:
        from jax.experimental.pallas import triton as plt
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    cls = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams", None)
    return None if cls is None else cls(num_warps=num_warps, num_stages=num_stages)
