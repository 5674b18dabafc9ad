"""Whole-model checks on tiny random GGUF files (tests/fixtures/tiny_models.py), so the model stack
is covered for configurations the real default model does not have: F32 / K-quant weights, qwen3
(NEOX rope, q/k norms, head_dim != n_embd / n_head), a 4:1 GQA with an untied output, phi3's fused
projections.

For each: the JAX forward with "exact" numerics equals the independent float64 numpy forward
(np_llama.py, which dequantizes with gguf-py) to 1e-4 on every position; chunked prefill and
batched decode through ModelRunner equal the one-shot prefill to 1e-4; the file's tokenizer and
chat template work. Measured max |Δ| is 3e-6..2e-5 on logits of std ~2-4."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.gguf.reader import GGUFError
from pantheon.gguf.arithmetic import NONE, Q8_0, Q8_K, F16
from pantheon.model.spec import ROPE_NEOX, ROPE_NORM, spec_from_gguf
from pantheon.model.weights import load_params, numerics_for
from pantheon.text.chat_template import ChatTemplate
from pantheon.text.tokenizer import Tokenizer
from tests.fixtures.tiny_models import (CHATML, IM_END_ID, IM_START_ID, THINK_CHATML, Q, tiny_vocab_size,
                                        write_tiny_llama)
from tests.model.np_llama import NumpyLlama

TOL = 1e-4
CTX = 64

CONFIGS = {
    "llama_q8_0": dict(weight_type=Q.Q8_0),
    "llama_f32": dict(weight_type=Q.F32),
    "llama_q4_k": dict(weight_type=Q.Q4_K, n_embd=256, n_ff=256),
    "qwen3_q8_0": dict(arch="qwen3", qk_norm=True, head_dim=32, think_tokens=True, chat_template=THINK_CHATML),
    "gqa4_untied_f16": dict(n_head=8, n_head_kv=2, tied=False, weight_type=Q.F16, seed=1),
}

# B is the sequence checked chunked (slot 1); A runs next to it in slot 0 of the batched decode.
TEXT_B = "<|im_start|>user\nhello the world, is it you and I?<|im_end|>\n<|im_start|>assistant\n"
TEXT_A = "<|im_start|>system\nYou are an assistant.<|im_end|>\n"
B_CHUNKS = (7, 13)  # prefill B[:7] then B[7:13], decode the rest
A_PREFILL = 5  # prefill A[:5], then decode A[5:] next to B


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    name = request.param
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / f"{name}.gguf", **CONFIGS[name])
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    tok = Tokenizer.from_gguf(g)
    seq_a, seq_b = tok.encode(TEXT_A), tok.encode(TEXT_B)
    runner = ModelRunner(spec, numerics_for(g, spec, "exact"), load_params(g, spec), n_slots=2, ctx=CTX)
    ref = NumpyLlama(g, spec)
    return dict(name=name, cfg=CONFIGS[name], g=g, spec=spec, tok=tok, runner=runner, a=seq_a, b=seq_b,
                ref_a=ref.logits(seq_a), ref_b=ref.logits(seq_b))


def test_spec_is_what_was_written(tiny):
    cfg, spec = tiny["cfg"], tiny["spec"]
    assert spec.arch == cfg.get("arch", "llama")
    assert spec.rope_style == (ROPE_NEOX if spec.arch == "qwen3" else ROPE_NORM)
    assert spec.qk_norm == cfg.get("qk_norm", False)
    assert spec.tied_embeddings == cfg.get("tied", True)
    assert (spec.n_embd, spec.n_ff) == (cfg.get("n_embd", 64), cfg.get("n_ff", 128))
    assert (spec.n_head, spec.n_head_kv) == (cfg.get("n_head", 4), cfg.get("n_head_kv", 2))
    assert spec.head_dim == cfg.get("head_dim", spec.n_embd // spec.n_head)
    assert spec.n_vocab == tiny_vocab_size(cfg.get("think_tokens", False)) == tiny["tok"].vocab_size
    assert spec.ctx_train == 256


def test_logits_are_not_degenerate(tiny):
    ref = tiny["ref_b"]
    top = ref.argmax(-1)
    assert ref.std() > 1.0
    assert len(set(top.tolist())) > len(top) // 2  # the argmax moves with the context
    assert np.mean(top == np.array(tiny["b"])) < 0.8  # and is not just "repeat the input token"


def test_exact_forward_matches_float64_numpy(tiny):
    """One-shot prefill of the whole sequence (slot 0), every position."""
    runner = tiny["runner"]
    ours = np.asarray(runner.prefill(0, tiny["b"], 0, all_logits=True))
    assert ours.shape == tiny["ref_b"].shape
    diff = np.abs(ours - tiny["ref_b"]).max()
    assert diff <= TOL, f"{tiny['name']}: max |Δ| {diff:.2e}"
    tiny["full_b"] = ours  # for the chunked test (same module-scoped dict)


def test_chunked_prefill_and_batched_decode_match_full_sequence(tiny):
    runner, a, b = tiny["runner"], tiny["a"], tiny["b"]
    full_b = tiny.get("full_b")
    if full_b is None:
        full_b = np.asarray(runner.prefill(0, b, 0, all_logits=True))
    k1, k2 = B_CHUNKS
    assert len(b) - k2 <= len(a) - A_PREFILL, "sequence A too short to decode next to B"

    # slot 0 is overwritten with A; B goes to slot 1 in two chunks
    out_a = np.asarray(runner.prefill(0, a[:A_PREFILL], 0, all_logits=True))
    np.testing.assert_allclose(out_a, tiny["ref_a"][:A_PREFILL], atol=TOL, rtol=0)
    c1 = np.asarray(runner.prefill(1, b[:k1], 0, all_logits=True))
    c2 = np.asarray(runner.prefill(1, b[k1:k2], k1, all_logits=True))
    np.testing.assert_allclose(np.concatenate([c1, c2]), full_b[:k2], atol=TOL, rtol=0)
    last = np.asarray(runner.prefill(1, b[k1:k2], k1))  # last-token logits only; rewrites the same chunk
    np.testing.assert_allclose(last, full_b[k2 - 1], atol=TOL, rtol=0)

    # batched decode: row 0 continues B in slot 1, row 1 continues A in slot 0
    for step, p in enumerate(range(k2, len(b))):
        q = A_PREFILL + step
        logits = np.asarray(runner.decode([1, 0], [b[p], a[q]], [p, q]))
        assert logits.shape == (2, tiny["spec"].n_vocab)
        np.testing.assert_allclose(logits[0], full_b[p], atol=TOL, rtol=0, err_msg=f"B at {p}")
        np.testing.assert_allclose(logits[1], tiny["ref_a"][q], atol=TOL, rtol=0, err_msg=f"A at {q}")


def test_tokenizer_round_trips_and_template_renders(tiny):
    tok, cfg = tiny["tok"], tiny["cfg"]
    text = "hello the world,\n  is it you and I? ünïcödé 123 — ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tiny["b"]) == TEXT_B
    assert tiny["b"][0] == IM_START_ID and IM_END_ID in tiny["b"]
    assert tok.eos_id == IM_END_ID and tok.is_eog(IM_END_ID)

    template = ChatTemplate.from_gguf(tiny["g"], tok)
    assert template.source == (THINK_CHATML if cfg.get("think_tokens") else CHATML)
    prompt = template.render([{"role": "user", "content": "hi"}])
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == head + ("<think>\n" if cfg.get("think_tokens") else "")
    ids = tok.encode(prompt)
    assert tok.decode(ids) == prompt
    if cfg.get("think_tokens"):
        assert ids[-2] == tok.token_to_id("<think>")


# ---- numerics_for: the activation rounding follows the weight type ----------------------------------
@pytest.mark.parametrize("weight_type, embd_type, wide, expect_w, expect_head", [
    (Q.Q8_0, None, False, Q8_0, Q8_0),
    (Q.Q4_1, Q.Q8_0, False, Q8_0, Q8_0),  # SmolLM2's mix
    (Q.Q4_K, None, True, Q8_K, Q8_K),
    (Q.Q6_K, Q.Q8_0, True, Q8_K, Q8_0),
    (Q.F32, None, False, NONE, NONE),
    (Q.F16, Q.F32, False, F16, NONE),
])
@pytest.mark.parametrize("tied", [True, False])
def test_llamacpp_numerics_follow_the_weight_type(tmp_path, weight_type, embd_type, wide, expect_w, expect_head,
                                                  tied):
    dims = dict(n_embd=256, n_ff=256) if wide else {}
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=weight_type, embd_type=embd_type, tied=tied,
                            n_layer=1, **dims)
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    num = numerics_for(g, spec, "llamacpp")
    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert num.scheme(key) == expect_w, key
    # the head is the embedding table when tied, else output.weight (stored as weight_type)
    assert num.scheme("head") == (expect_head if tied else expect_w)
    exact = numerics_for(g, spec, "exact")
    assert all(exact.scheme(k) == NONE for k, _ in num.schemes)


# ---- phi3: fused attn_qkv / ffn_up, split at load --------------------------------------------------------
def test_phi3_fused_projections_match_the_unfused_model(tmp_path):
    """phi3 and qwen2 (without biases) are the same network (NEOX rope); the fixture draws the same
    weights for both and fuses them for phi3, so the phi3 JAX forward must match the numpy forward of
    the unfused qwen2 file."""
    common = dict(weight_type=Q.Q8_0, seed=3, n_layer=1)
    g_phi = open_gguf(write_tiny_llama(tmp_path / "phi3.gguf", arch="phi3", **common))
    g_qwen = open_gguf(write_tiny_llama(tmp_path / "qwen2.gguf", arch="qwen2", **common))
    spec = spec_from_gguf(g_phi)
    assert spec.rope_style == ROPE_NEOX and "blk.0.attn_qkv.weight" in g_phi.tensors
    tokens = Tokenizer.from_gguf(g_phi).encode(TEXT_A)
    runner = ModelRunner(spec, numerics_for(g_phi, spec, "exact"), load_params(g_phi, spec), n_slots=1, ctx=CTX)
    ours = np.asarray(runner.prefill(0, tokens, 0, all_logits=True))
    ref = NumpyLlama(g_qwen, spec).logits(tokens)  # phi3 hyper-parameters, unfused weights
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


# ---- minicpm: llama.cpp's scale defaults for files without the keys ----------------------------------------
def test_minicpm_without_scale_keys_takes_llamacpp_defaults(tmp_path):
    """llama.cpp's loader gives a MiniCPM GGUF without minicpm.embedding_scale / residual_scale /
    logit_scale the scales of the original model (12, 1.4 / sqrt(n_layer), and logits divided by
    256 / n_embd); written keys win. The forward applies them as the numpy reference does."""
    bare = open_gguf(write_tiny_llama(tmp_path / "bare.gguf", arch="minicpm", n_layer=4, n_embd=64))
    spec = spec_from_gguf(bare)
    assert (spec.embed_scale, spec.residual_scale, spec.logit_scale) == (12.0, 1.4 / 2.0, 256.0 / 64)
    keyed = open_gguf(write_tiny_llama(tmp_path / "keyed.gguf", arch="minicpm", n_layer=4, n_embd=64,
                                       extra_metadata={"minicpm.embedding_scale": 3.0, "minicpm.residual_scale": 0.5,
                                                       "minicpm.logit_scale": 2.0}))
    k = spec_from_gguf(keyed)
    assert (k.embed_scale, k.residual_scale, k.logit_scale) == (3.0, 0.5, 2.0)
    llama = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / "llama.gguf", n_layer=4, n_embd=64)))
    assert (llama.embed_scale, llama.residual_scale, llama.logit_scale) == (1.0, 1.0, 1.0)
    tokens = Tokenizer.from_gguf(bare).encode(TEXT_A)
    runner = ModelRunner(spec, numerics_for(bare, spec, "exact"), load_params(bare, spec), n_slots=1, ctx=CTX)
    ours = np.asarray(runner.prefill(0, tokens, 0, all_logits=True))
    np.testing.assert_allclose(ours, NumpyLlama(bare, spec).logits(tokens), atol=TOL, rtol=0)


# ---- dense variants this forward does not implement are refused, sliding windows cap the context ---------------
@pytest.mark.parametrize("change, message", [
    (dict(extra_metadata={"llama.rope.scaling.type": "dynamic"}), "rope.scaling.type 'dynamic' is not supported"),
    (dict(tensor_overrides={"rope_freqs.weight": np.ones(5, np.float32)}), "rope_freqs.weight must hold 8"),
    (dict(tensor_overrides={"rope_freqs.weight": -np.ones(8, np.float32)}), "rope_freqs.weight must hold 8"),
    (dict(extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0}), "must be positive"),
    (dict(arch="phi3", tensor_overrides={"rope_factors_long.weight": np.ones(8, np.float32)}), "LongRoPE"),
    (dict(arch="qwen2", tensor_overrides={"blk.0.ffn_gate_inp.weight": np.ones((4, 64), np.float32)}),
     "routed experts"),
    (dict(tensor_overrides={"blk.0.ffn_gate_inp.weight": np.ones((4, 64), np.float32)}), "llama.expert_count"),
])
def test_unimplemented_dense_variants_are_refused(tmp_path, change, message):
    g = open_gguf(write_tiny_llama(tmp_path / "v.gguf", **change))
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_gguf(g)


def test_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's defaults: no type means linear, no factor means 1 (plain rope); YaRN's ramp
    between ggml_rope_yarn_corr_dims and its magnitude 1 + 0.1 ln(factor)."""
    plain = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / "p.gguf")))
    assert plain.rope_scaling is None
    yarn = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / "y.gguf", arch="qwen2", extra_metadata={
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32}))).rope_scaling
    assert (yarn.freq_scale, yarn.ext_factor, yarn.corr_dims) == (0.25, 1.0, (0.0, 1.0))
    assert yarn.magnitude == pytest.approx(1 + 0.1 * np.log(4.0))
    plain_freqs = (10000.0 ** (-np.arange(0, 16, 2) / 16)).astype(np.float32)
    freqs = yarn.scale(plain_freqs)  # the angles at position 1
    # pair 0, below the ramp (corr dims 0..1), keeps its frequency; the others are interpolated
    assert freqs[0] == pytest.approx(plain_freqs[0]) and np.allclose(freqs[1:], plain_freqs[1:] / 4)
    llama3 = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / "l3.gguf", tensor_overrides={
        "rope_freqs.weight": np.array([1, 1, 1, 1, 2, 4, 8, 8], np.float32)}))).rope_scaling
    assert np.allclose(llama3.scale(plain_freqs), plain_freqs / [1, 1, 1, 1, 2, 4, 8, 8])


