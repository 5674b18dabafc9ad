"""Embeddings from a generative model: the final-normed hidden states of a sequence, pooled into one
vector and L2-normalised, as llama.cpp's server computes them (`--embedding`). The pooling is the
file's (`<arch>.pooling_type`: mean, cls = the first token, last), else mean: a causal LM's file
names none."""

from __future__ import annotations

import numpy as np

# GGUF pooling_type values (llama.cpp's enum llama_pooling_type)
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_of(metadata, arch: str) -> str:
    """The file's pooling, or "mean" where it names none (or one this server does not pool by)."""
    kind = POOLING.get(int(metadata.get(f"{arch}.pooling_type", 1)), "mean")
    return kind if kind in ("none", "mean", "cls", "last") else "mean"


def pool(hidden: np.ndarray, kind: str) -> np.ndarray:
    """hidden [n, E] -> [E] (or [n, E] unpooled for "none")."""
    if kind == "none":
        return hidden
    if kind == "cls":
        return hidden[0]
    if kind == "last":
        return hidden[-1]
    return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)


def normalize(v: np.ndarray) -> np.ndarray:
    """L2-normalised along the last axis (a zero vector stays zero)."""
    norm = np.sqrt(np.sum(np.square(v, dtype=np.float64), axis=-1, keepdims=True))
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)
