"""The host tier's budget: host-memory bytes that sessions moved off the device may hold, one
process-wide account (PN_SESSION_HOST_BYTES) that every model's slot table (engine/sessions.py)
draws on."""

from __future__ import annotations

import threading


class HostBudget:
    """Host-memory bytes the parked conversations may hold. One per process (every model's table
    draws on it), so it is thread-safe."""

    def __init__(self, limit: int):
        self.limit, self.used = max(0, int(limit)), 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def free(self, n: int) -> None:
        with self._lock:
            self.used -= n


_process_budget: HostBudget | None = None


def process_host_budget(limit: int) -> HostBudget:
    """The process-wide host tier (created with `limit` on first use)."""
    global _process_budget
    if _process_budget is None:
        _process_budget = HostBudget(limit)
    return _process_budget
