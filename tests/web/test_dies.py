"""Dies on 8 emulated CPU devices: a model sharded over 2 and 4 dies equals the single-die run;
replicas of one name on disjoint dies are one /v1/models row and two /admin/models rows;
/admin/dies accounts for every model's buffers per die."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess
from tests.web.test_http_errors import check_error

MSG = [{"role": "user", "content": "hello world, what is new?"}]


@pytest.fixture(scope="module")
def dies_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("dies")
    path = write_tiny_llama(d / "tp.gguf", n_head=4, n_head_kv=4, n_ff=128, seed=9)
    server = ServerProcess(["--model", str(path), "--name", "one", "--dies", "7", "--ctx-cap", "128"],
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    server.path = path
    yield server
    server.stop()


def load(server, name, dies):
    return httpx.post(server.url + "/admin/models/load", timeout=120,
                      json={"path": str(server.path), "name": name, "dies": dies, "ctx_cap": 128})


def greedy(server, model):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": MSG, "temperature": 0, "max_tokens": 12, "logprobs": True,
        "logit_bias": {"0": -100, "2": -100}})
    assert r.status_code == 200, r.text
    return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_sharded_on_two_and_four_dies_equals_one_die(dies_server):
    assert httpx.get(dies_server.url + "/").json()["dies_visible"] == 8
    assert load(dies_server, "two", [0, 1]).status_code == 200
    assert load(dies_server, "four", [2, 3, 4, 5]).status_code == 200
    ref = greedy(dies_server, "one")
    for model in ("two", "four"):
        got = greedy(dies_server, model)
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 1e-4
    rows = {r["id"]: r for r in httpx.get(dies_server.url + "/admin/models").json()["data"]}
    assert rows["four"]["dies"] == [2, 3, 4, 5]
    dies = httpx.get(dies_server.url + "/admin/dies").json()
    assert dies["n_dies"] == 8
    by_die = {d["die"]: d for d in dies["data"]}
    assert [by_die[i]["model"] for i in (0, 1, 2, 5, 6, 7)] == ["two", "two", "four", "four", "", "one"]
    per_die_four = [by_die[i]["vram_used"] for i in (2, 3, 4, 5)]
    assert len(set(per_die_four)) == 1 and sum(per_die_four) == rows["four"]["vram_bytes"]
    assert by_die[7]["vram_used"] == rows["one"]["vram_bytes"]
    assert per_die_four[0] < by_die[7]["vram_used"]  # each die of four holds a share
    for name in ("two", "four"):
        httpx.post(dies_server.url + "/admin/models/unload", json={"name": name})


def test_replicas_are_one_public_row_two_operator_rows_and_share_requests(dies_server):
    assert load(dies_server, "rep", [0]).status_code == 200
    assert load(dies_server, "rep", [1]).status_code == 200
    check_error(load(dies_server, "rep", [1]), 507, "load_failed")  # a die binding conflict
    public = [m["id"] for m in httpx.get(dies_server.url + "/v1/models").json()["data"]]
    assert public.count("rep") == 1
    operator = [m for m in httpx.get(dies_server.url + "/admin/models").json()["data"] if m["id"] == "rep"]
    assert sorted(m["dies"][0] for m in operator) == [0, 1]
    import threading

    threads = [threading.Thread(target=greedy, args=(dies_server, "rep")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    operator = [m for m in httpx.get(dies_server.url + "/admin/models").json()["data"] if m["id"] == "rep"]
    assert all(m.get("graphs", {}).get("total", 0) > 0 for m in operator)  # both replicas served
    assert httpx.post(dies_server.url + "/admin/models/unload", json={"name": "rep"}).json() == {"unloaded": "rep"}


def test_heads_not_divisible_by_the_die_count_is_a_clear_400(dies_server):
    err = check_error(load(dies_server, "three", [0, 1, 2]), 400, "load_failed")
    assert "divisible by 3 dies" in err["message"]
