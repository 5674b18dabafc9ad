"""The slot and session table: which conversation's KV each slot holds, who owns it, prefix reuse,
and the host tier that idle sessions move to instead of being evicted.

Owned by the device thread (no locks; `tiers()` is safe to read from others).

Data model
----------
* A *slot* holds one conversation on the device: the token history whose KV (and, for recurrent
  models, state) is in the cache. Its `owner` is a live session id, or None (an anonymous request's
  history, or one whose owner was released or moved to the host: still reusable as a prefix).
* A *session* (id) carries one or more *conversations* (opencode sends a title request and its real
  turns under one id). Each conversation lives in one place: a slot it owns (device tier), or a
  `Parked` entry on the session (host tier: the arrays `spill` returned, the same bytes an export
  holds). A turn resumes from the conversation its prompt *continues* (its whole history is a prefix
  of the prompt), wherever it is; a parked one is `fill`ed back into a slot first (no re-prefill).
  A prompt that continues none starts a new conversation in another slot; on attention-only models
  it is seeded with the longest prefix it shares with one of the id's conversations (copied, so that
  conversation stays intact: copy-on-diverge).
* `max_sessions` bounds the ids *on the device* (owning at least one slot), not conversations and
  not ids on the host. A new id at the bound moves the least recently used idle, unwatched session
  to the host; only when every session on the device is busy or watched is it refused
  (CapacityError -> 429 model_at_session_capacity). Idle sessions therefore never lock a model out.
* An anonymous request never destroys a live session's KV: it takes a slot no live session owns, or
  an idle unwatched session's slot after that conversation was parked; otherwise it waits (None).
* The host tier is bounded (`HostBudget`, PN_SESSION_HOST_BYTES); past it the least recently used
  parked conversation of this table is dropped (that session's next turn re-prefills; the id stays
  live). Without a host tier (no callbacks, or a zero budget) nothing is ever parked: new ids over
  the bound get the 429 and anonymous requests wait for a slot no live session holds.
* KV that came in through `restore` is *private*: a client built it, so it may only serve the id
  that restored it. A private conversation (and what grows from it in its slot) never seeds another
  id's conversation or an anonymous request: when its slot is disowned (release, reap, a move to
  the host tier) the slot forgets its history instead of staying a reusable prefix; a slot stops
  being private when a prefill overwrites it from position 0.
* `session_conflict` is reported only when a conversation had to overwrite another of the same id
  without parking it (no host tier, or the spill failed)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from pantheon.engine.host_budget import HostBudget

log = logging.getLogger(__name__)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def is_prefix(history: list[int], tokens: list[int]) -> bool:
    return len(history) <= len(tokens) and tokens[:len(history)] == history


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # history whose KV/state the slot holds
    owner: str | None = None  # session id
    busy: bool = False  # a sequence is running in it
    last_used: float = 0.0
    private: bool = False  # holds KV from a restore (or grown from one): never shared with another id
    marks: list = field(default_factory=list)  # Mark: its rows at points of its history (rings, recurrent models)


@dataclass(eq=False)  # identity: the arrays do not compare
class Mark:
    """A slot's state at a point of its history where it cannot be rewound: the rows of its sliding
    rings and recurrent states after its first `n` tokens (llama.cpp's context checkpoint), taken
    where a prompt ends and where its last user turn starts. A later prompt sharing those n tokens
    resumes there, with the rows put back, instead of from 0."""

    tokens: list[int]  # the n tokens it stands on
    arrays: dict
    nbytes: int = 0  # drawn from the host tier's budget while it is kept

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)  # identity: the arrays do not compare
class Parked:
    """A conversation on the host tier: its history and the arrays `spill` returned for it."""

    tokens: list[int]
    arrays: dict
    nbytes: int
    last_used: float
    private: bool = False  # came in through a restore (see Slot.private)


@dataclass
class Session:
    id: str
    last_used: float
    watchers: int = 0
    release_at: float | None = None  # a closed watch's grace deadline
    conflict: bool = False  # a conversation overwrote another of this id (not parked)
    host: list[Parked] = field(default_factory=list)  # conversations moved to host memory


class CapacityError(Exception):
    """A session id that needs the device while `max_sessions` ids hold it, all busy or watched."""


class SessionError(Exception):
    """A session route's refusal, with the contract's status and type."""

    def __init__(self, status: int, type_: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


Spill = Callable[[int, int], dict]  # (slot index, n_tok) -> host arrays of that slot's first n_tok
Fill = Callable[[int, dict], None]  # (slot index, arrays) -> those arrays installed in the slot


MAX_MARKS = 3  # a slot's marks: its last prompt's end and last user turn's start, and its first such start
MARK_MIN_TOKENS = 256  # history shorter than this is not marked: re-prefilling it costs little


class SlotTable:
    def __init__(self, n_slots: int, max_sessions: int, can_truncate: bool = True,
                 idle_ttl_s: float = 12 * 3600, watch_grace_s: float = 45.0, max_watches: int = 64,
                 spill: Spill | None = None, fill: Fill | None = None, host: HostBudget | None = None,
                 spill_bytes: Callable[[int], int] | None = None, rewind: int | None = None):
        self.slots = [Slot(i) for i in range(n_slots)]
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.can_truncate = can_truncate  # attention-only caches can resume from any common prefix
        # ... within `rewind` positions of the history's end, where sliding layers hold rings (state.rewind)
        self.rewind = rewind
        self.idle_ttl_s, self.watch_grace_s, self.max_watches = idle_ttl_s, watch_grace_s, max_watches
        self.spill, self.fill = spill, fill
        self.host = host if host is not None else HostBudget(0)
        self.spill_bytes = spill_bytes  # an estimate of spill's bytes, to refuse early what cannot fit
        self.host_bytes = 0  # this table's parked bytes
        self.spills = self.fills = self.copies = self.dropped = self.resumes = 0
        self._pinned: Parked | None = None

    @property
    def tiered(self) -> bool:
        return self.spill is not None and self.fill is not None and self.host.limit > 0

    # ---- prefix reuse -------------------------------------------------------------------------------
    def reusable(self, slot: Slot, prompt: list[int]) -> int:
        """How many leading prompt tokens the slot's cache can serve (at least one token is always
        left to prefill, for the logits): from its history, or from its mark where the history cannot
        be rewound that far (a recurrent state, a ring written past the prefix)."""
        n = self._reusable(slot.tokens, prompt)
        m = self._mark_for(slot, prompt, n)
        return m.n if m is not None else n

    def _mark_for(self, slot: Slot, prompt: list[int], n: int) -> Mark | None:
        """The slot's mark that serves more of the prompt than its history's n tokens: the slot still
        holds the mark's tokens (its positions before it), and the prompt starts with them."""
        fits = [m for m in slot.marks if n < m.n < len(prompt) and slot.tokens[:m.n] == m.tokens == prompt[:m.n]]
        return max(fits, key=lambda m: m.n, default=None)

    def mark(self, slot: Slot, tokens: list[int], arrays: dict) -> None:
        """The slot's rows once `tokens` are in it (its running sequence's prompt, or the part before
        the last user turn), held in host memory drawn from the host tier's budget (none left, or
        no tier: no mark). At most MAX_MARKS a slot: past them the oldest goes, but the one nearest
        the start (a system prompt other conversations share) stays."""
        if not arrays:
            return
        self._keep_marks(slot, lambda m: m.n != len(tokens))
        nbytes = sum(a.nbytes for a in arrays.values())
        if not self.host.reserve(nbytes):
            return
        slot.marks.append(Mark(list(tokens), arrays, nbytes))
        while len(slot.marks) > MAX_MARKS:
            first = min(slot.marks, key=lambda m: m.n)
            gone = next(m for m in slot.marks if m is not first)
            self._keep_marks(slot, lambda m: m is not gone)

    def _keep_marks(self, slot: Slot, keep: Callable[[Mark], bool]) -> None:
        """The slot's marks that `keep` says still hold; the others' bytes go back to the budget."""
        for m in slot.marks:
            if not keep(m):
                self.host.free(m.nbytes)
        slot.marks = [m for m in slot.marks if keep(m)]

    def drop_marks(self) -> None:
        """Every slot's marks, and their bytes back to the budget (the model is unloading)."""
        for slot in self.slots:
            self._keep_marks(slot, lambda m: False)

    def _reusable(self, history: list[int], prompt: list[int]) -> int:
        n = common_prefix(history, prompt)
        if not self.can_truncate:  # recurrent state cannot be rewound: all of the history or nothing
            return n if n == len(history) and n < len(prompt) else 0
        n = min(n, len(prompt) - 1)
        return 0 if self.rewind is not None and len(history) - n > self.rewind else n

    def _continues(self, history: list[int], prompt: list[int]) -> bool:
        """The prompt carries on this conversation: its whole history is a prefix of the prompt."""
        return bool(history) and is_prefix(history, prompt) and self._reusable(history, prompt) > 0

    # ---- choosing a slot ----------------------------------------------------------------------------
    def acquire(self, session_id: str | None, prompt: list[int], use_cache: bool = True) -> tuple[Slot, int] | None:
        """A free slot for this prompt and the number of cached tokens it reuses, or None when the
        caller must wait for one. Raises CapacityError for an id that needs the device while
        `max_sessions` ids hold it and none of them can move to the host."""
        now = time.monotonic()
        if session_id is None:
            return self._anonymous(prompt, use_cache, now)
        session = self.sessions.get(session_id)
        fresh = session is None
        if fresh:
            session = Session(session_id, now)
        got = self._for_session(session, prompt, use_cache, now, fresh)
        if got is not None:
            self.sessions[session_id] = session
            session.last_used, session.release_at = now, None
        return got

    def _anonymous(self, prompt, use_cache, now):
        free = [s for s in self.slots if not s.busy]
        unowned = [s for s in free if not self._live_owner(s)]
        if unowned:
            return self._claim(self._best(unowned, prompt, use_cache), None, prompt, use_cache, now)
        for slot in sorted((s for s in free if self._spillable(self.sessions[s.owner])), key=lambda s: s.last_used):
            if self._park(slot):  # the session keeps its conversation (host tier); its slot is ours
                return self._claim(slot, None, prompt, use_cache, now)
        return None

    def _for_session(self, session: Session, prompt, use_cache, now, fresh):
        sid = session.id
        if use_cache:
            own = [s for s in self.slots if s.owner == sid and not s.busy and self._continues(s.tokens, prompt)]
            dev = max(own, key=lambda s: len(s.tokens), default=None)
            parked = max((c for c in session.host if self._continues(c.tokens, prompt)),
                         key=lambda c: len(c.tokens), default=None)
            if dev is not None and (parked is None or len(dev.tokens) >= len(parked.tokens)):
                return self._claim(dev, sid, prompt, use_cache, now)
            if parked is not None:  # back from the host tier
                self._pinned = parked  # making room must not drop the conversation being brought back
                try:
                    slot = self._twin(parked) if self._resident(session, fresh) else None
                    slot = slot or self._room(session, prompt, False, now, fresh)
                finally:
                    self._pinned = None
                if slot is None:
                    return None
                self._unpark(session, parked, slot)
                return self._claim(slot, sid, prompt, use_cache, now)
        slot = self._room(session, prompt, use_cache, now, fresh)  # a new conversation
        if slot is None:
            return None
        if use_cache:
            self._seed(slot, session, prompt)
        return self._claim(slot, sid, prompt, use_cache, now)

    def _room(self, session: Session, prompt, use_cache, now, fresh) -> Slot | None:
        """A free slot for one more conversation of `session`, moving others to the host as needed."""
        sid = session.id
        if not self._resident(session, fresh):
            return None
        free = [s for s in self.slots if not s.busy]
        unowned = [s for s in free if not self._live_owner(s)]
        if unowned:
            return self._best(unowned, prompt, use_cache)
        own = [s for s in free if s.owner == sid]
        others = sorted((s for s in free if s.owner != sid and self._spillable(self.sessions[s.owner])),
                        key=lambda s: s.last_used)
        if own:  # this id's own idle conversation first: the best shared prefix stays usable in place
            own.sort(key=lambda s: (-self.reusable(s, prompt) if use_cache else 0, s.last_used))
        for slot in own + others:
            if self._park(slot):
                return slot
        if own:  # no host tier: this conversation evicts another of the same id
            slot = own[0]
            if slot.tokens:
                session.conflict = True
            return slot
        return None

    def _resident(self, session: Session, fresh: bool) -> bool:
        """Make sure `session` may hold a slot: an id off the device needs one of the `max_sessions`
        places, so the least recently used idle, unwatched session moves to the host. False: wait
        (a live id, while a session that could make way is busy); CapacityError: refused."""
        sid = session.id
        if any(s.owner == sid for s in self.slots) or len(self._device_ids()) < self.max_sessions:
            return True
        if self._evict_session(sid):
            return True
        if not fresh and any(self.session_busy(o) and self.sessions[o].watchers == 0 for o in self._device_ids()):
            return False
        raise CapacityError(sid)

    def _evict_session(self, keep: str) -> bool:
        """Move the least recently used idle, unwatched session on the device to the host."""
        candidates = [self.sessions[o] for o in self._device_ids() if o != keep and self._spillable(self.sessions[o])]
        for victim in sorted(candidates, key=lambda s: s.last_used):
            if all(self._park(s) for s in self.slots if s.owner == victim.id):
                return True
        return False

    def _best(self, candidates: list[Slot], prompt, use_cache) -> Slot:
        if use_cache:
            slot = max(candidates, key=lambda s: (self.reusable(s, prompt), -s.last_used))
            if self.reusable(slot, prompt) > 0:
                return slot
        return min(candidates, key=lambda s: s.last_used)

    def _seed(self, slot: Slot, session: Session, prompt) -> None:
        """Copy-on-diverge: give a new conversation the longest prefix it shares with another
        conversation of its id — copied from that one's slot (on a sliding or recurrent model, from
        its mark: the positions before it and the mark's rows), or filled from the host tier — so
        that conversation stays intact where it is."""
        if not (self.spill and self.fill):
            return
        have = self.reusable(slot, prompt)
        src = max((s for s in self.slots if s.owner == session.id and not s.busy and s is not slot),
                  key=lambda s: self.reusable(s, prompt), default=None)
        parked = max(session.host, key=lambda p: self._reusable(p.tokens, prompt), default=None)
        n_dev = self.reusable(src, prompt) if src is not None else 0
        n_host = self._reusable(parked.tokens, prompt) if parked is not None else 0
        if max(n_dev, n_host) <= have:
            return
        try:
            if n_dev >= n_host:
                arrays = self.spill(src.index, n_dev)
                if (m := self._mark_for(src, prompt, self._reusable(src.tokens, prompt))) is not None:
                    arrays = {**arrays, **m.arrays}  # from its mark: the mark's rows, not today's
                    self.resumes += 1
                self.fill(slot.index, arrays)
                self._keep_marks(slot, lambda m: False)
                slot.tokens, slot.private = src.tokens[:n_dev], src.private
            else:  # the whole parked conversation goes in; the slot keeps the shared part
                self.fill(slot.index, parked.arrays)
                self._keep_marks(slot, lambda m: False)
                slot.tokens, slot.private = parked.tokens[:n_host], parked.private
        except Exception:  # noqa: BLE001 - the new conversation prefills instead
            log.exception("copying a shared prefix into a slot failed")
            self._keep_marks(slot, lambda m: False)
            slot.tokens, slot.private = [], False
            return
        self.copies += 1

    def _claim(self, slot: Slot, owner, prompt, use_cache, now):
        cached = self._reusable(slot.tokens, prompt) if use_cache else 0
        if use_cache and (m := self._mark_for(slot, prompt, cached)) is not None:
            try:  # resume at the mark: its rows back in place (positions before it were never rewritten)
                self.fill(slot.index, m.arrays)
                cached = m.n
                self.resumes += 1
            except Exception:  # noqa: BLE001 - the prompt prefills from its history's prefix instead
                log.exception("restoring a slot's mark failed")
                self._keep_marks(slot, lambda m: False)
        # the prefill overwrites what later marks stand on (and a ring's rows moved past the others'
        # tokens are still those of the same history: the marks before `cached` stay)
        self._keep_marks(slot, lambda m: m.n <= cached)
        slot.busy, slot.owner, slot.last_used = True, owner, now
        slot.tokens = slot.tokens[:cached]
        if not cached:  # the prefill overwrites the slot from position 0
            slot.private = False
        return slot, cached

    def _live_owner(self, slot: Slot) -> bool:
        return slot.owner is not None and slot.owner in self.sessions

    def _device_ids(self) -> set[str]:
        return {s.owner for s in self.slots if s.owner is not None and s.owner in self.sessions}

    def _spillable(self, session: Session) -> bool:
        return session.watchers == 0 and not self.session_busy(session.id)

    def release_slot(self, slot: Slot, history: list[int]) -> None:
        """A sequence finished: the slot now holds `history`."""
        slot.busy, slot.tokens, slot.last_used = False, history, time.monotonic()

    def invalidate(self, slot: Slot) -> None:
        """The slot's contents are unknown (a failed device step): forget them."""
        slot.tokens, slot.private = [], False
        self._keep_marks(slot, lambda m: False)

    @staticmethod
    def _disown(slot: Slot) -> None:
        """The slot no longer belongs to a session. Its history stays a reusable prefix for anyone,
        unless it is private (restored KV), which is forgotten."""
        slot.owner = None
        if slot.private:
            slot.tokens, slot.private = [], False

    # ---- the host tier ------------------------------------------------------------------------------
    def _park(self, slot: Slot) -> bool:
        """Move an idle slot's conversation to the host tier and disown the slot (its tokens stay, a
        reusable prefix until overwritten). False, with nothing changed, when it cannot be kept."""
        if not slot.tokens or not self._live_owner(slot):
            self._disown(slot)
            return True
        if not self.tiered:
            return False
        n = len(slot.tokens)
        if self.spill_bytes is not None and not self._fits(self.spill_bytes(n)):
            return False
        try:
            arrays = self.spill(slot.index, n)
        except Exception:  # noqa: BLE001 - the conversation stays on the device
            log.exception("moving a session to the host tier failed")
            return False
        nbytes = sum(int(a.nbytes) for a in arrays.values())
        if not self._make_room(nbytes):
            return False
        self.sessions[slot.owner].host.append(Parked(list(slot.tokens), arrays, nbytes, slot.last_used,
                                                     slot.private))
        self._disown(slot)
        self.spills += 1
        return True

    def _twin(self, parked: Parked) -> Slot | None:
        """A free, unowned slot that still holds exactly this parked conversation."""
        return next((s for s in self.slots if not s.busy and not self._live_owner(s) and s.tokens == parked.tokens),
                    None)

    def _unpark(self, session: Session, parked: Parked, slot: Slot) -> None:
        if slot.tokens != parked.tokens:
            try:
                self.fill(slot.index, parked.arrays)
            except Exception:
                slot.tokens, slot.owner, slot.private = [], None, False  # contents unknown; it stays parked
                raise
            slot.tokens = list(parked.tokens)
            self.fills += 1
        slot.private = parked.private
        self._unstore(session, parked)

    def _fits(self, nbytes: int) -> bool:
        """Could `nbytes` be parked, dropping every conversation this table has parked (and its
        marks) if need be?"""
        marks = sum(m.nbytes for slot in self.slots for m in slot.marks)
        return nbytes <= self.host.limit - (self.host.used - self.host_bytes - marks)

    def _make_room(self, nbytes: int) -> bool:
        if not self._fits(nbytes):
            return False
        while not self.host.reserve(nbytes):
            marked = [s for s in self.slots if s.marks]
            if marked:  # a parked conversation is worth more than a mark: the marks go first
                self._keep_marks(min(marked, key=lambda s: s.last_used), lambda m: False)
                continue
            lru = min(((s, p) for s in self.sessions.values() for p in s.host if p is not self._pinned),
                      key=lambda sp: sp[1].last_used, default=None)
            if lru is None:
                return False
            self._unstore(*lru)
            self.dropped += 1
        self.host_bytes += nbytes
        return True

    def _unstore(self, session: Session, parked: Parked) -> None:
        if parked not in session.host:  # already dropped to make room
            return
        session.host.remove(parked)
        self.host_bytes -= parked.nbytes
        self.host.free(parked.nbytes)

    # ---- export / restore ---------------------------------------------------------------------------
    def latest(self, session_id: str) -> Slot | Parked | None:
        """The id's most recently used conversation: an idle slot it owns, or a parked entry."""
        session = self.sessions.get(session_id)
        if session is None:
            return None
        convs: list = [s for s in self.slots if s.owner == session_id and s.tokens and not s.busy] + session.host
        return max(convs, key=lambda c: c.last_used, default=None)

    def restore(self, session_id: str, tokens: list[int], arrays: dict) -> str:
        """Install a restored conversation: it replaces the conversation of this id that `tokens`
        continue, else it is added. It goes into a slot when one can be had, else to the host tier
        ("device" / "host"). Raises CapacityError when neither can take it."""
        now = time.monotonic()
        session = self.sessions.get(session_id)
        fresh = session is None
        if fresh:
            session = Session(session_id, now)
        superseded = [p for p in session.host if is_prefix(p.tokens, tokens)]
        slot = max((s for s in self.slots if s.owner == session_id and not s.busy and is_prefix(s.tokens, tokens)),
                   key=lambda s: len(s.tokens), default=None)
        if slot is None:
            try:
                slot = self._room(session, tokens, False, now, fresh)
            except CapacityError:
                slot = None
        if slot is not None:
            try:
                self.fill(slot.index, arrays)
            except Exception:
                slot.tokens, slot.owner, slot.private = [], None, False
                raise
            slot.tokens, slot.owner, slot.last_used, slot.private = list(tokens), session_id, now, True
            where = "device"
        else:
            for parked in superseded:
                self._unstore(session, parked)
            superseded = []
            nbytes = sum(int(a.nbytes) for a in arrays.values())
            if not (self.tiered and self._make_room(nbytes)):
                raise CapacityError(session_id)
            session.host.append(Parked(list(tokens), arrays, nbytes, now, private=True))
            where = "host"
        for parked in superseded:
            self._unstore(session, parked)
        self.sessions[session_id] = session
        session.last_used, session.release_at = now, None
        return where

    # ---- sessions -----------------------------------------------------------------------------------
    def session_busy(self, session_id: str) -> bool:
        return any(s.busy for s in self.slots if s.owner == session_id)

    def release(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            for parked in list(session.host):
                self._unstore(session, parked)
        for s in self.slots:
            if s.owner == session_id:
                self._disown(s)

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

    def tiers(self) -> dict:
        """Where the live sessions' conversations are (for /admin/models; any thread)."""
        sessions = list(self.sessions.values())
        live = {s.id for s in sessions}
        device = {s.owner for s in list(self.slots) if s.owner in live}
        host = {s.id for s in sessions if s.host and s.id not in device}
        return {"live": len(live), "on_device": len(device), "on_host": len(host), "host_bytes": self.host_bytes,
                "host_bytes_limit": self.host.limit if self.tiered else 0, "spills": self.spills,
                "fills": self.fills, "prefix_copies": self.copies, "host_dropped": self.dropped}
