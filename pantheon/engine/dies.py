"""The die manager: which devices ("dies") this process holds, their memory budgets, and which model
occupies each. On the CPU, `--xla_force_host_platform_device_count=N` emulates N dies."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.config import die_reserve_bytes
from pantheon.engine.memory import meminfo_bytes, probe_device_memory


@dataclass(frozen=True)
class Die:
    index: int
    card: int
    platform: str
    memory_bytes: int
    device_id: int
    memory_source: str = "device"  # or why host RAM stands in (memory.probe_device_memory)


def visible_dies() -> list[Die]:
    import jax

    devices = jax.devices()
    host = meminfo_bytes("MemTotal") // max(len(devices), 1)
    dies = []
    for i, d in enumerate(devices):
        probe = probe_device_memory(d)
        dies.append(Die(i, int(getattr(d, "local_hardware_id", None) or i), d.platform, probe.limit or host, d.id,
                        probe.source))
    return dies


def die_budget(die: Die) -> int:
    return max(die.memory_bytes - die_reserve_bytes(), 0)
