"""Device memory probes say where a budget comes from; a failing probe is logged and reported, never
silently replaced by host RAM."""

from __future__ import annotations

import logging

import jax

from pantheon.engine import dies as dies_mod
from pantheon.engine.memory import MemoryLadder, probe_device_memory


class FakeDevice:
    def __init__(self, platform="gpu", stats=None, error=None, id=0):
        self.platform, self._stats, self._error, self.id = platform, stats, error, id

    def memory_stats(self):
        if self._error:
            raise self._error
        return self._stats

    def __repr__(self):
        return f"FakeDevice({self.platform})"


def test_a_gpu_allocator_is_read():
    probe = probe_device_memory(FakeDevice(stats={"bytes_limit": 100, "bytes_in_use": 40}))
    assert (probe.limit, probe.used, probe.source) == (100, 40, "device")


def test_the_cpu_says_host_ram_stands_in():
    probe = probe_device_memory(jax.devices()[0])
    assert probe.limit is None and probe.source == "host (cpu)"


def test_a_failing_probe_is_reported_and_logged(caplog):
    caplog.set_level(logging.WARNING, "pantheon.engine.memory")
    probe = probe_device_memory(FakeDevice(error=RuntimeError("driver gone 1234")))
    assert probe.limit is None and probe.source.startswith("host (probe failed: RuntimeError: driver gone 1234")
    assert "driver gone 1234" in caplog.text
    empty = probe_device_memory(FakeDevice(stats={}))
    assert "no bytes_limit" in empty.source


def test_dies_carry_the_probe_source(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda: [FakeDevice(error=OSError("no nvml"), id=3),
                                                 FakeDevice(stats={"bytes_limit": 1 << 30, "bytes_in_use": 0}, id=4)])
    failed, ok = dies_mod.visible_dies()
    assert "probe failed" in failed.memory_source and failed.memory_bytes > 0  # host RAM, said so
    assert ok.memory_source == "device" and ok.memory_bytes == 1 << 30


def test_the_ladder_reads_device_pressure():
    full = FakeDevice(stats={"bytes_limit": 100, "bytes_in_use": 99})
    assert MemoryLadder(devices=[full])._measure() == "critical"
    broken = FakeDevice(error=RuntimeError("x"))
    assert MemoryLadder(devices=[broken])._measure() in ("ok", "pressure", "critical")  # host RAM only


def test_kv_rings_larger_than_their_die_are_impossible_and_not_retried(tmp_path, monkeypatch):
    from pantheon.engine import residency
    from pantheon.engine import runner as runner_mod
    from pantheon.faults import FAULTS
    from pantheon.gguf import open_gguf
    from pantheon.model.family import family_of
    from pantheon.model.spec import spec_from_gguf
    from tests.fixtures.tiny_models import write_tiny_llama

    g = open_gguf(write_tiny_llama(tmp_path / "m.gguf", n_layer=2))
    spec = spec_from_gguf(g)
    fam = family_of(spec)

    def runner(budget: int):
        monkeypatch.setattr(residency, "die_budget", lambda die: budget)
        FAULTS.set("kv_alloc", 1)  # layer 0's allocation fails
        try:
            return runner_mod.ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec),
                                          n_slots=2, ctx=32)
        finally:
            FAULTS.set("kv_alloc", 0)

    small = runner(1024)  # one layer's K and V rings are 24 KiB: they can never fit this die
    a = small.attention.counters(operator=True)
    assert a["impossible"] == 1 and a["host"] == 1 and a["reasons"] == {"ring_alloc_failed": 1}
    small.attention.next_retry = {0: 0.0}
    small.attention.retry_due()
    assert small.attention.host_layers() == [0]  # not retried
    roomy = runner(1 << 40)  # the same failure on a die it fits: retried, and it heals
    assert roomy.attention.counters(operator=True)["impossible"] == 0
    roomy.attention.next_retry = {0: 0.0}
    roomy.attention.retry_due()
    assert roomy.attention.host_layers() == []