def test_a_mistral_window_slides_in_every_layer_and_others_are_ignored_as_llama_cpp_does(tmp_path):
    """Mistral v0.1 (`mistral`): every layer slides, with the global rope; `llama` and `phi3` files
    keep their whole context with full attention, as llama.cpp b11434 serves them (it reads no
    window for llama and disables Phi-3's)."""
    mistral = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / "w.gguf", arch="mistral",
                                                        extra_metadata={"mistral.attention.sliding_window": 96})))
    assert (mistral.ctx_train, mistral.swa_window, mistral.swa_layers) == (256, 96, (True, True))
    assert mistral.rope_base_swa is None
    for arch in ("llama", "phi3"):
        spec = spec_from_gguf(open_gguf(write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch,
                                                         extra_metadata={f"{arch}.attention.sliding_window": 96})))
        assert (spec.ctx_train, spec.swa_window, spec.swa_layers) == (256, 0, ())


def q4k_moe(tmp_path):
    """A tiny qwen3moe with Q4_K experts (4 of 256, top 2, QK-norm)."""
    return write_tiny_llama(tmp_path / "moe.gguf", arch="qwen3moe", weight_type=Q.Q4_K, qk_norm=True, head_dim=64,
                            n_expert=4, n_expert_used=2, n_ff_exp=256, n_embd=256, n_ff=256, n_head=4, n_head_kv=2)


