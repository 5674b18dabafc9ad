"""A router and two `pantheon serve` instances on localhost, as an operator runs them: the instances
register and heartbeat; the router's /v1/models shows `live: 2`, the summed free slots and the
smaller window; a session's turns land on one instance (its second turn reuses the first's KV);
the official openai client streams through the router; an instance killed without a word stops
being live within the TTL while requests keep succeeding on the other; one that shuts down
cleanly deregisters at once."""

from __future__ import annotations

import signal
import sys
import time

import httpx
import openai
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess

TTL = 3.0


class RouterProcess(ServerProcess):
    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "pantheon", "router", "--port", str(self.port), *args]


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("router") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 4096})
    router = RouterProcess(["--instance-ttl", str(TTL)], wait_models=0)
    serves = [ServerProcess(["--model", str(path), "--name", "tiny", "--ctx-cap", str(ctx), "--max-sessions", "2",
                             "--router", router.url]) for ctx in (1024, 2048)]
    yield router, serves
    for s in serves:
        s.stop()
    router.stop()


def full_log(server) -> str:
    """The whole log (ServerProcess.log() is its tail, for error messages)."""
    with open(server.log_path, "rb") as f:
        return f.read().decode(errors="replace")


def models(router):
    return httpx.get(router.url + "/v1/models", timeout=5).json()["data"]


def chat(router, session, content, **kw):
    r = httpx.post(router.url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": session},
                   json={"model": "tiny", "messages": content, "max_tokens": 3, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_router_serves_two_instances(cluster):
    router, serves = cluster
    rows = wait_for(lambda: [m for m in models(router) if m["live"] == 2])
    assert rows[0]["id"] == "tiny" and rows[0]["free_slots"] == 4 and rows[0]["context_window"] == 1024
    # a session's turns land on one instance: the second turn reuses the first's KV
    first = [{"role": "user", "content": "tell me about rivers and the sea"}]
    a = chat(router, "sess-1", first)
    turn2 = first + [a["choices"][0]["message"], {"role": "user", "content": "and lakes?"}]
    b = chat(router, "sess-1", turn2)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > a["usage"]["prompt_tokens"] // 2
    holders = [s for s in serves if "session=sess-1" in full_log(s)]
    assert len(holders) == 1
    # the official client, streaming through the router
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True) if c.choices)
    assert isinstance(text, str)


def test_a_dead_instance_stops_being_live_and_requests_go_on(cluster):
    router, serves = cluster
    wait_for(lambda: [m for m in models(router) if m["live"] == 2])
    victim, survivor = serves
    victim.proc.send_signal(signal.SIGKILL)  # no deregistration: only the TTL can tell
    victim.proc.wait(10)
    for i in range(3):  # a request that lands on the dead one is retried on the other
        chat(router, f"after-{i}", [{"role": "user", "content": f"hello {i}"}])
    rows = wait_for(lambda: [m for m in models(router) if m["live"] == 1], timeout=TTL + 10)
    assert rows[0]["context_window"] == 2048  # the survivor's window alone
    for i in range(3):
        chat(router, f"later-{i}", [{"role": "user", "content": f"again {i}"}])
    # a clean shutdown deregisters at once (no TTL wait)
    survivor.proc.send_signal(signal.SIGTERM)
    survivor.proc.wait(30)
    assert wait_for(lambda: httpx.get(router.url + "/").json()["live_instances"] == 0 or None, timeout=2.0)
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "no_models_loaded"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("drain") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 4096})
    router = RouterProcess(["--instance-ttl", "30"], wait_models=0)
    # the instances share one session key: a blob one seals, the other accepts (PANTHEON_SESSION_KEY)
    key = {"PANTHEON_SESSION_KEY": "drain-test-" + "0123456789abcdef" * 2}
    serves = [ServerProcess(["--model", str(path), "--name", "tiny", "--ctx-cap", "1024", "--max-sessions", "2",
                             "--router", router.url], env=key) for _ in range(2)]
    yield router, serves
    for s in serves:
        s.stop()
    router.stop()


def test_a_drained_instances_sessions_resume_warm_on_the_other(pair):
    router, serves = pair
    wait_for(lambda: [m for m in models(router) if m["live"] == 2])
    first = [{"role": "user", "content": "describe a lighthouse at night in a storm"}]
    a = chat(router, "mig-1", first)
    holder = wait_for(lambda: next((s for s in serves if "session=mig-1" in full_log(s)), None), timeout=10)
    other = next(s for s in serves if s is not holder)
    r = httpx.post(holder.url + "/admin/drain", timeout=60)
    assert r.status_code == 200 and [m["id"] for m in r.json()["moved"]] == ["mig-1"], r.text
    rows = wait_for(lambda: [m for m in models(router) if m["live"] == 1])
    assert rows[0]["free_slots"] >= 1
    # the next turn lands on the other instance and reuses the moved KV: the whole first turn's prompt
    turn2 = first + [a["choices"][0]["message"], {"role": "user", "content": "and at dawn?"}]
    b = chat(router, "mig-1", turn2)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= a["usage"]["prompt_tokens"]
    # the access log line is written as the response ends, a moment after the client has it
    wait_for(lambda: "session=mig-1" in full_log(other), timeout=10)
    # the drained instance refuses new work itself (a router would retry it elsewhere)
    r = httpx.post(holder.url + "/v1/chat/completions", json={"messages": first, "max_tokens": 1}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_shutting_down"
