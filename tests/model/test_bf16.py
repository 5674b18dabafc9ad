"""The bf16 device numerics (model/dtypes.py), run on the CPU against float32 with stated tolerances.

On a GPU Pantheon computes with bf16 weights, KV and matmul/attention operands (f32 accumulation,
f32 residual stream, norms, softmax statistics, router and recurrent state). XLA:CPU runs the same
programs, so the bf16 path is checked here without a GPU:

* SmolLM2-135M (the real weights): prefill + 8 teacher-forced decode steps of three reference
  prompts in bf16 against f32. Tolerances: max |Δ logit| <= 1.0 and mean <= 0.15 (logits span
  about ±40; measured max 0.48, mean 0.06), top-1 equal wherever f32's top-2 margin >= 0.5
  (measured: equal at every position), and the log-prob KL(f32 || bf16) <= 0.02 per position.
* the tiny qwen35moe with Q3_K experts (DeltaNet + gated attention + MoE, 4 experts top-2, random
  router): per-position max |Δ logit| <= 0.4 on >= 90 % of positions (measured 0.04-0.35 over
  ±15 logits), mean <= 0.1 (measured 0.07), KL <= 0.2 everywhere. One
  position of 21 flips a near-tied expert choice in bf16 (Δ 2.5, KL 0.17): routing is discrete,
  so a tolerance on it is a bound on how often, not on how far. Its
  interpreted Pallas kernels (flash prefill, in-place decode, grouped Q3_K MoE, DeltaNet) taking
  bf16 operands equal the bf16 reference path to 5e-2 (logits ±15).
* the layout: matrices bf16; norms, router, conv taps f32; KV bf16, recurrent state f32; the
  native decode attention (f32 only) is recorded as `reference` for a bf16 cache; no decode quant
  blocks are held.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.config import ENV_FULL_STEP
from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model import dtypes, kernels as kern
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.pallas.moe_q3k import Q3KPlanes
from tests.fixtures.tiny_qwen35moe import Q3K_SHAPES, Q, write_tiny_qwen35moe

F32, BF16 = jnp.float32, jnp.bfloat16


def test_compute_dtype_by_backend_and_override():
    assert dtypes.compute_dtype("cuda", env="") == BF16
    assert dtypes.compute_dtype("cpu", env="auto") == F32
    assert dtypes.compute_dtype("cpu", env="bfloat16") == BF16
    assert dtypes.compute_dtype("cuda", env="float32") == F32
    with pytest.raises(ValueError, match="PANTHEON_DTYPE"):
        dtypes.compute_dtype("cpu", env="fp8")


def run(path, dtype, prompt, steps, ctx=256):
    """Prefill `prompt` then decode `steps` (teacher forced) in `dtype`: (logits [n, V], runner)."""
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec, dtype=dtype),
                         n_slots=1, ctx=ctx, dtype=dtype)
    out = [np.asarray(runner.prefill(0, prompt, 0, all_logits=True), np.float64)]
    for i, tok in enumerate(steps):
        out.append(np.asarray(runner.decode([0], [tok], [len(prompt) + i]), np.float64)[:1])
    return np.concatenate(out), runner


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def assert_close(f32, bf16, max_abs, mean_abs, kl, margin=0.5, outliers=0.0):
    """Logit tolerances; `outliers`: the fraction of positions allowed past max_abs (an MoE whose
    router sees a near-tie may pick another expert in bf16: a discrete flip, bounded by `kl`)."""
    diff = np.abs(f32 - bf16)
    per_position = diff.max(-1)
    assert (per_position > max_abs).mean() <= outliers and diff.mean() <= mean_abs, (per_position, diff.mean())
    assert diff.max() > 1e-4  # the bf16 path really ran (f32 twice would agree to ~1e-6)
    top2 = np.sort(f32, -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= margin
    assert (f32.argmax(-1) == bf16.argmax(-1))[decided].all()
    lp, lq = log_softmax(f32), log_softmax(bf16)
    assert (np.exp(lp) * (lp - lq)).sum(-1).max() <= kl


@pytest.fixture(scope="module")
def smollm2_cases(reference_dir):
    return json.loads((reference_dir / "smollm2" / "greedy.json").read_text())["cases"][:3]


def test_smollm2_bf16_within_tolerance_of_f32(smollm2_path, smollm2_cases):
    for case in smollm2_cases:
        prompt, steps = case["prompt_ids"], case["generated_ids"][:8]
        f32, _ = run(smollm2_path, F32, prompt, steps)
        bf16, runner = run(smollm2_path, BF16, prompt, steps)
        assert_close(f32, bf16, max_abs=1.0, mean_abs=0.15, kl=0.02)
    layer = runner.params["layers"][0]
    assert layer["wqkv"].dtype == BF16 and layer["attn_norm"].dtype == F32
    assert "decode" not in runner.params  # the native quant-block kernels serve the f32 path only
    assert runner.cache.k[0].dtype == BF16
    # the native decode attention reads f32, f16 and bf16 caches; any other type is recorded on the reference
    assert dict(kern.choose({kern.ATTENTION_DECODE: True}, BF16))[kern.ATTENTION_DECODE] in ("native", "interpret")
    assert dict(kern.choose({kern.ATTENTION_DECODE: True}, jnp.float64))[kern.ATTENTION_DECODE] in ("reference",
                                                                                                    "interpret")
    assert runner.attention.kernel_reason() in (None, "no_flash_kernels")


@pytest.fixture(scope="module")
def tiny_q3k(tmp_path_factory):
    return write_tiny_qwen35moe(tmp_path_factory.mktemp("bf16") / "q35.gguf", expert_type=Q.Q3_K, seed=5,
                                n_layer=2, full_attention_interval=2, d_state=32, **Q3K_SHAPES)


PROMPT, STEPS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 9, 17, 250], [40, 41, 42, 43, 7, 99]


def test_qwen35moe_q3k_bf16_within_tolerance_of_f32(tiny_q3k, monkeypatch):
    monkeypatch.setenv("PANTHEON_KERNELS", "reference")
    f32, _ = run(tiny_q3k, F32, PROMPT, STEPS, ctx=32)
    bf16, runner = run(tiny_q3k, BF16, PROMPT, STEPS, ctx=32)
    assert_close(f32, bf16, max_abs=0.4, mean_abs=0.1, kl=0.2, outliers=0.1)
    layer = runner.params["layers"][0]
    assert isinstance(layer["exp_down"], Q3KPlanes)  # experts stay in their blocks
    assert layer["router"].dtype == F32 and layer["conv"].dtype == F32 and layer["w_qkv"].dtype == BF16
    assert runner.cache.ssm[0].dtype == F32 and runner.cache.k[0].dtype == BF16


def test_qwen35moe_interpreted_kernels_take_bf16_operands(tiny_q3k, monkeypatch):
    monkeypatch.setenv(ENV_FULL_STEP, "0")
    monkeypatch.setenv("PANTHEON_KERNELS", "reference")
    ref, _ = run(tiny_q3k, BF16, PROMPT, STEPS, ctx=32)
    monkeypatch.setenv("PANTHEON_KERNELS", "interpret")
    got, runner = run(tiny_q3k, BF16, PROMPT, STEPS, ctx=32)
    assert float(np.abs(got - ref).max()) <= 5e-2  # measured 0.03 (the kernels round softmax weights to bf16 for the PV dot)
    assert runner.attention.kernel_reason() is None  # the (interpreted) kernels attend
