"""Which implementation each kernel runs: the Pallas kernel, the same kernel interpreted, or the
plain-jnp reference.

One rule for every kernel, so the serve path, the tests and the profile script agree:

* GPU backends (``cuda``, ``rocm``, ``gpu``): ``"pallas"`` (Triton lowering).
* the CPU: ``"native"`` for ``attention_decode`` and ``attention_prefill`` where Pantheon's native CPU kernels are built
  (pantheon/native/build.py: x86 AVX2 and a C++ compiler), else ``"reference"``.
* everything else (TPU): ``"reference"``. Interpreted Pallas is a correctness tool, 1-11x slower
  than the jnp reference on CPU, so it is never chosen by default.
* ``PANTHEON_KERNELS`` overrides: ``pallas``, ``interpret``, ``reference`` or ``native`` for every
  kernel, or a comma list ``attention_decode=reference,moe_q3k=interpret`` (a bare mode in the list
  sets the default for the rest; a bare ``native`` applies to the kernels that have one). ``pallas``
  on a backend that cannot lower it, or ``native`` where it is not built, is an error, not a silent
  fallback.

``kernel_choices()`` reports the current choice per kernel name, for the residency counters.
Kernels take ``interpret`` as a static argument; ``interpret_flag(mode)`` maps a mode to it.
``attention_prefill``, ``attention_decode``, ``moe_ffn``, ``deltanet``, ``deltanet_step`` and
``quantized_matmul`` below are the model's entry points: they pick the implementation by these rules
and call it.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from pantheon.config import ENV_KERNELS, kernel_overrides
from pantheon.faults import FAULTS

KERNELS = ("attention_prefill", "attention_decode", "moe_q3k", "deltanet", "qmatmul")
MODES = ("pallas", "interpret", "reference", "native")
NATIVE_KERNELS = ("attention_decode", "attention_prefill")  # those with a native CPU implementation (pantheon/native)
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
            raise ValueError(f"{ENV_KERNELS}: unknown mode {mode!r} in {value!r} (expected one of {', '.join(MODES)})")
        if name is None:
            default = mode
        elif name not in KERNELS:
            raise ValueError(f"{ENV_KERNELS}: unknown kernel {name!r} in {value!r} (kernels: {', '.join(KERNELS)})")
        else:
            per[name] = mode
    return default, per


def default_mode(backend: str, name: str | None = None) -> str:
    if backend in GPU_BACKENDS:
        return "pallas"
    return "native" if name in NATIVE_KERNELS and _native_unavailable(backend) is None else "reference"


def _native_unavailable(backend: str) -> str | None:
    """Why the native CPU kernels cannot run on `backend`, or None when they can (built here)."""
    if backend != "cpu":
        return f"backend {backend!r}"
    from pantheon.native import build

    return build.unavailable_reason()


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pantheon_lowering_target", default=None)


@contextlib.contextmanager
def lowering_for(backend: str):
    """Choose kernels as on `backend` while tracing inside this block: ahead-of-time lowering for
    another platform (profiles/gpu_check.py --lower-only lowers the CUDA programs on a CPU)."""
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def kernel_mode(name: str, backend: str | None = None, env: str | None = None) -> str:
    """The mode kernel `name` runs in on `backend` (default: the `lowering_for` target, else
    jax.default_backend()).

    `env` defaults to PANTHEON_KERNELS (kernel_overrides). Raises ValueError for an unknown kernel, a
    malformed override, or "pallas" forced on a backend without a Pallas GPU lowering."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r} (kernels: {', '.join(KERNELS)})")
    backend = backend or _TARGET.get() or jax.default_backend()
    env = kernel_overrides() if env is None else env
    default, per = _parse(env)
    mode = per.get(name) or default or default_mode(backend, name)
    if mode == "native" and name not in per and name not in NATIVE_KERNELS:
        mode = default_mode(backend, name)  # a bare `native` covers the kernels that have one
    if mode == "native":
        if name not in NATIVE_KERNELS:
            raise ValueError(f"{ENV_KERNELS}: {name} has no native kernel (native: {', '.join(NATIVE_KERNELS)})")
        reason = _native_unavailable(backend)
        if reason is not None:
            raise ValueError(f"{ENV_KERNELS} asks for the native {name} kernel but it is not available here ({reason})")
    if mode == "pallas" and backend not in GPU_BACKENDS:
        raise ValueError(f"{ENV_KERNELS} asks for compiled Pallas kernels ({name}) but the backend is {backend!r}; "
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


# ---- entry points for the model -------------------------------------------------------------------
# Each resolves its mode when traced (inside jit: once per compiled program; PANTHEON_KERNELS changes
# after that need a new trace) and calls the kernel or its reference. Imports are local because the
# kernel modules import this one. `mode`, when given, is a mode the caller already resolved: the
# model programs resolve theirs before tracing and pass them as a static argument
# (pantheon.model.kernels), so the jit cache key records which implementation each program runs.
def _mode(name: str, backend: str | None, mode: str | None) -> str:
    if mode is None:
        mode = kernel_mode(name, backend)
    if mode not in MODES:
        raise ValueError(f"{name}: unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    if mode != "reference":
        if FAULTS.take("lowering"):  # a test's stand-in for a Triton/XLA lowering failure
            raise KernelLoweringError(f"injected lowering failure of the {mode} {name} kernel")
    return mode


class KernelLoweringError(RuntimeError):
    """A kernel could not be lowered for this program (injected by the `lowering` fault)."""


def attention_prefill(q, k, v, q_pos, backend: str | None = None, *, mode: str | None = None):
    """Causal GQA attention, q [B, T, H, D], k/v [B, S, K, D], q_pos [B, T] -> [B, T, H, D]
    (pantheon.pallas.attention.flash_attention or attention_reference)."""
    from pantheon.pallas import attention

    mode = _mode("attention_prefill", backend, mode)
    if mode == "reference":
        return attention.attention_reference(q, k, v, q_pos)
    if mode == "native":  # row b's keys as slot b of a cache
        return cached_attention_prefill(q, k, v, jnp.arange(q.shape[0], dtype=jnp.int32), q_pos)
    return attention.flash_attention(q, k, v, q_pos, interpret=interpret_flag(mode))


def cached_attention_prefill(q, k_cache, v_cache, slots, q_pos, window: int = 0, ring: bool = False):
    """The native CPU prefill attention (`attention_prefill` in mode "native"): a chunk's queries q
    [B, T, H, D] at absolute positions q_pos [B, T] against their slots' caches [N_slots, C, K, D],
    read in place (pantheon.native.attention.attention_prefill; its reference is
    attention.cached_attention_blocked); window, ring: a sliding layer's, as there."""
    from pantheon.native.attention import attention_prefill as native_prefill

    return native_prefill(q, k_cache, v_cache, slots, q_pos, window, ring)


def attention_decode(q, k_cache, v_cache, slots, lengths, backend: str | None = None, *,
                     kv_len: int | None = None, mode: str | None = None, window: int = 0, ring: bool = False):
    """One query per row against its cache slot: q [B, H, D], caches [N_slots, C, K, D], slots and
    lengths int [B] -> [B, H, D] (decode_attention, decode_attention_reference, or on the CPU the
    native kernel, pantheon.native.attention).

    kv_len: optional static bound, every length <= kv_len. The reference then gathers only the
    first kv_len positions of each row's slot (as the model did before the kernels); the kernel
    ignores it, as it reads each row's cache in place up to its length. window, ring: a sliding
    layer's (the kernels: the reference takes none, such layers take cached_attention_blocked)."""
    from pantheon.pallas import attention

    mode = _mode("attention_decode", backend, mode)
    if mode == "native":
        from pantheon.native.attention import attention_decode as native_decode

        return native_decode(q, k_cache, v_cache, slots, lengths, window, ring)
    if mode == "reference" and (window or ring):
        raise ValueError("attention_decode: a sliding window in reference mode (cached_attention_blocked takes one)")
    if mode == "reference":
        if kv_len is not None and kv_len < k_cache.shape[1]:
            k_cache, v_cache = k_cache[:, :kv_len], v_cache[:, :kv_len]
        return attention.decode_attention_reference(q, k_cache, v_cache, slots, lengths)
    return attention.decode_attention(q, k_cache, v_cache, slots, lengths, interpret=interpret_flag(mode),
                                      window=window, ring=ring)


def moe_ffn(x, router_logits, top_k: int, gate, up, down, schemes=None, backend: str | None = None, *,
            mode: str | None = None):
    """Routed Q3_K experts, x [T, D], router_logits [T, E] -> [T, D] (pantheon.pallas.moe.moe_ffn
    with impl = this kernel's mode; schemes: activation rounding for gate, up, down)."""
    from pantheon.pallas import moe

    return moe.moe_ffn(x, router_logits, top_k, gate, up, down, impl=_mode("moe_q3k", backend, mode),
                           schemes=None if schemes is None else tuple(schemes))


def deltanet(q, k, v, g, beta, state, lengths=None, backend: str | None = None, *, chunk: int = 64,
             mode: str | None = None):
    """Gated delta rule over a chunk of tokens: q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H],
    state [B, H, Dk, Dv], lengths int [B] or None -> (out [B, T, H, Dv], new state), both float32
    (pantheon.pallas.deltanet.gated_delta_rule with `chunk`, or gated_delta_rule_reference)."""
    from pantheon.pallas import deltanet as dn

    mode = _mode("deltanet", backend, mode)
    if mode == "reference":
        return dn.gated_delta_rule_reference(q, k, v, g, beta, state, lengths)
    return dn.gated_delta_rule(q, k, v, g, beta, state, lengths, chunk=chunk, interpret=interpret_flag(mode))


def deltanet_step(q, k, v, g, beta, state_cache, slots, backend: str | None = None, *, mode: str | None = None):
    """One decode token per row against the slot-indexed SSM state: q, k [B, H, Dk], v [B, H, Dv],
    g, beta [B, H], state_cache float32 [N_slots, H, Dk, Dv], slots int [B] -> (out [B, H, Dv]
    float32, updated state_cache) (gated_delta_rule_step, in place, or its reference). Same
    "deltanet" mode as the prefill entry point."""
    from pantheon.pallas import deltanet as dn

    mode = _mode("deltanet", backend, mode)
    if mode == "reference":
        return dn.gated_delta_rule_step_reference(q, k, v, g, beta, state_cache, slots)
    return dn.gated_delta_rule_step(q, k, v, g, beta, state_cache, slots, interpret=interpret_flag(mode))


def quantized_matmul(x, p, group_sizes=None, backend: str | None = None, *, mode: str | None = None):
    """x [M, K] against weights kept in their quant blocks (pantheon.pallas.qmatmul.QPlanes) ->
    float32 [M, N]: the dense product, or with group_sizes the grouped one (rows sorted by expert)."""
    from pantheon.pallas import qmatmul as qm

    mode = _mode("qmatmul", backend, mode)
    if mode == "reference":
        x = x.astype(jnp.float32)
        return qm.qmatmul_reference(x, p) if group_sizes is None else qm.grouped_qmatmul_reference(x, group_sizes, p)
    interpret = interpret_flag(mode)
    if group_sizes is None:
        return qm.qmatmul(x, p, block_m=16 if x.shape[0] <= 16 else 64, interpret=interpret, out_dtype=jnp.float32)
    return qm.grouped_qmatmul(x, group_sizes, p, interpret=interpret, out_dtype=jnp.float32)
