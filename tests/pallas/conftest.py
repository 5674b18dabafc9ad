"""Shared fixtures for the kernel tests: `rng`, a fresh random generator whose seed goes in failure messages."""

from __future__ import annotations

import numpy as np
import pytest


class _Rng:
    """np.random.default_rng() with a fresh seed, remembered for failure messages."""

    def __init__(self):
        self.seed = np.random.SeedSequence().entropy
        self._gen = np.random.default_rng(self.seed)

    def __getattr__(self, name):
        return getattr(self._gen, name)


@pytest.fixture
def rng():
    return _Rng()
