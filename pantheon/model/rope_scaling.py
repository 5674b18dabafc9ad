"""How a GGUF file scales its rotary embedding, read as llama.cpp reads it: Llama 3.1+'s per-pair
divisors, linear scaling, YaRN and LongRoPE (the dense family's ModelSpec carries the result)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pantheon.gguf.reader import GGUFError, GGUFFile, shown


@dataclass(frozen=True)
class RopeScaling:
    """How a file scales its rotary frequencies, as ggml's rope_yarn computes them. Per pair i the
    frequency base^(-2i/n_rot) is divided by factors[i] (Llama 3's rope_freqs, LongRoPE's factors),
    then interpolated: freq_scale * f (linear, YaRN: 1/factor), and with YaRN mixed back towards the
    unscaled frequency below corr_dims (ramp * ext_factor); cos and sin are multiplied by mscale."""

    factors: tuple[float, ...] | None = None
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    corr_dims: tuple[float, float] = (0.0, 0.0)
    mscale: float = 1.0
    # LongRoPE (Phi-3 long-context files): `factors` are the short ones; a context past n_ctx_orig
    # takes these instead (llama_model::get_rope_factors), chosen by `for_context`
    long_factors: tuple[float, ...] | None = None
    n_ctx_orig: int = 0

    def for_context(self, ctx: int) -> RopeScaling:
        """The scaling a cache of `ctx` positions a sequence runs with (LongRoPE: long or short factors)."""
        if self.long_factors is None or ctx <= self.n_ctx_orig:
            return self
        return replace(self, factors=self.long_factors, long_factors=None)

    def scale(self, theta):
        """The unscaled angles theta [..., n_rot/2] (jnp or numpy f32) as rope_yarn scales them: theta
        / factors, interpolated by freq_scale, and with YaRN mixed back towards theta / factors."""
        extrap = theta if self.factors is None else theta / np.asarray(self.factors, np.float32)
        interp = np.float32(self.freq_scale) * extrap
        if not self.ext_factor:
            return interp
        low, high = self.corr_dims
        y = (np.arange(theta.shape[-1], dtype=np.float32) - np.float32(low)) / np.float32(max(0.001, high - low))
        mix = ((1 - np.clip(y, 0, 1)) * np.float32(self.ext_factor)).astype(np.float32)
        return interp * (1 - mix) + extrap * mix

    @property
    def magnitude(self) -> float:
        """cos and sin's factor: mscale, times YaRN's 1 + 0.1 ln(1/freq_scale) when it extrapolates."""
        return self.mscale * (1.0 + 0.1 * math.log(1.0 / self.freq_scale)) if self.ext_factor else self.mscale


ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def rope_scaling(g: GGUFFile, arch: str, key, n_rot: int, ctx_train: int) -> RopeScaling | None:
    """The file's rope scaling as llama.cpp reads it (llama_model::load_hparams and the context's
    YaRN defaults): `rope.scaling.type` (absent: linear), `rope.scaling.factor` (or the older
    `rope.scale_linear`; absent: 1), `rope.scaling.attn_factor`, `rope.scaling.original_context_length`
    (YaRN's n_ctx_orig; absent: the trained context), YaRN's beta_fast 32 and beta_slow 1, and the
    per-pair divisors of a `rope_freqs.weight` tensor (Llama 3.1+). None when it is plain rope."""
    kind = g.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise GGUFError(f"{g.path}: {arch}.rope.scaling.type {shown(kind)} is not supported "
                        f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
    factor = key("rope.scaling.factor", None, kind=float)
    if factor is None:
        factor = key("rope.scale_linear", 0.0, kind=float)
    freq_scale = 1.0 if kind == "none" or factor == 0 else 1.0 / factor
    if not 0 < freq_scale < math.inf:
        raise GGUFError(f"{g.path}: {arch}.rope.scaling.factor {factor} must be positive")
    attn_factor = key("rope.scaling.attn_factor", 1.0, kind=float)
    ext_factor, corr_dims, mscale = 0.0, (0.0, 0.0), attn_factor
    n_orig = key("rope.scaling.original_context_length", ctx_train)  # YaRN's and LongRoPE's
    if kind == "yarn":
        ext_factor = 1.0
        base = key("rope.freq_base", 10000.0, kind=float)
        corr = lambda beta: n_rot * math.log(n_orig / (beta * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        corr_dims = (max(0.0, math.floor(corr(32.0))), min(n_rot - 1.0, math.ceil(corr(1.0))))
        scale = 1.0 / freq_scale  # llama.cpp's yarn_attn_factor: get_mscale(scale) / (1 + 0.1 ln scale) = 1
        mscale = attn_factor * ((0.1 * math.log(scale) + 1.0) if scale > 1 else 1.0) / (1.0 + 0.1 * math.log(scale))
    def factors_of(name: str) -> tuple[float, ...] | None:
        if name not in g.tensors:
            return None
        info = g.tensor_info(name)
        values = np.asarray(g.tensor_data(name)).reshape(-1)
        if info.ggml_type != 0 or values.size != n_rot // 2 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise GGUFError(f"{g.path}: {name} must hold {n_rot // 2} positive f32 factors (one per rotated pair)")
        return tuple(float(v) for v in values.astype(np.float32))

    # Llama 3.1+'s rope_freqs, else LongRoPE's short/long pair (long past the original context)
    factors, long_factors = factors_of("rope_freqs.weight"), None
    if factors is None and ("rope_factors_short.weight" in g.tensors or "rope_factors_long.weight" in g.tensors):
        factors, long_factors = factors_of("rope_factors_short.weight"), factors_of("rope_factors_long.weight")
        if factors is None or long_factors is None:
            raise GGUFError(f"{g.path}: LongRoPE needs both rope_factors_short.weight and rope_factors_long.weight")
    if factors is None and freq_scale == 1.0 and mscale == 1.0:
        return None
    return RopeScaling(factors, freq_scale, ext_factor, corr_dims, mscale, long_factors, n_orig)
