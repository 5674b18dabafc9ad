"""The router's table of serve instances: what each reported on register and heartbeat, who is
live, the aggregated `/v1/models`, and where a request should go.

An instance is live while its last report is younger than the TTL; one that deregisters (a clean
shutdown) is gone at once. Reports carry, per served model id: `max_concurrent`, `free_slots` and
`context_window` (omitted when unknown; the memory ladder moves it at runtime, hence every
heartbeat), and the instance's session ids (for affinity)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


class ReportError(ValueError):
    """A register/heartbeat body that does not say what the router needs (400)."""


@dataclass
class ModelReport:
    id: str
    max_concurrent: int = 0
    free_slots: int = 0
    context_window: int | None = None


@dataclass
class Instance:
    id: str
    url: str
    models: dict[str, ModelReport] = field(default_factory=dict)
    sessions: set[str] = field(default_factory=set)
    last_seen: float = 0.0
    inflight: int = 0  # requests the router has sent there and not finished
    draining: bool = False  # told to drain: no new work, its sessions are being moved


def _int(value, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ReportError(f"{what} must be an integer >= {minimum}")
    return value


def parse_report(body) -> tuple[str | None, str, dict[str, ModelReport], set[str]]:
    """(instance_id or None, url, models, sessions) from a register/heartbeat body."""
    if not isinstance(body, dict):
        raise ReportError("body must be a JSON object")
    url = body.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ReportError("'url' must be the instance's http(s) base URL")
    iid = body.get("instance_id")
    if iid is not None and (not isinstance(iid, str) or not iid):
        raise ReportError("'instance_id' must be a non-empty string")
    models = {}
    raw = body.get("models", [])
    if not isinstance(raw, list):
        raise ReportError("'models' must be an array")
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not m["id"]:
            raise ReportError("each model must be an object with a string 'id'")
        window = m.get("context_window")
        models[m["id"]] = ModelReport(m["id"], _int(m.get("max_concurrent", 0), "max_concurrent"),
                                      _int(m.get("free_slots", 0), "free_slots"),
                                      None if window is None else _int(window, "context_window", 1))
    sessions = body.get("sessions", [])
    if not isinstance(sessions, list) or not all(isinstance(s, str) for s in sessions):
        raise ReportError("'sessions' must be an array of strings")
    return iid, url.rstrip("/"), models, set(sessions)


class Registry:
    def __init__(self, ttl_s: float = 10.0, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._instances: dict[str, Instance] = {}
        self._affinity: dict[str, str] = {}  # session id -> instance the router last sent it to

    # ---- what instances say ------------------------------------------------------------------------
    def register(self, body) -> Instance:
        iid, url, models, sessions = parse_report(body)
        for other in [i for i in self._instances.values() if i.url == url and i.id != iid]:
            del self._instances[other.id]  # a restarted instance at the same address replaces itself
        inst = self._instances.get(iid) if iid else None
        if inst is None:
            inst = Instance(iid or uuid.uuid4().hex[:12], url)
            self._instances[inst.id] = inst
        self._update(inst, url, models, sessions)
        return inst

    def heartbeat(self, body) -> Instance | None:
        """The reporting instance, or None when the router does not know it (it re-registers)."""
        iid, url, models, sessions = parse_report(body)
        inst = self._instances.get(iid or "")
        if inst is None:
            return None
        self._update(inst, url, models, sessions)
        return inst

    def deregister(self, iid) -> bool:
        return self._instances.pop(iid, None) is not None if isinstance(iid, str) else False

    def _update(self, inst: Instance, url: str, models, sessions) -> None:
        inst.url, inst.models, inst.sessions, inst.last_seen = url, models, sessions, self.clock()
        for sid in sessions:
            self._affinity[sid] = inst.id

    # ---- what clients see -----------------------------------------------------------------------------
    def live(self) -> list[Instance]:
        now = self.clock()
        return [i for i in self._instances.values() if now - i.last_seen <= self.ttl_s]

    def models(self) -> list[dict]:
        """The router's `/v1/models` rows: one per model id across live instances, with `live`,
        summed `free_slots` and `context_window` = the minimum over its live replicas, omitted when
        any of them has not reported one."""
        rows: dict[str, list[ModelReport]] = {}
        for inst in self.live():
            for report in inst.models.values():
                rows.setdefault(report.id, []).append(report)
        out = []
        for mid, reports in sorted(rows.items()):
            row = {"id": mid, "object": "model", "created": 0, "owned_by": "pantheon", "live": len(reports),
                   "free_slots": sum(r.free_slots for r in reports),
                   "max_concurrent": sum(r.max_concurrent for r in reports)}
            windows = [r.context_window for r in reports]
            if all(w is not None for w in windows):
                row["context_window"] = min(windows)
            out.append(row)
        return out

    def candidates(self, model: str | None, session_id: str | None = None) -> list[Instance]:
        """Live instances that serve `model` (any model when None), best first: the one holding the
        session (from its heartbeats, or where the router last sent it), then by free slots less
        what the router has in flight there."""
        live = [i for i in self.live() if (model is None or model in i.models) and not i.draining]
        if model is None and not live:
            return []

        def free(inst: Instance) -> int:
            reports = [inst.models[model]] if model else list(inst.models.values())
            return sum(r.free_slots for r in reports) - inst.inflight

        ranked = sorted(live, key=free, reverse=True)
        home = self._affinity.get(session_id or "")
        for i, inst in enumerate(ranked):
            if inst.id == home:
                ranked.insert(0, ranked.pop(i))
                break
        return ranked

    def get(self, iid) -> Instance | None:
        return self._instances.get(iid) if isinstance(iid, str) else None

    def sent(self, session_id: str | None, inst: Instance) -> None:
        if session_id:
            self._affinity[session_id] = inst.id

    def holder(self, session_id: str) -> Instance | None:
        home = self._affinity.get(session_id)
        return next((i for i in self.live() if i.id == home), None)
