"""The one registry of compiled step executables — XLA's stand-in for CUDA-graph capture.

Every compiled program the runner calls goes through `call`, keyed by (step kind, class, layer,
shape bucket): a *slot* per layer and bucket, as the contract's `graphs` counters count them. The
executable behind a slot is compiled once (AOT: `jit.lower(...).compile()`) and shared by every
layer that runs the same program at the same shapes. `jax.stages.Compiled` is shape-strict, so a
wrong bucket is a TypeError, never a silent retrace. A failed compile falls back to the program
traced with its kernels on the jnp reference (correct output, no AOT executable), is retried on a
bounded backoff, and gives up after `max_retries`. Classes (the contract's names): batched_attn / batched_ssm (multi-user
decode layers), single_ssm (one-row DeltaNet decode), segment (embed, head, sampler); prefill
layers are counted as `prefill`."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import jax

from pantheon.faults import FAULTS, InjectedFault

log = logging.getLogger(__name__)


def forget_traces() -> None:
    """Drop jax's own caches of traced jaxprs, lowered modules and compiled executables. The
    registry holds every executable it calls, so for its programs these are a second copy nothing
    calls again: ~1.5-2 MB of heap a program (Gemma 3 270M's warm-up of 52 programs: ~100 MB of
    RSS, measured). Jitted helpers outside the registry trace once more on their next call."""
    jax.clear_caches()


def abstract(x):
    """An array's ShapeDtypeStruct (with its sharding); anything else unchanged."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def reference_kernels(static: dict) -> dict:
    """`static` with every kernel of its `kernels` argument (model/kernels.py) on the reference."""
    if "kernels" not in static:
        return static
    return dict(static, kernels=tuple((name, "reference") for name, _ in static["kernels"]))


