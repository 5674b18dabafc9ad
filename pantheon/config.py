"""Configuration as frozen dataclasses. Environment variable names live here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_HOME = "PANTHEON_HOME"
ENV_MODEL = "PANTHEON_MODEL"
ENV_CTX_CAP = "PANTHEON_CTX_CAP"
ENV_MAX_SESSIONS = "PANTHEON_MAX_SESSIONS"
ENV_MAX_CONCURRENT = "PANTHEON_MAX_CONCURRENT"
ENV_REASONING_BUDGET = "PANTHEON_REASONING_BUDGET"
ENV_NO_THINK = "PANTHEON_NO_THINK"
ENV_TOOL_GRAMMAR = "PANTHEON_TOOL_GRAMMAR"
ENV_COMPILE_CACHE = "PANTHEON_COMPILE_CACHE"

DEFAULT_CTX_CAP = 4096


def pantheon_home() -> Path:
    """Where Pantheon caches the default model and compiled executables."""
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".cache" / "pantheon")


@dataclass(frozen=True)
class ModelConfig:
    """How one model is served: where it comes from and the per-model caps."""

    path: str
    name: str
    ctx_cap: int = DEFAULT_CTX_CAP
    max_sessions: int = 4
    max_concurrent: int = 0  # 0 = the resolved max_sessions
    reasoning_budget: int = 0  # 0 = unbounded
