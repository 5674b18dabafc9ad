"""The native kernels have two vector widths: 16-wide AVX-512 paths and 8-wide AVX2 ones, chosen when
the library is compiled (-march=native). CI machines differ (AMD AVX2, AMD AVX-512, Intel AVX-512 with
VNNI), so every machine tests both: this one's own build in tests/native/test_native.py, and here the
same tests again in a process whose library is built for AVX2 only (PANTHEON_NATIVE_ISA=avx2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pantheon.config import ENV_NATIVE_ISA, native_isa
from pantheon.native import build

ROOT = Path(__file__).resolve().parents[2]


def test_the_library_is_built_for_the_chosen_instruction_set():
    if not build.available():
        pytest.skip(f"native kernels not built here: {build.unavailable_reason()}")
    avx512 = "avx512f" in build._cpu_flags().split()
    assert build.vector_width() == (16 if avx512 and native_isa() == "native" else 8)


def test_an_unknown_instruction_set_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_NATIVE_ISA, "avx10")
    with pytest.raises(ValueError, match="expected 'native' or 'avx2'"):
        native_isa()


@pytest.mark.skipif(os.environ.get(ENV_NATIVE_ISA, "native") == "avx2", reason="this process is the AVX2 run")
def test_the_avx2_build_passes_the_kernel_tests():
    if not build.available():
        pytest.skip(f"native kernels not built here: {build.unavailable_reason()}")
    env = {**os.environ, ENV_NATIVE_ISA: "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "tests/native/test_native.py", "tests/native/test_isa.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
