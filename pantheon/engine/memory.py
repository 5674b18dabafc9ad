"""Host memory readings (the memory ladder builds on these)."""

from __future__ import annotations


def meminfo_bytes(key: str, default: int = 0) -> int:
    """A /proc/meminfo field in bytes (MemTotal, MemAvailable, ...), or `default` where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return default
