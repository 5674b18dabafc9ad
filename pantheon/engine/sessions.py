"""The slot and session table: which conversation's KV each slot holds, who owns it, prefix reuse.

Owned by the device thread (no locks). A slot holds one conversation: the token history whose KV
(and, for recurrent models, state) is in the cache. A session id owns one or more slots — one per
conversation it carries; `max_sessions` caps the number of live ids. Slots without a live owner keep
their history, so an anonymous request whose prompt extends it reuses the prefix for free."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # history whose KV/state the slot holds
    owner: str | None = None  # session id
    busy: bool = False  # a sequence is running in it
    last_used: float = 0.0


@dataclass
class Session:
    id: str
    last_used: float
    watchers: int = 0
    release_at: float | None = None  # a closed watch's grace deadline
    conflict: bool = False  # two conversations evicted each other under this id


class CapacityError(Exception):
    """A new session id while every session slot holds a live session."""


class SessionError(Exception):
    """A session route's refusal, with the contract's status and type."""

    def __init__(self, status: int, type_: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


class SlotTable:
    """Slots are shared: an anonymous request that finds every free slot held by an idle session
    borrows the least recently used one (that session's next turn re-prefills) rather than starve."""

    def __init__(self, n_slots: int, max_sessions: int, can_truncate: bool = True,
                 idle_ttl_s: float = 12 * 3600, watch_grace_s: float = 45.0, max_watches: int = 64):
        self.slots = [Slot(i) for i in range(n_slots)]
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.can_truncate = can_truncate  # attention-only caches can resume from any common prefix
        self.idle_ttl_s, self.watch_grace_s, self.max_watches = idle_ttl_s, watch_grace_s, max_watches

    # ---- prefix reuse -------------------------------------------------------------------------------
    def reusable(self, slot: Slot, prompt: list[int]) -> int:
        """How many leading prompt tokens the slot's cache can serve (at least one token is always
        left to prefill, for the logits)."""
        n = common_prefix(slot.tokens, prompt)
        if not self.can_truncate:  # recurrent state cannot be rewound: all of the history or nothing
            return n if n == len(slot.tokens) and n < len(prompt) else 0
        return min(n, len(prompt) - 1)

    # ---- choosing a slot ----------------------------------------------------------------------------
    def acquire(self, session_id: str | None, prompt: list[int], use_cache: bool = True) -> tuple[Slot, int] | None:
        """A free slot for this prompt and the number of cached tokens it reuses, or None when every
        usable slot is busy (the caller waits). Raises CapacityError for a new id over max_sessions."""
        now = time.monotonic()
        free = [s for s in self.slots if not s.busy]
        if session_id is None:
            return self._take(self._spare(free), prompt, use_cache, None, now)
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                raise CapacityError(session_id)
            session = self.sessions[session_id] = Session(session_id, now)
        session.last_used = now
        session.release_at = None
        free_owned = [s for s in free if s.owner == session_id]
        best = max(free_owned, key=lambda s: self.reusable(s, prompt), default=None)
        if best is not None and self.reusable(best, prompt) > 0 and use_cache:
            return self._claim(best, session_id, prompt, use_cache, now)
        unowned = [s for s in free if not self._live_owner(s)]
        if unowned:  # a further conversation under this id gets its own slot
            return self._take(unowned, prompt, use_cache, session_id, now)
        if free_owned:  # no room: this conversation evicts another of the same id
            if any(s.tokens for s in free_owned):
                session.conflict = True
            return self._claim(min(free_owned, key=lambda s: s.last_used), session_id, prompt, use_cache, now)
        return self._take(self._spare(free), prompt, use_cache, session_id, now)

    def _spare(self, free: list[Slot]) -> list[Slot]:
        """Free slots a request may take, best first: not held by a live session; else a session's
        extra conversation; else the least recently used idle session's slot (it re-prefills)."""
        unowned = [s for s in free if not self._live_owner(s)]
        if unowned:
            return unowned
        held = {}
        for s in self.slots:
            if s.owner is not None:
                held[s.owner] = held.get(s.owner, 0) + 1
        extra = [s for s in free if held.get(s.owner, 0) > 1]
        return sorted(extra or free, key=lambda s: s.last_used)[:1]

    def _take(self, candidates: list[Slot], prompt, use_cache, owner, now):
        if not candidates:
            return None
        if use_cache:
            slot = max(candidates, key=lambda s: (self.reusable(s, prompt), -s.last_used))
            if self.reusable(slot, prompt) == 0:
                slot = min(candidates, key=lambda s: s.last_used)
        else:
            slot = min(candidates, key=lambda s: s.last_used)
        return self._claim(slot, owner, prompt, use_cache, now)

    def _claim(self, slot: Slot, owner, prompt, use_cache, now):
        cached = self.reusable(slot, prompt) if use_cache else 0
        slot.busy, slot.owner, slot.last_used = True, owner, now
        slot.tokens = slot.tokens[:cached]
        return slot, cached

    def _live_owner(self, slot: Slot) -> bool:
        return slot.owner is not None and slot.owner in self.sessions

    def release_slot(self, slot: Slot, history: list[int]) -> None:
        """A sequence finished: the slot now holds `history`."""
        slot.busy, slot.tokens, slot.last_used = False, history, time.monotonic()

    # ---- sessions -----------------------------------------------------------------------------------
    def session_busy(self, session_id: str) -> bool:
        return any(s.busy for s in self.slots if s.owner == session_id)

    def latest_slot(self, session_id: str) -> Slot | None:
        owned = [s for s in self.slots if s.owner == session_id and s.tokens]
        return max(owned, key=lambda s: s.last_used, default=None)

    def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        for s in self.slots:
            if s.owner == session_id:
                s.owner = None

    def take_conflict(self, session_id: str | None) -> bool:
        session = self.sessions.get(session_id) if session_id else None
        if session is None or not session.conflict:
            return False
        session.conflict = False
        return True

    def watch(self, session_id: str) -> bool:
        if sum(s.watchers for s in self.sessions.values()) >= self.max_watches:
            return False
        now = time.monotonic()
        session = self.sessions.setdefault(session_id, Session(session_id, now))
        session.watchers += 1
        session.release_at = None
        session.last_used = now
        return True

    def unwatch(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.watchers = max(0, session.watchers - 1)
            if session.watchers == 0:
                session.release_at = time.monotonic() + self.watch_grace_s

    def reap(self) -> list[str]:
        """Release sessions idle past the TTL (never while watched) or past a closed watch's grace."""
        now = time.monotonic()
        gone = [s.id for s in self.sessions.values()
                if not self.session_busy(s.id) and s.watchers == 0
                and ((s.release_at is not None and now >= s.release_at) or now - s.last_used > self.idle_ttl_s)]
        for sid in gone:
            self.release(sid)
        return gone
