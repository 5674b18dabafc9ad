"""Build and register Pantheon's native CPU kernels (qmatmul.cc, attention.cc) with XLA.

XLA:CPU lacks two things decode needs: a matmul that reads quantized weights, and attention that
reads a slot's cache in place at memory speed. Both are C++ here, called from inside the compiled
programs as XLA FFI custom calls (jax.ffi), each beside its jnp reference (qmatmul.py,
attention.py). Their parallel loops run on helper threads of their own (common.h: Helpers, one per
extra core of XLA's intra-op pool), which spin between a decode step's calls and sleep after it;
a loop that finds them busy runs on XLA's pool.

The shared library is compiled on first use with the system C++ compiler for this CPU
(-march=native; PANTHEON_NATIVE_ISA=avx2 builds the 8-wide AVX2 paths instead, which is how the
tests cover both widths on any machine) and cached under $PANTHEON_HOME/native/ (~/.cache/pantheon/native/), keyed by the sources, the compiler,
jaxlib, the CPU's flags and that choice. The kernels need x86 AVX2 with FMA and F16C (every x86 server CPU since
2013). Without a compiler, on other CPUs, or with PANTHEON_NATIVE=0, `available()` is False, with
the reason in `unavailable_reason()`, and the models run their jnp paths."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

from pantheon.config import ENV_NATIVE, cxx, native_enabled, native_isa

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = ("qmatmul.cc", "attention.cc")
HEADERS = ("common.h", "kquants.h")
# FFI target name -> exported handler symbol
TARGETS = {"pantheon_qmatmul": "PantheonQMatmul", "pantheon_expert_matmul": "PantheonExpertMatmul",
           "pantheon_dequantize": "PantheonDequantize",
           "pantheon_attention_decode": "PantheonAttentionDecode",
           "pantheon_attention_prefill": "PantheonAttentionPrefill"}
# ... and those an AVX-512 build adds: the GEMM of long exact prefill chunks (qmatmul.qgemm)
WIDE_TARGETS = {"pantheon_qgemm": "PantheonQGemm"}

# PANTHEON_NATIVE_ISA -> the compiler's target: this CPU, or AVX2 with FMA and F16C only (Haswell's
# set, which every AVX-512 CPU also runs), so the 8-wide paths are tested on any machine.
MARCH = {"native": ["-march=native"], "avx2": ["-march=haswell", "-mtune=generic"]}
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    from pantheon.config import pantheon_home

    return pantheon_home() / "native"


def available() -> bool:
    """Whether the kernels are built and registered with XLA (builds them on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def vector_width() -> int | None:
    """f32 lanes of the built kernels' vectors: 16 (AVX-512) or 8 (AVX2); None when not built."""
    return _state.get("vector_width") if available() else None


def fixed_point() -> bool:
    """Whether the built K-quant kernels take x as 23-bit fixed point (AVX-512 VNNI) and so read
    K-tiled blocks (qmatmul.tile_k); False when not built."""
    return bool(_state.get("fixed_point")) if available() else False


def gemm() -> bool:
    """Whether the built kernels include the dequantizing GEMM of long prefill chunks (AVX-512)."""
    return bool(_state.get("gemm")) if available() else False


def unavailable_reason() -> str | None:
    return None if available() else _state.get("reason")


def _compiler() -> str | None:
    return cxx() or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cxx: str) -> Path:
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((HERE / name).read_bytes())
    # -march=native code must not be reused on a CPU with fewer instructions (a shared cache dir)
    for part in (version, jaxlib.__version__, platform.machine(), _cpu_flags(), native_isa()):
        digest.update(part.encode())
    out = cache_dir() / f"pantheon-native-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        # -ffp-contract=off: every fused multiply-add is an explicit one (common.h), so a row's
        # arithmetic cannot depend on how the compiler scheduled its tile.
        cmd = [cxx, "-O3", *MARCH[native_isa()], "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC",
               "-isystem", jax.ffi.include_dir(), *(str(HERE / s) for s in SOURCES), "-o", str(built)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(built, out)  # atomic: concurrent builders leave one complete file
    return out


def _load() -> bool:
    if not native_enabled():
        _state["reason"] = f"{ENV_NATIVE}=0"
        return False
    if jax.default_backend() != "cpu":
        _state["reason"] = f"backend {jax.default_backend()} (the native kernels are for the CPU)"
        return False
    cxx = _compiler()
    if cxx is None:
        _state["reason"] = "no C++ compiler (install g++ or set CXX)"
    elif platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _cpu_flags():
        _state["reason"] = "the CPU has no AVX2"
    else:
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
            _state["vector_width"] = int(lib.pantheon_vector_width())
            _state["fixed_point"] = bool(lib.pantheon_fixed_point())
            wide = {t: s for t, s in WIDE_TARGETS.items() if hasattr(lib, s)}
            for target, symbol in {**TARGETS, **wide}.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state["gemm"] = "pantheon_qgemm" in wide
            return True
        except Exception as e:  # noqa: BLE001 - any build or load failure means: the jnp paths
            _state["reason"] = f"build failed: {e}"
    log.warning("native CPU kernels unavailable (%s): decode runs the jnp paths", _state["reason"])
    return False