def signature(args: tuple) -> Hashable:
    """What an executable is compiled for besides its static arguments: the pytree structure (QMatrix
    types included) and each leaf's shape and dtype."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a) for a in leaves)


@dataclass(frozen=True)
class GraphKey:
    kind: str  # "prefill", "decode", "sample"
    layer_class: str  # "batched_attn", "batched_ssm", "single_ssm", "segment", "prefill", ...
    bucket: Hashable  # the static shape bucket, e.g. (batch, chunk, kv_len)
    layer: int = -1  # the model layer this slot serves (-1: not a per-layer program)
    program: str = ""  # which program (block, attn_block, ssm_block, embed, head, sample)


@dataclass
class _Executable:
    compiled: Any = None
    failures: int = 0
    next_retry: float = 0.0
    gave_up: bool = False
    compile_s: float = 0.0
    retry: tuple | None = None  # (fn, abstract args, static, key) to recompile from, after a failure


@dataclass
class _Slot:
    exe: _Executable
    ineligible: bool = False
    calls: int = 0


@dataclass
class GraphRegistry:
    max_retries: int = 3
    backoff_s: float = 1.0
    _slots: dict[GraphKey, _Slot] = field(default_factory=dict)
    _exes: dict[Hashable, _Executable] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    captures: int = 0
    capture_failures: int = 0
    forget_traces: bool = False  # drop jax's caches after each compile (set once serving: warm_up)

    def call(self, key: GraphKey, fn: Callable, args: tuple, static: dict | None = None):
        """Run `fn(*args, **static)` through the compiled executable of `key`'s program. Without
        one (its compile failed; retried on the backoff) the program runs traced again with its
        kernels on the jnp reference — the direct kernel body — so a kernel that cannot be lowered
        does not fail the same way twice."""
        static = static or {}
        compiled = self.executable(key, fn, args, static)
        return compiled(*args) if compiled is not None else fn(*args, **reference_kernels(static))

    def _slot(self, key: GraphKey, fn: Callable, args: tuple, static: dict) -> _Slot:
        """key's slot; slots of the same program at the same shapes share one executable."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(self._exe(key, fn, args, static))
            return slot

    def _exe(self, key: GraphKey, fn: Callable, args: tuple, static: dict) -> _Executable:
        # The arguments' structure and shapes are part of the key: layers of one program may hold
        # different weights (a Q4_K_M file's Q6_K attn_v in some layers: no fused wqkv there).
        exe_key = (id(fn), key.kind, key.program, key.bucket, tuple(sorted(static.items(), key=str)), signature(args))
        return self._exes.setdefault(exe_key, _Executable())

    def precompile(self, key: GraphKey, fn: Callable, args: tuple, static: dict | None = None) -> None:
        """Compile `key`'s program ahead of its first call (the warm-up after load), from abstract
        args. No slot is created: the counters' `total` counts slots a forward has reached, and
        the first real call finds its executable live. A failure here is counted like any other."""
        static = static or {}
        with self._lock:
            exe = self._exe(key, fn, args, static)
        if exe.compiled is None and not exe.gave_up:
            self._compile(key, exe, fn, args, static)

    def executable(self, key: GraphKey, fn: Callable, args: tuple, static: dict | None = None):
        """The compiled executable of `key`'s program (compiled now if due), or None when it is not
        available — failed, given up, ineligible or waiting for its retry: the caller then runs its
        fallback (for the full-step program: the per-layer programs)."""
        static = static or {}
        slot = self._slot(key, fn, args, static)
        slot.calls += 1
        exe = slot.exe
        if slot.ineligible:
            return None
        if exe.compiled is None and not exe.gave_up and time.monotonic() >= exe.next_retry:
            self._compile(key, exe, fn, args, static)
        return exe.compiled

    def _compile(self, key, exe: _Executable, fn, args, static) -> None:
        t0 = time.perf_counter()
        try:
            if FAULTS.take("compile"):
                raise InjectedFault("injected compile failure")
            exe.compiled = fn.lower(*args, **static).compile()
            self.captures += 1
            exe.retry = None
            # (not while a failed program runs traced instead: its fallback lives in those caches)
            if self.forget_traces and not any(e.compiled is None and e.failures for e in self._exes.values()):
                forget_traces()
        except Exception as e:  # noqa: BLE001 - any compile failure falls back, and is counted
            exe.failures += 1
            self.capture_failures += 1
            exe.next_retry = time.monotonic() + self.backoff_s * 2 ** (exe.failures - 1)
            exe.gave_up = exe.failures >= self.max_retries
            if exe.retry is None:  # shapes only: a retry must not keep (donated) buffers alive
                exe.retry = (fn, jax.tree_util.tree_map(abstract, args), static, key)
            log.warning("compile of %s failed (%d/%d): %s", key, exe.failures, self.max_retries, e)
        exe.compile_s += time.perf_counter() - t0

    def retry_due(self) -> int:
        """Retry failed compiles whose backoff has passed, whether or not their slot runs again
        (the device thread calls this between steps). Returns how many were attempted."""
        now = time.monotonic()
        with self._lock:
            due = [e for e in self._exes.values()
                   if e.compiled is None and e.retry is not None and not e.gave_up and now >= e.next_retry]
        for exe in due:
            fn, avals, static, key = exe.retry
            self._compile(key, exe, fn, avals, static)
        return len(due)

    def mark_ineligible(self, key: GraphKey) -> None:
        with self._lock:
            self._slots.setdefault(key, _Slot(_Executable())).ineligible = True

    def counters(self, layer_class: str | None = None) -> dict[str, int]:
        """The contract's residency object, for one class or all of them."""
        with self._lock:
            slots = [s for k, s in self._slots.items() if layer_class is None or k.layer_class == layer_class]
        live = sum(s.exe.compiled is not None and not s.ineligible for s in slots)
        ineligible = sum(s.ineligible for s in slots)
        failed = sum(s.exe.compiled is None and s.exe.failures > 0 and not s.ineligible for s in slots)
        out = {"live": live, "total": len(slots), "failed": failed, "ineligible": ineligible,
               "pending": len(slots) - live - ineligible - failed}
        gave_up = sum(s.exe.gave_up and s.exe.compiled is None for s in slots)
        if gave_up:
            out["gave_up"] = gave_up
        return out

    def classes(self) -> list[str]:
        with self._lock:
            return sorted({k.layer_class for k in self._slots})

    def programs(self) -> set[str]:
        with self._lock:
            return {k.program for k in self._slots}

    def compile_seconds(self) -> float:
        return sum(e.compile_s for e in self._exes.values())
