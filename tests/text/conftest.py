"""Fixtures for the text tests: tokenizers built from the reference GGUFs, reference case ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REFERENCE


def reference_case_ids(rel: str) -> list[str]:
    """Case ids of a reference json (read at collection time so each case is its own test)."""
    path = REFERENCE / rel
    if not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    cases = data["cases"] if isinstance(data, dict) else data
    return [c["id"] if isinstance(c, dict) and "id" in c else str(i) for i, c in enumerate(cases)]


def load_cases(reference_dir: Path, rel: str) -> dict[str, dict]:
    data = json.loads((reference_dir / rel).read_text(encoding="utf-8"))
    cases = data["cases"] if isinstance(data, dict) else data
    return {c["id"] if "id" in c else str(i): c for i, c in enumerate(cases)}


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from pantheon.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def qwen35_gguf(qwen35moe_f32_gguf):
    from pantheon.gguf import open_gguf

    return open_gguf(qwen35moe_f32_gguf)


@pytest.fixture(scope="session")
def qwen35_tokenizer(qwen35_gguf):
    from pantheon.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(qwen35_gguf)
