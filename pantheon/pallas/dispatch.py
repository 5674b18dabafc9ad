"""Which implementation each kernel runs: the Pallas kernel, the same kernel interpreted, or the
plain-jnp reference.

One rule for every kernel, so the serve path, the tests and the profile script agree:

* GPU backends (``cuda``, ``rocm``, ``gpu``): ``"pallas"`` (Triton lowering).
* everything else (the CPU serve path, TPU): ``"reference"``. Interpreted Pallas is a correctness
  tool, 1-11x slower than the jnp reference on CPU, so it is never chosen by default.
* ``PANTHEON_KERNELS`` overrides: ``pallas``, ``interpret`` or ``reference`` for every kernel, or a
  comma list ``attention_decode=reference,moe_q3k=interpret`` (a bare mode in the list sets the
  default for the rest). ``pallas`` on a backend that cannot lower it is an error, not a silent
  fallback.

``kernel_choices()`` reports the current choice per kernel name, for the residency counters.
Kernels take ``interpret`` as a static argument; ``interpret_flag(mode)`` maps a mode to it.
``attention_prefill``, ``attention_decode`` and ``moe_ffn`` below are the model's entry points:
they pick the implementation by these rules and call it.
"""

from __future__ import annotations

import os

import jax

KERNELS = ("attention_prefill", "attention_decode", "moe_q3k", "deltanet")
MODES = ("pallas", "interpret", "reference")
ENV = "PANTHEON_KERNELS"
GPU_BACKENDS = frozenset({"cuda", "rocm", "gpu"})


def _parse(value: str) -> tuple[str | None, dict[str, str]]:
    """PANTHEON_KERNELS text -> (default mode or None, {kernel: mode})."""
    default, per = None, {}
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        name, sep, mode = part.partition("=")
        name, mode = name.strip(), mode.strip()
        if not sep:
            name, mode = None, name
        if mode not in MODES:
            raise ValueError(f"{ENV}: unknown mode {mode!r} in {value!r} (expected one of {', '.join(MODES)})")
        if name is None:
            default = mode
        elif name not in KERNELS:
            raise ValueError(f"{ENV}: unknown kernel {name!r} in {value!r} (kernels: {', '.join(KERNELS)})")
        else:
            per[name] = mode
    return default, per


def default_mode(backend: str) -> str:
    return "pallas" if backend in GPU_BACKENDS else "reference"


def kernel_mode(name: str, backend: str | None = None, env: str | None = None) -> str:
    """The mode kernel `name` runs in on `backend` (default: jax.default_backend()).

    `env` defaults to os.environ[PANTHEON_KERNELS]. Raises ValueError for an unknown kernel, a
    malformed override, or "pallas" forced on a backend without a Pallas GPU lowering."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r} (kernels: {', '.join(KERNELS)})")
    backend = backend or jax.default_backend()
    env = os.environ.get(ENV, "") if env is None else env
    default, per = _parse(env)
    mode = per.get(name, default) or default_mode(backend)
    if mode == "pallas" and backend not in GPU_BACKENDS:
        raise ValueError(f"{ENV} asks for compiled Pallas kernels ({name}) but the backend is {backend!r}; "
                         f"Pallas kernels here lower only for GPU (use 'interpret' or 'reference')")
    return mode


def kernel_choices(backend: str | None = None, env: str | None = None) -> dict[str, str]:
    """{kernel name: mode} for every kernel in KERNELS; a kernel whose forced mode is impossible on
    this backend reports "error: <reason>" instead of raising."""
    out = {}
    for name in KERNELS:
        try:
            out[name] = kernel_mode(name, backend, env)
        except ValueError as e:
            if "unknown" in str(e):
                raise
            out[name] = f"error: {e}"
    return out


def interpret_flag(mode: str) -> bool:
    """The `interpret` argument of a Pallas kernel for a non-reference mode."""
    if mode not in ("pallas", "interpret"):
        raise ValueError(f"mode {mode!r} does not run a Pallas kernel")
    return mode == "interpret"


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params, or None when this jax has no Triton Pallas backend.

    The class was renamed (TritonCompilerParams -> CompilerParams); look up either by feature."""
    try:
        from jax.experimental.pallas import triton as plt
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    cls = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams", None)
    return None if cls is None else cls(num_warps=num_warps, num_stages=num_stages)


# ---- entry points for the model -------------------------------------------------------------------
# Each resolves its mode when traced (inside jit: once per compiled program; PANTHEON_KERNELS changes
# after that need a new trace) and calls the kernel or its reference. Imports are local because the
# kernel modules import this one.
def attention_prefill(q, k, v, q_pos, backend: str | None = None):
    """Causal GQA attention, q [B, T, H, D], k/v [B, S, K, D], q_pos [B, T] -> [B, T, H, D]
    (pantheon.pallas.attention.flash_attention or attention_reference)."""
    from pantheon.pallas import attention

    mode = kernel_mode("attention_prefill", backend)
    if mode == "reference":
        return attention.attention_reference(q, k, v, q_pos)
    return attention.flash_attention(q, k, v, q_pos, interpret=interpret_flag(mode))


def attention_decode(q, k_cache, v_cache, slots, lengths, backend: str | None = None):
    """One query per row against its cache slot: q [B, H, D], caches [N_slots, C, K, D], slots and
    lengths int [B] -> [B, H, D] (decode_attention or decode_attention_reference)."""
    from pantheon.pallas import attention

    mode = kernel_mode("attention_decode", backend)
    if mode == "reference":
        return attention.decode_attention_reference(q, k_cache, v_cache, slots, lengths)
    return attention.decode_attention(q, k_cache, v_cache, slots, lengths, interpret=interpret_flag(mode))


def moe_ffn(x, router_logits, top_k: int, gate, up, down, schemes=None, backend: str | None = None):
    """Routed Q3_K experts, x [T, D], router_logits [T, E] -> [T, D] (pantheon.pallas.moe_q3k.moe_ffn
    with impl = this kernel's mode; schemes: activation rounding for gate, up, down)."""
    from pantheon.pallas import moe_q3k

    return moe_q3k.moe_ffn(x, router_logits, top_k, gate, up, down, impl=kernel_mode("moe_q3k", backend),
                           schemes=None if schemes is None else tuple(schemes))