def test_routed_experts_stay_in_their_blocks(tmp_path):
    """A qwen3moe file's Q4_K experts are held as the file's blocks (one QMatrix [X, out, row bytes]
    per role, read by the native kernel), never as an f32 copy; admission counts those bytes."""
    from pantheon.engine.pool import estimate_device_bytes
    from pantheon.native.qmatmul import QMatrix

    path = q4k_moe(tmp_path)
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    layer = load_params(g, spec, numerics=numerics_for(g, spec, "exact"))["layers"][0]
    for key, name in (("exp_gate", "ffn_gate_exps"), ("exp_up", "ffn_up_exps"), ("exp_down", "ffn_down_exps")):
        w, info = layer[key], g.tensor_info(f"blk.0.{name}.weight")
        assert isinstance(w, QMatrix) and w.qtype == Q.Q4_K and w.blocks.nbytes == info.nbytes, key
    expert_bytes = sum(g.tensor_info(n).nbytes for n in g.tensors if "_exps" in n)
    f32_experts = sum(4 * int(np.prod(g.tensor_info(n).shape)) for n in g.tensors if "_exps" in n)
    # the estimate holds the experts at their blocks' size, not f32's
    assert estimate_device_bytes(str(path), 64, 1) < f32_experts + expert_bytes


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_routed_experts_are_read_in_place(tmp_path, mode):
    """Each role of a layer's routed experts is one call of the kernel over the chosen experts'
    rows where the file holds them (qmatmul.expert_qmatmul): no expert is copied out, no per-block
    loop; every token's result is, bit for bit, its own row through each of its experts
    alone (layers.swiglu on layers.expert)."""
    import jax
    import jax.numpy as jnp
    from functools import partial
    from pantheon.model.layers import expert, grouped_experts, swiglu

    path = q4k_moe(tmp_path)
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    numerics = numerics_for(g, spec, mode)
    layer = load_params(g, spec, numerics=numerics)["layers"][0]
    roles = (layer["exp_gate"], layer["exp_up"], layer["exp_down"])
    schemes = tuple(numerics.scheme(key) for key in ("w_gate", "w_up", "w_down"))  # as llama.py asks
    assert schemes == ((NONE,) * 3 if mode == "exact" else (Q8_K,) * 3)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((5, 256)).astype(np.float32))
    experts = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int32))
    fn = jax.jit(partial(grouped_experts, schemes=schemes))
    hlo = fn.lower(x, experts, *roles).as_text()
    assert hlo.count("custom_call @pantheon_expert_matmul(") == 3 and "custom_call @pantheon_qmatmul(" not in hlo
    got = np.asarray(fn(x, experts, *roles))
    for i in range(5):
        for j, e in enumerate(np.asarray(experts[i])):
            alone = swiglu(x[i:i + 1], *(expert(w, int(e)) for w in roles), schemes)
            np.testing.assert_array_equal(got[i, j], np.asarray(alone)[0], err_msg=f"token {i}, expert {e}")


