"""tcmalloc's thread caches are capped at serve start (memory.limit_thread_caches), unless the
operator sized them with tcmalloc's own variable; without tcmalloc nothing is touched. Each case
runs in a fresh interpreter (the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pantheon.engine.backend import TCMALLOC
from pantheon.engine.memory import THREAD_CACHE_BYTES

READ = """
import ctypes
from pantheon.engine.memory import limit_thread_caches
took = limit_thread_caches()
get = getattr(ctypes.CDLL(None), "MallocExtension_GetNumericProperty", None)
value = ctypes.c_size_t(0)
if get is not None:
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    get(b"tcmalloc.max_total_thread_cache_bytes", ctypes.byref(value))
print(took, value.value)
"""


def run(env: dict) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES")}
    out = subprocess.run([sys.executable, "-c", READ], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


def test_without_tcmalloc_nothing_is_set():
    assert run({}) == ("False", 0)


@pytest.mark.skipif(not Path(TCMALLOC).exists(), reason=f"{TCMALLOC} is not installed on this machine")
def test_with_tcmalloc_the_cap_is_set_unless_the_operator_sized_it():
    assert run({"LD_PRELOAD": TCMALLOC}) == ("True", THREAD_CACHE_BYTES)
    assert run({"LD_PRELOAD": TCMALLOC, "TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES": str(64 << 20)}) == ("False", 64 << 20)
