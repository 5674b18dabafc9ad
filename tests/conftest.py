"""Shared fixtures: the default model file, llama.cpp's reference data (tests/data, see its README)
and the tiny qwen35moe GGUFs that data was computed from, regenerated once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Models load without the compile warm-up (runner.warm_up: ~4 s warm, ~20 s cold per model) unless
# a test asks for it: the suite loads dozens of models, and inherits this into its live servers.
os.environ.setdefault("PANTHEON_WARMUP", "0")

REPO = Path(__file__).resolve().parents[1]
# llama.cpp's recorded outputs; PANTHEON_REFERENCE_DIR may point at another copy with the same layout.
REFERENCE = Path(os.environ.get("PANTHEON_REFERENCE_DIR") or REPO / "tests" / "data")


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    assert REFERENCE.is_dir(), f"reference data not found at {REFERENCE} (set PANTHEON_REFERENCE_DIR)"
    return REFERENCE


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from pantheon.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M base, Q4_K_M, from PyPI's chunk wheels (sha256-checked, cached)."""
    from pantheon.default_model import gemma3_270m_path

    return gemma3_270m_path()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
    from pantheon.gguf import open_gguf

    return open_gguf(smollm2_path)


# ---- the tiny qwen35moe reference models (tests/fixtures/reference_qwen35moe.py) ----------------------
@pytest.fixture(scope="session")
def _qwen35moe_models(tmp_path_factory):
    """Writes a reference model into one session folder on first request; returns its path."""
    from tests.fixtures import reference_qwen35moe as ref

    folder = tmp_path_factory.mktemp("qwen35moe_reference")
    weights = []

    def get(name: str) -> Path:
        path = folder / name
        if not path.exists():
            if not weights:
                weights.append(ref.make_weights())
            ref.WRITERS[name](path, weights[0])
        return path

    return get


@pytest.fixture(scope="session")
def qwen35moe_f32_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_f32.gguf: the F32 file llama.cpp's qwen35moe logits in tests/data come from."""
    from tests.fixtures.reference_qwen35moe import F32_NAME

    return _qwen35moe_models(F32_NAME)


@pytest.fixture(scope="session")
def qwen35moe_q3k_experts_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_q3k_experts.gguf: its experts Q3_K as llama.cpp's quantizer wrote them."""
    from tests.fixtures.reference_qwen35moe import Q3K_EXPERTS_NAME

    return _qwen35moe_models(Q3K_EXPERTS_NAME)


@pytest.fixture(scope="session")
def qwen35moe_q3_k_m_gguf(_qwen35moe_models) -> Path:
    """tiny_qwen35moe_q3_k_m.gguf: llama.cpp's stock Q3_K_M file of the model."""
    from tests.fixtures.reference_qwen35moe import Q3_K_M_NAME

    return _qwen35moe_models(Q3_K_M_NAME)


# ---- the fast lane ---------------------------------------------------------------------------------------
SLOW_FIXTURES = {"smol_server", "gemma3_path"}  # a real server process; the real Gemma 3 file


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that starts a real server (through these fixtures or ServerProcess in
    its module) or reads a real model: `pytest -m "not slow"` runs the rest, in process."""
    starts_servers: dict = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts_servers:
            starts_servers[path] = "ServerProcess(" in path.read_text(errors="replace")
        if starts_servers[path] or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