def test_tall_exact_expert_blocks_take_xlas_gemm_without_the_native_one(tmp_path, monkeypatch):
    """Where the native GEMM is not built (AVX2), exact blocks of more than kernel_rows rows go the
    block path (`linear`: XLA's GEMM over the dequantized expert), shorter ones and `llamacpp`
    numerics the expert kernel; with the native GEMM every chunk takes the kernel."""
    import jax
    import jax.numpy as jnp
    from functools import partial
    from pantheon.model import layers

    path = q4k_moe(tmp_path)
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    layer = load_params(g, spec, numerics=numerics_for(g, spec, "exact"))["layers"][0]
    roles = (layer["exp_gate"], layer["exp_up"], layer["exp_down"])

    def kernel_calls(tokens, scheme=NONE):
        x = jnp.zeros((tokens, 256), jnp.float32)
        experts = jnp.zeros((tokens, 2), jnp.int32)
        hlo = jax.jit(partial(layers.grouped_experts, schemes=(scheme,) * 3)).lower(x, experts, *roles).as_text()
        return hlo.count("custom_call @pantheon_expert_matmul(")

    monkeypatch.setattr(layers.build, "gemm", lambda: False)  # an AVX2 build's kernels
    monkeypatch.setattr(layers.build, "fixed_point", lambda: False)
    assert kernel_calls(200) == 0 and kernel_calls(8) == 3  # blocks of 64 rows; of 4
    assert kernel_calls(200, Q8_K) == 3
    monkeypatch.setattr(layers.build, "gemm", lambda: True)
    assert kernel_calls(200) == 3
