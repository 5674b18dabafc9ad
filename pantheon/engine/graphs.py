"""The one registry of compiled step executables — XLA's stand-in for CUDA-graph capture.

Every compiled function the runner calls is obtained here, keyed by (step kind, layer class,
shape bucket). The registry AOT-compiles on first use (`jit.lower(...).compile()`), keeps the
`jax.stages.Compiled` (shape-strict: a wrong bucket is a TypeError, never a silent retrace), and
counts what the contract's `graphs` object reports. A failed compile falls back to calling the
plain jitted function, is retried on a bounded backoff, and gives up after `max_retries`."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphKey:
    kind: str  # "prefill", "decode", "sample", ...
    layer_class: str  # "dense", "batched_attn", "batched_ssm", "single_ssm", "segment"
    bucket: Hashable  # the static shape bucket, e.g. (batch, chunk, kv_len)


@dataclass
class _Slot:
    compiled: Any = None
    failures: int = 0
    next_retry: float = 0.0
    gave_up: bool = False
    ineligible: bool = False
    calls: int = 0
    compile_s: float = 0.0


@dataclass
class GraphRegistry:
    max_retries: int = 3
    backoff_s: float = 1.0
    _slots: dict[GraphKey, _Slot] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    captures: int = 0
    capture_failures: int = 0

    def call(self, key: GraphKey, fn: Callable, args: tuple, static: dict | None = None):
        """Run `fn(*args, **static)` through its compiled executable for `key`."""
        static = static or {}
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
        slot.calls += 1
        if slot.compiled is None and not slot.gave_up and not slot.ineligible and time.monotonic() >= slot.next_retry:
            t0 = time.perf_counter()
            try:
                slot.compiled = fn.lower(*args, **static).compile()
                self.captures += 1
            except Exception as e:  # noqa: BLE001 - any compile failure falls back, and is counted
                slot.failures += 1
                self.capture_failures += 1
                slot.next_retry = time.monotonic() + self.backoff_s * 2 ** slot.failures
                slot.gave_up = slot.failures >= self.max_retries
                log.warning("compile of %s failed (%d): %s", key, slot.failures, e)
            slot.compile_s += time.perf_counter() - t0
        if slot.compiled is not None:
            return slot.compiled(*args)
        return fn(*args, **static)

    def mark_ineligible(self, key: GraphKey) -> None:
        with self._lock:
            self._slots.setdefault(key, _Slot()).ineligible = True

    def counters(self, layer_class: str | None = None) -> dict[str, int]:
        """The contract's residency object, for one layer class or all of them."""
        slots = [s for k, s in self._slots.items() if layer_class is None or k.layer_class == layer_class]
        live = sum(s.compiled is not None for s in slots)
        ineligible = sum(s.ineligible for s in slots)
        failed = sum(s.compiled is None and s.failures > 0 for s in slots)
        out = {"live": live, "total": len(slots), "failed": failed, "ineligible": ineligible,
               "pending": len(slots) - live - ineligible - failed}
        gave_up = sum(s.gave_up and s.compiled is None for s in slots)
        if gave_up:
            out["gave_up"] = gave_up
        return out

    def classes(self) -> list[str]:
        return sorted({k.layer_class for k in self._slots})

    def compile_seconds(self) -> float:
        return sum(s.compile_s for s in self._slots.values())
