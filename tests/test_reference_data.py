"""The reference data the llama.cpp comparisons rely on is all inside the repository: tests/data holds
llama.cpp's recorded outputs, and the tiny qwen35moe GGUFs they were computed from are regenerated
byte for byte (tests/fixtures/reference_qwen35moe.py) instead of being read from a folder beside
the checkout."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pantheon.default_model import sha256_of
from pantheon.gguf import open_gguf
from pantheon.gguf.quants import dequantize_np
from tests.conftest import REPO
from tests.fixtures import reference_qwen35moe as ref

Q = gguf.GGMLQuantizationType


def test_regenerated_f32_model_is_the_file_llamacpp_ran(qwen35moe_f32_gguf):
    assert sha256_of(qwen35moe_f32_gguf) == ref.F32_SHA256


def test_regenerated_quantized_models_are_the_files_llamacpp_quantized(qwen35moe_q3k_experts_gguf,
                                                                       qwen35moe_q3_k_m_gguf):
    """K-quants from the numpy ports of ggml's reference quantizers, laid out as llama_model_quantize
    lays them out; Q3_K_M mixes Q3_K, Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0."""
    assert sha256_of(qwen35moe_q3k_experts_gguf) == ref.Q3K_EXPERTS_SHA256
    assert sha256_of(qwen35moe_q3_k_m_gguf) == ref.Q3_K_M_SHA256
    g = open_gguf(qwen35moe_q3_k_m_gguf)
    assert {Q(g.tensor_info(n).ggml_type) for n in g.tensors} == {Q.F32, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0,
                                                                   Q.Q4_0}


@pytest.mark.parametrize("qtype, bits", [(Q.Q3_K, 3), (Q.Q4_K, 4), (Q.Q5_K, 5), (Q.Q6_K, 6)])
def test_ggml_quantizer_ports_round_trip_through_pantheons_dequantizer(qtype, bits):
    """Independent of the sha256 values: the blocks decode (pantheon's readers) to within a step."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    blocks = ref.quantize_like_ggml(x, qtype)
    assert blocks.shape == (4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = np.asarray(dequantize_np(blocks.reshape(-1), qtype)).reshape(x.shape)
    step = 2 * np.abs(x).max() / (2 ** bits - 1)
    assert np.abs(back - x).max() < step and np.abs(back - x).mean() < step / 3


def test_reference_data_lives_in_the_repository():
    data = REPO / "tests" / "data"
    assert sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) < 2_300_000  # 2.15 MB with the Q3_K_M logits
    assert not list(data.rglob("*.gguf"))
    for rel in ("smollm2/tokenization.json", "smollm2/greedy.json", "smollm2/meta.json",
                "smollm2/logits_last_prompt_user_only_capital.npy", "smollm2/logits_last_prompt_sys_user_colors.npy",
                "qwen35moe/numpy_forward.py", "qwen35moe/ref/sequences.json", "qwen35moe/ref/greedy.json",
                "qwen35moe/ref/tokenizer_ref.json", "qwen35moe/ref/quant_samples.npz"):
        assert (data / rel).is_file(), rel
