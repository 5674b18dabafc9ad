"""Causal GQA attention on the host (numpy, float32): the fallback for a layer whose KV buffers
could not be allocated on the device. Same math as pantheon.pallas.attention.attention_reference.
A q8_0 cache (uint8: ggml's blocks) is written and read as the device's is (state.kv_write,
gguf.arithmetic.kv_values)."""

from __future__ import annotations

import numpy as np

from pantheon.gguf.arithmetic import kv_values
from pantheon.model.state import kv_write


def host_attend(q, k, v, k_cache: np.ndarray, v_cache: np.ndarray, positions, slots, window: int = 0,
                ring: bool = False) -> np.ndarray:
    """q [B, T, H, D], k/v [B, T, K, D] (device or host arrays); caches [slots+1, C, K, D] numpy,
    updated in place at the rows' positions (positions past C are dropped; a ring's, ring=True:
    position p at p % C). Returns [B, T, H, D]."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    positions, slots = np.asarray(positions), np.asarray(slots)
    b, t, h, d = q.shape
    n_kv, ctx = k.shape[2], k_cache.shape[1]
    out = np.zeros_like(q)
    for row in range(b):
        pos, slot = positions[row], slots[row]
        keep = np.ones_like(pos, bool) if ring else pos < ctx
        k_cache[slot, pos[keep] % ctx] = np.asarray(kv_write(k[row, keep], k_cache.dtype))
        v_cache[slot, pos[keep] % ctx] = np.asarray(kv_write(v[row, keep], v_cache.dtype))
        s = int(pos.max()) + 1 if keep.any() else 0
        kpos = np.arange(max(s - ctx, 0), s) if ring else np.arange(s)  # the positions the cache holds
        keys = np.asarray(kv_values(k_cache[slot, kpos % ctx]))  # [S, K, D] f32
        values = np.asarray(kv_values(v_cache[slot, kpos % ctx]))
        qg = q[row].reshape(t, n_kv, h // n_kv, d)
        scores = np.einsum("tkgd,skd->tkgs", qg, keys) / np.sqrt(d)
        visible = kpos[None, None, None, :] <= pos[:, None, None, None]
        if window:  # a sliding-window layer: keys less than `window` positions back
            visible &= pos[:, None, None, None] - kpos[None, None, None, :] < window
        scores = np.where(visible, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[row] = np.einsum("tkgs,skd->tkgd", probs, values).reshape(t, h, d)
    return out
