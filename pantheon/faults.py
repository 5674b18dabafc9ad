"""Fault injection for tests: make a compile fail, a kernel's lowering fail, a KV allocation fail,
a device step fail, or memory pressure rise.

`compile` fails in the graph registry, before anything is traced; `lowering` fails inside the trace,
where a Pallas or native kernel is lowered (pallas/dispatch.py), as a real Triton or XLA failure
would: the registry then falls back to the program with its kernels on the jnp reference.

Off unless asked: `PANTHEON_FAULTS="compile=2,lowering=1,kv_alloc=1,step=1,memory=critical"` at start-up, or
`POST /admin/test/faults` with the same keys when the server runs with `PANTHEON_TEST_HOOKS=1`.
Counted faults fire that many times and then stop, so every fallback can be seen failing and
then healing."""

from __future__ import annotations

import threading

from pantheon.config import fault_spec

COUNTED = ("compile", "lowering", "kv_alloc", "step")
MEMORY_LEVELS = ("ok", "pressure", "critical")


class Faults:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {k: 0 for k in COUNTED}
        self.memory: str | None = None  # forced memory-ladder level, None = measured
        self.load(fault_spec())

    def load(self, spec: str) -> None:
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, _, value = item.partition("=")
            self.set(key.strip(), value.strip())

    def set(self, key: str, value) -> None:
        with self._lock:
            if key in COUNTED:
                self.counts[key] = int(value)
            elif key == "memory":
                if value not in (*MEMORY_LEVELS, None, ""):
                    raise ValueError(f"memory fault must be one of {MEMORY_LEVELS}")
                self.memory = value or None
            else:
                raise ValueError(f"unknown fault {key!r} (known: {', '.join(COUNTED)}, memory)")

    def take(self, key: str) -> bool:
        """True (and one fewer left) when a fault of this kind should fire now."""
        with self._lock:
            if self.counts.get(key, 0) > 0:
                self.counts[key] -= 1
                return True
            return False

    def pending(self, key: str) -> bool:
        """Whether a counted fault of this kind is armed (without taking it)."""
        with self._lock:
            return self.counts.get(key, 0) > 0

    def snapshot(self) -> dict:
        with self._lock:
            return {**self.counts, "memory": self.memory}


FAULTS = Faults()


class InjectedFault(RuntimeError):
    pass
