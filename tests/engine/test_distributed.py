"""One model over two processes (engine/distributed.py), on localhost: each `pantheon serve` process
has 2 emulated CPU dies and joins a jax.distributed runtime (gloo collectives); process 0 serves
HTTP and broadcasts its device calls, process 1 replays them; the tiny dense model is sharded over
all 4 dies. Its greedy tokens equal those of one process serving the same model over 4 dies, and
process 1 leaves when process 0 stops."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.server import ServerProcess, free_port

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "count the stars above the sea"}],
        "max_tokens": 8, "temperature": 0, "logprobs": True}


def devices(n: int) -> dict:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def greedy(url: str) -> list[str]:
    r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 8 query / 4 kv heads and an FFN of 128: every sharded dimension divides over 4 dies
    return write_tiny_llama(tmp_path_factory.mktemp("dist") / "tiny.gguf", n_head=8, n_head_kv=4, n_ff=128)


def test_two_processes_give_the_one_process_tokens(model, tmp_path):
    one = ServerProcess(["--model", str(model), "--name", "tiny", "--dies", "0,1,2,3"], env=devices(4))
    try:
        expected = [greedy(one.url), greedy(one.url)]
    finally:
        one.stop()
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--model", str(model), "--name", "tiny", "--coordinator", coordinator, "--num-processes", "2"]
    log = open(tmp_path / "follower.log", "wb")
    follower = subprocess.Popen([sys.executable, "-m", "pantheon", "serve", "--port", str(free_port()), *common,
                                 "--process-id", "1"], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **devices(2)))
    try:
        leader = ServerProcess([*common, "--process-id", "0"], env=devices(2))
        try:
            dies = httpx.get(leader.url + "/admin/dies").json()
            assert dies["n_dies"] == 4  # every process's dies, as one mesh
            assert [greedy(leader.url), greedy(leader.url)] == expected
            with ThreadPoolExecutor(3) as pool:  # batched decode steps, broadcast like the rest
                assert list(pool.map(lambda _: greedy(leader.url), range(3))) == [expected[0]] * 3
        finally:
            leader.stop()
        assert follower.wait(30) == 0  # process 0 stopped: its follower left
    finally:
        if follower.poll() is None:
            follower.kill()
        log.close()
    text = (tmp_path / "follower.log").read_text()
    assert "following process 0" in text and "process 0 stopped: leaving" in text
    assert "replayed" not in text  # no replayed call failed
