"""Shared fixtures: the default model file and llama.cpp's reference data in ../shared/reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PANTHEON_SHARED", REPO.parent / "shared"))
REFERENCE = Path(os.environ.get("PANTHEON_REFERENCE_DIR", SHARED / "reference"))


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    assert REFERENCE.is_dir(), f"reference data not found at {REFERENCE} (set PANTHEON_REFERENCE_DIR)"
    return REFERENCE


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from pantheon.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
    from pantheon.gguf import open_gguf

    return open_gguf(smollm2_path)
