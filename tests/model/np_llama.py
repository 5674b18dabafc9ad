"""An independent float64 numpy forward of the dense llama family, for tests.

Weights come from gguf-py's own dequantizer (not ours), so this checks our quant decoding, weight
layout, rope variant and attention all at once. Full-sequence causal attention, no cache."""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from pantheon.gguf.reader import GGUFFile
from pantheon.model.spec import ROPE_NORM, ModelSpec


class NumpyLlama:
    def __init__(self, g: GGUFFile, spec: ModelSpec):
        self.g, self.spec, self._cache = g, spec, {}

    def w(self, name: str) -> np.ndarray:
        if name not in self._cache:
            info = self.g.tensor_info(name)
            raw = np.asarray(self.g.tensor_data(name))
            arr = raw if raw.dtype in (np.float32, np.float16) else dequantize(raw, info.ggml_type)
            self._cache[name] = np.asarray(arr, dtype=np.float64).reshape(info.shape)
        return self._cache[name]

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.spec.rms_eps) * w

    def _rope(self, x, pos):  # x: [T, H, D]
        s = self.spec
        n = s.rope_dim
        inv = s.rope_base ** (-np.arange(0, n, 2, dtype=np.float64) / n)
        ang = pos[:, None, None] * inv
        c, si = np.cos(ang), np.sin(ang)
        out = x.copy()
        if s.rope_style == ROPE_NORM:
            a, b = x[..., 0:n:2], x[..., 1:n:2]
            out[..., 0:n:2], out[..., 1:n:2] = a * c - b * si, a * si + b * c
        else:
            a, b = x[..., : n // 2], x[..., n // 2:n]
            out[..., : n // 2], out[..., n // 2:n] = a * c - b * si, a * si + b * c
        return out

    def logits(self, tokens: list[int], positions_out: list[int] | None = None) -> np.ndarray:
        """Logits [len(positions_out), V] (all positions when None)."""
        s = self.spec
        t = len(tokens)
        pos = np.arange(t, dtype=np.float64)
        x = self.w("token_embd.weight")[tokens] * s.embed_scale
        mask = np.tril(np.ones((t, t), dtype=bool))
        for i in range(s.n_layer):
            p = f"blk.{i}."
            h = self._norm(x, self.w(p + "attn_norm.weight"))
            q = (h @ self.w(p + "attn_q.weight").T).reshape(t, s.n_head, s.head_dim)
            k = (h @ self.w(p + "attn_k.weight").T).reshape(t, s.n_head_kv, s.head_dim)
            v = (h @ self.w(p + "attn_v.weight").T).reshape(t, s.n_head_kv, s.head_dim)
            if s.qk_norm:
                q = self._norm(q, self.w(p + "attn_q_norm.weight"))
                k = self._norm(k, self.w(p + "attn_k_norm.weight"))
            q, k = self._rope(q, pos), self._rope(k, pos)
            k = np.repeat(k, s.n_group, axis=1)
            v = np.repeat(v, s.n_group, axis=1)
            sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(s.head_dim)
            sc = np.where(mask[None], sc, -np.inf)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            att = np.einsum("hts,shd->thd", sc, v).reshape(t, -1)
            x = x + s.residual_scale * (att @ self.w(p + "attn_output.weight").T)
            h = self._norm(x, self.w(p + "ffn_norm.weight"))
            g = h @ self.w(p + "ffn_gate.weight").T
            u = h @ self.w(p + "ffn_up.weight").T
            x = x + s.residual_scale * ((g / (1 + np.exp(-g)) * u) @ self.w(p + "ffn_down.weight").T)
        if positions_out is not None:
            x = x[positions_out]
        x = self._norm(x, self.w("output_norm.weight"))
        head = self.w("token_embd.weight" if s.tied_embeddings else "output.weight")
        return x @ head.T / s.logit_scale
