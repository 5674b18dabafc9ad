"""Gated delta rule (the recurrence of a Gated DeltaNet layer): plain-jnp reference.

Per batch row b and value head h, with the state S a [Dk, Dv] matrix (S[i, m]: key index i, value
index m), each token t does

    S   = S * exp(g_t)                 # decay; g_t <= 0 is a log-decay
    δ   = β_t * (v_t - Sᵀ k_t)         # what the memory gets wrong about v_t
    S   = S + k_t ⊗ δ                  # rank-1 correction
    o_t = Sᵀ q_t                       # read with the *updated* state

This is llama.cpp's sequential `ggml_gated_delta_net`, which it runs for prefill and decode alike.
A Pallas kernel with the same signature is meant to sit beside this function."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST  # f32 dots even where the backend would default to tf32/bf16


def gated_delta_rule_reference(q, k, v, g, beta, state, lengths=None):
    """q, k: [B, T, H, Dk] float32, already L2-normalised (q also scaled by 1/sqrt(Dk)) and already
    mapped to the H value heads; v: [B, T, H, Dv]; g (log-decay <= 0), beta: [B, T, H];
    state: [B, H, Dk, Dv]; lengths: int32 [B] or None. Steps t >= lengths[b] leave row b's state
    unchanged and output zeros. Returns (out [B, T, H, Dv], new state [B, H, Dk, Dv])."""
    b, t = q.shape[:2]
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t, i = inputs  # q_t, k_t: [B, H, Dk]; v_t: [B, H, Dv]; g_t, beta_t: [B, H]
        s_new = s * jnp.exp(g_t)[..., None, None]
        recalled = jnp.einsum("bhim,bhi->bhm", s_new, k_t, precision=_HI)  # Sᵀ k: [B, H, Dv]
        delta = beta_t[..., None] * (v_t - recalled)
        s_new = s_new + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhim,bhi->bhm", s_new, q_t, precision=_HI)
        valid = (i < lengths)[:, None, None]  # [B, 1, 1]: padded steps keep the state
        return jnp.where(valid[..., None], s_new, s), jnp.where(valid, o_t, 0.0)

    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    state, out = lax.scan(step, state.astype(jnp.float32), (*time_major, jnp.arange(t)))
    return jnp.moveaxis(out, 0, 1), state
