"""Pantheon against llama.cpp's own outputs for tiny GGUFs of every dense architecture it accepts
(tests/data/llamacpp/, recorded by tests/tools/make_llamacpp_refs.py with llama.cpp b11434's
llama-server; each file names the build). The models are regenerated here byte for byte (sha256
checked) and run through the runner: `exact` numerics for F32 weights, `llamacpp` (activations
rounded as ggml-cpu does, and Q4_0/Q4_1/Q8_0 products in its integer arithmetic) for quantized ones.

For each prompt, the next token: top-1 equal wherever llama.cpp's top-2 margin >= 0.1, top-10 sets
sharing >= 9, and |Δ log-prob| on llama.cpp's top-10 within the bound of the weight type (entries
below -80 left out: llama.cpp's f32 probabilities are denormal or 0 there — MiniCPM's logit scale
makes its tail that deep); then the 12-token greedy continuation (byte tokens
0x80-0xFF banned, as in the recording) equals llama.cpp's. llama.cpp refuses one fixture,
`mistral` (not an architecture name llama.cpp knows; Mistral GGUFs say `llama`): recorded, not
compared. The phi3 fixture carries "<s>", "</s>", "<unk>" and "<|end|>", which llama.cpp's phi3
vocabulary loading looks up.

Measured max |Δ log-prob| (AVX-512 / AVX2): F32 llama 1.1e-5, qwen2 9e-6, qwen3 7.6e-6, phi3 7.7e-6,
minicpm 1.4e-6 without scale keys (llama.cpp's defaults) and 1.9e-5 with them. Rope variants (F32,
AVX-512): Llama 3.1+'s rope_freqs divisors 6.9e-6, linear scaling (factor 2) 1e-5, YaRN (factor 4,
original context 32, so its ramp falls inside the 16 rotated dims) 1.1e-5; with the scaling left
out the same fixtures miss by 0.2-0.8, 2.6-12 and 0.8-3.1. Gemma 3 (4 layers, two sliding, two
global): F32 3.7e-5 and Q8_0 1.9e-6 with llama.cpp's GELU (ggml-cpu's f16 table, the `llamacpp`
numerics' GELU; `exact` computes the tanh form in f32 and differs from llama.cpp by up to 1.7e-3).
With a sliding window of 8 (most keys of the longer prompts outside it in the sliding layers, in
prefill and in the greedy decode): 4.3e-5; 1.3-2.7 with the window left out. The bound for these new
F32 fixtures is 1e-4 on every prompt (TIGHT). Routed experts (softmax gating, top-k renormalised,
layers.grouped_experts over f32 experts): qwen3moe (8 experts, top 3, QK-norm) F32 7.5e-6 and Q8_0
2.1e-6, llama with experts (Mixtral-style, 4 experts, top 2) F32 7e-6; Q8_0 and K-quant experts are
read in their blocks by the native kernel (`qmatmul.expert_qmatmul`, in place): qwen3moe Q4_K (4 experts of 256, top 2)
<= 4.7e-6 on 4 prompts, 0.12 on one (a Q8_K rounding flip, as the dense Q4_K fixture's). LongRoPE (Phi-3 128k's short
and long factors, attention factor 1.19; original context 64 under the 128 served: the long ones)
1.1e-5. Q8_0 (the native
kernel's integer dot products, which are llama.cpp's own arithmetic, in prefill as in decode):
llama <= 1.8e-6, qwen3 <= 8.9e-7 on every prompt. K-quants (no native kernel: activations rounded
to Q8_K in jnp, then an f32 product), per prompt (AVX2): Q3_K <= 1.2e-5 on all; Q4_K <= 7e-6 on
three, 0.06 and 0.16 on two; Q6_K <= 5e-6 on three, 0.05 and 0.11 on two. Those outliers are
activation-rounding flips, not drift: a value within an f32 ulp of a rounding boundary rounds one
way here and the other in llama.cpp, whose f32 products sum in another order (through the Q4_0/
Q4_1/Q8_0 kernel, Q8_0's 62-token prompt went from 0.12 to 4e-7); the tiny random-weight models
amplify that one quantum, and which prompts flip depends on the CPU's vector width (AVX-512:
Q4_K 0.088). Top-1, top-10 and every greedy continuation are equal everywhere. Bounds: F32 0.05 on
every prompt (the issue's); Q8_0 0.05 on >= 80 % of the prompts and 0.15 on all (every prompt is
within 2e-6 here; the slack is for one flip from an elementwise op another CPU's XLA rounds
differently); Q3_K 0.05 on every prompt (no flip on either CPU kind); Q4_K and Q6_K 0.05 on >= 60 %
of the prompts and 0.3 on all. IQ4 (table-indexed 4-bit codes, in the same kernels: IQ4_NL as Q4_0's
blocks with Q8_0 activations and ggml's two alternating accumulators, IQ4_XS as a K-quant with Q8_K
ones), AVX-512: IQ4_XS <= 1.5e-6 on all 5 (bound: Q8_0's); IQ4_NL <= 6.2e-7 on 3, 0.046 and 0.064
on 2 (llama.cpp repacks IQ4_NL matrices of 8k rows on AVX2 CPUs, iq4_nl_8x8, another order; bound:
Q4_K's)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model.dtypes import KV_DTYPES
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import load_params, numerics_for
from tests.fixtures.tiny_models import Q, write_tiny_llama

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
RECORDS = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}
COMPARED = sorted(name for name, r in RECORDS.items() if "cases" in r)
# (bound on every prompt, bound on a share of them, that share) for |Δ log-prob| on llama.cpp's top-10
BOUND = {"F32": (0.05, 0.05, 1.0), "Q8_0": (0.15, 0.05, 0.8), "Q3_K": (0.05, 0.05, 1.0), "Q4_K": (0.3, 0.05, 0.6),
         "Q6_K": (0.3, 0.05, 0.6), "IQ4_NL": (0.3, 0.05, 0.6), "IQ4_XS": (0.15, 0.05, 0.8)}
# The architectures and rope variants added with the model-families issue are held to its bound for
# F32 files: every prompt within 1e-4 (measured <= 3.7e-5).
TIGHT = {"llama3_rope_freqs_f32": 1e-4, "llama_rope_linear_f32": 1e-4, "qwen2_rope_yarn_f32": 1e-4, "gemma3_f32": 1e-4,
         "gemma3_window8_f32": 1e-4, "qwen3moe_f32": 1e-4, "mixtral_f32": 1e-4, "phi3_longrope_f32": 1e-4}
# Records of llama-server's default attention (flash attention, f16 KV) against Pantheon's f16 KV:
# every prompt within this bound per weight type (measured: F32 llama <= 0.010, gemma3 <= 0.0025;
# Q8_0 gemma3 with a window of 8 <= 0.10). The f16 K/V roundings are the same on both sides; the
# rest is llama.cpp's per-row flash attention (f16 query, f16 running sum of values) against
# Pantheon's f32 softmax and sum, which llama.cpp's own tiled path for 64 rows or more shares.
DEFAULT_ATTENTION_BOUND = {"F32": 0.02, "Q8_0": 0.15}
# --kv-dtype q8_0 against llama.cpp's -ctk q8_0 -ctv q8_0 (the same blocks written; llama.cpp also
# rounds Q to q8_0 for its integer K dot, Pantheon keeps Q f32 and reads the blocks as d * code):
# measured 0.04-0.16 over the five prompts, greedy tokens equal; an f32 or f16 cache against the
# same record is 0.05-0.30 off and its greedy tokens differ
Q8_0_KV_BOUND = {"F32": 0.2}
# llama.cpp takes the log of f32 probabilities: below e^-80 they are denormal (imprecise) or 0 (-FLT_MAX)
PRECISE = -80.0


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max()
    return z - np.log(np.exp(z).sum())


def model(name: str, tmp_path: Path):
    record = RECORDS[name]
    kwargs = dict(record["writer"])
    kwargs["weight_type"] = Q[kwargs["weight_type"]]
    kwargs["extra_tokens"] = tuple(kwargs.get("extra_tokens", ()))
    path = write_tiny_llama(tmp_path / f"{name}.gguf", **kwargs)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["gguf_sha256"], "fixture changed: re-record"
    g = open_gguf(path)
    spec = spec_from_gguf(g).for_context(128)  # the runner's cache below (LongRoPE picks its factors by it)
    # gemma3's GELU is ggml-cpu's f16 table in llama.cpp: its arithmetic is the `llamacpp` numerics'.
    # A record of llama-server's default attention (flash attention, f16 KV) runs on an f16 cache.
    default_attention = "server" in record
    exact = kwargs["weight_type"] == Q.F32 and spec.ffn_act != "gelu" and not default_attention
    numerics = numerics_for(g, spec, "exact" if exact else "llamacpp")
    return record, kwargs["weight_type"].name, ModelRunner(spec, numerics, load_params(g, spec, numerics=numerics),
                                                           n_slots=1, ctx=128,
                                                           dtype=KV_DTYPES[record["server"]["kv"]] if default_attention
                                                           else jnp.float32)


def test_every_accepted_architecture_was_recorded():
    assert set(COMPARED) >= {"llama_f32", "llama_q8_0", "llama_q4_k", "llama_q6_k", "llama_q3_k", "qwen2_f32",
                             "qwen3_f32", "qwen3_q8_0", "minicpm_f32_no_scale_keys", "minicpm_f32_scale_keys",
                             "phi3_f32", "llama3_rope_freqs_f32", "llama_rope_linear_f32", "qwen2_rope_yarn_f32",
                             "gemma3_f32", "gemma3_q8_0", "gemma3_window8_f32", "qwen3moe_f32", "qwen3moe_q8_0",
                             "mixtral_f32", "phi3_longrope_f32", "qwen3moe_q4_k", "llama_iq4_nl", "llama_iq4_xs",
                             "llama_f32_fa_q8kv"}
    assert "architecture: 'mistral'" in RECORDS["mistral_f32"]["refused"]
    assert all(RECORDS[n]["llama_cpp"].startswith("b11434") for n in COMPARED)


@pytest.mark.parametrize("name", COMPARED)
def test_next_token_log_probs_and_greedy_match_llamacpp(name, tmp_path):
    record, wtype, runner = model(name, tmp_path)
    banned = np.arange(record["banned"][0], record["banned"][1] + 1)
    errors = []
    for case in record["cases"]:
        ours = log_softmax(np.asarray(runner.prefill(0, case["prompt"], 0)))
        ref = case["top20"]
        ids = [t for t, _ in ref]
        if ref[0][1] - ref[1][1] >= 0.1:
            assert int(ours.argmax()) == ids[0], (name, case["prompt"][:4])
        assert len(set(np.argsort(-ours)[:10].tolist()) & set(ids[:10])) >= 9, name
        errors.append(max(abs(ours[t] - lp) for t, lp in ref[:10] if lp > PRECISE))
        # the greedy continuation, decoded token by token, with the recording's ban
        tokens, pos, last = [], len(case["prompt"]), ours
        for _ in range(len(case["greedy"])):
            masked = last.copy()
            masked[banned] = -np.inf
            tokens.append(int(masked.argmax()))
            last = np.asarray(runner.decode([0], [tokens[-1]], [pos]))[0]
            pos += 1
        assert tokens == case["greedy"], (name, tokens, case["greedy"])
    every, most, share = BOUND[wtype]
    every = min(every, TIGHT.get(name, every))
    if "server" in record:
        every = most = (Q8_0_KV_BOUND if record["server"]["kv"] == "q8_0" else DEFAULT_ATTENTION_BOUND)[wtype]
    assert max(errors) <= every and np.mean(np.array(errors) <= most) >= share, (name, errors)
