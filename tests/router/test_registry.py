"""The router's registry (pantheon/router/registry.py): reports, liveness by TTL, the aggregated
/v1/models (live, summed free_slots, minimum context_window omitted when any live replica lacks
one) and where a request goes (the session's holder, else the most free slots)."""

from __future__ import annotations

import pytest

from pantheon.router.registry import Registry, ReportError


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def report(url, models, sessions=(), iid=None):
    body = {"url": url, "models": [dict(id=m, **kw) for m, kw in models], "sessions": list(sessions)}
    if iid:
        body["instance_id"] = iid
    return body


@pytest.fixture
def reg():
    clock = Clock()
    r = Registry(ttl_s=5.0, clock=clock)
    r.clock_ = clock
    return r


def test_aggregation_is_the_contracts(reg):
    a = reg.register(report("http://a:1", [("m", dict(max_concurrent=4, free_slots=3, context_window=4096)),
                                           ("x", dict(max_concurrent=1, free_slots=1))]))
    b = reg.register(report("http://b:1", [("m", dict(max_concurrent=4, free_slots=2, context_window=2048))]))
    assert a.id != b.id
    rows = {r["id"]: r for r in reg.models()}
    assert rows["m"]["live"] == 2 and rows["m"]["free_slots"] == 5 and rows["m"]["context_window"] == 2048
    assert rows["x"]["live"] == 1 and "context_window" not in rows["x"]  # not reported: omitted, never 0
    # one live replica without a window: the model's window is omitted
    reg.heartbeat(report("http://b:1", [("m", dict(max_concurrent=4, free_slots=2))], iid=b.id))
    assert "context_window" not in {r["id"]: r for r in reg.models()}["m"]


def test_ttl_deregister_and_restart(reg):
    a = reg.register(report("http://a:1", [("m", {})]))
    reg.clock_.t += 4.0
    b = reg.register(report("http://b:1", [("m", {})]))
    assert {i.id for i in reg.live()} == {a.id, b.id}
    reg.clock_.t += 2.0  # a's last report is now 6 s old: past the TTL
    assert [i.id for i in reg.live()] == [b.id]
    assert reg.heartbeat(report("http://a:1", [("m", {})], iid="unknown")) is None  # it must register again
    assert reg.deregister(b.id) and not reg.live() and not reg.deregister(b.id)
    c = reg.register(report("http://a:1", [("m", {})]))  # a restarted instance at the same address
    assert [i.id for i in reg._instances.values()] == [c.id]


def test_dispatch_prefers_the_sessions_holder_then_free_slots(reg):
    a = reg.register(report("http://a:1", [("m", dict(free_slots=1))], sessions=["s1"]))
    b = reg.register(report("http://b:1", [("m", dict(free_slots=4))]))
    assert [i.id for i in reg.candidates("m")] == [b.id, a.id]
    assert [i.id for i in reg.candidates("m", "s1")] == [a.id, b.id]
    reg.sent("s2", a)  # where the router last sent a session counts too, before any heartbeat says so
    assert reg.candidates("m", "s2")[0].id == a.id and reg.holder("s2").id == a.id
    b.inflight = 4  # requests the router has in flight there count against its free slots
    assert reg.candidates("m")[0].id == a.id
    assert reg.candidates("other") == []


@pytest.mark.parametrize("body", [[], {"models": []}, {"url": "ftp://x"}, {"url": "http://x", "models": {}},
                                  {"url": "http://x", "models": [{"id": 3}]},
                                  {"url": "http://x", "models": [{"id": "m", "free_slots": -1}]},
                                  {"url": "http://x", "models": [{"id": "m", "context_window": 0}]},
                                  {"url": "http://x", "sessions": [1]}])
def test_bad_reports_are_refused(reg, body):
    with pytest.raises(ReportError):
        reg.register(body)
