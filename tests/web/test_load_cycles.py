"""Load, chat and unload the 31 MB qwen35moe reference model through the admin routes, again and
again (in process): resident memory levels off instead of growing by the model's size each cycle."""

from __future__ import annotations

import gc
import os

from tests.web.inprocess import InProcessApp

CYCLES = int(os.environ.get("PANTHEON_LOAD_CYCLES", "10"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_load_chat_unload_cycles_leave_resident_memory_flat(qwen35moe_f32_gguf):
    app = InProcessApp([])
    try:
        before = rss_mib()
        after = []
        for _ in range(CYCLES):
            status, body, _ = app.post("/admin/models/load", {"path": str(qwen35moe_f32_gguf), "name": "q"})
            assert status == 200, body
            status, body, _ = app.post("/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
            assert status == 200, body
            assert app.post("/admin/models/unload", {"name": "q"})[0] == 200
            gc.collect()
            after.append(rss_mib())
        first_cycle = after[0] - before  # weights, compiled programs, allocator pools
        growth = max(after[1:]) - after[0]
        assert growth < max(first_cycle, 64), (
            f"RSS grew {growth:.0f} MiB over {CYCLES - 1} more cycles (first cycle {first_cycle:.0f} MiB): {after}")
    finally:
        app.close()
