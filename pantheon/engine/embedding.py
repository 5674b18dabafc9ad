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
    return p_normalize(v, 2)


def p_normalize(v: np.ndarray, p: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize over the last axis: p = -1 none, 0 the largest |v| scaled to
    32760 (the int16 range), 1 taxicab, 2 Euclidean, larger p the p-norm; a zero vector stays zero."""
    a = np.abs(v.astype(np.float64))
    if p == -1:
        return v.astype(np.float32)
    if p == 0:
        norm = a.max(axis=-1, keepdims=True) / 32760.0
    elif p == 2:
        norm = np.sqrt(np.sum(a * a, axis=-1, keepdims=True))
    else:
        with np.errstate(over="ignore"):  # past f64: inf (then a zero vector), as llama.cpp's pow
            norm = np.sum(a ** float(p), axis=-1, keepdims=True) ** (1.0 / p)
    return (v / np.where(norm > 0, norm, np.inf)).astype(np.float32)
