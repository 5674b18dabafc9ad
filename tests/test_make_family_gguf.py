"""profiles/make_family_gguf.py, the benchmark models' writer (routed experts, qwen3, qwen2, gemma3 at
real shapes): at a small size (the shapes patched down), the file it writes reads back as the
architecture it names, with the source's vocabulary and the shape's features, and loads (routed
experts as the file's blocks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pantheon.gguf import open_gguf
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import load_params, numerics_for
from pantheon.native.qmatmul import QMatrix
from tests.fixtures.tiny_models import write_tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "profiles" / "make_family_gguf.py"


@pytest.fixture(scope="module")
def writer():
    spec = importlib.util.spec_from_file_location("make_family_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape,arch", [("qwen3moe", "qwen3moe"), ("mixtral", "llama"), ("qwen3", "qwen3"),
                                        ("qwen2", "qwen2"), ("gemma3", "gemma3")])
def test_the_written_model_loads_as_its_family(tmp_path, writer, monkeypatch, shape, arch):
    small = writer.SHAPES[shape]._replace(layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=32)
    monkeypatch.setitem(writer.SHAPES, shape, small._replace(experts=4, experts_used=2) if small.experts else small)
    source = write_tiny_llama(tmp_path / "tok.gguf")
    out = writer.main([str(source), str(tmp_path / "model.gguf"), "--shape", shape, "--layers", "2"])
    assert out == 0
    g = open_gguf(tmp_path / "model.gguf")
    spec = spec_from_gguf(g)
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv) == (arch, 2, 64, 4, 2)
    assert spec.n_vocab == spec_from_gguf(open_gguf(source)).n_vocab
    names = set(g.tensors)
    assert ("blk.1.attn_q_norm.weight" in names) == (shape in ("qwen3moe", "qwen3", "gemma3"))
    assert ("blk.0.attn_q.bias" in names) == (shape == "qwen2")
    assert ("blk.1.post_ffw_norm.weight" in names) == (shape == "gemma3")
    if shape == "gemma3":
        assert g.metadata["gemma3.attention.sliding_window"] == 512
    params = load_params(g, spec, numerics=numerics_for(g, spec, "exact"))
    if small.experts:
        assert (spec.n_expert, spec.n_expert_used) == (4, 2)
        assert all(isinstance(params["layers"][1][key], QMatrix) for key in ("exp_gate", "exp_up", "exp_down"))
    else:
        assert spec.n_expert == 0 and "output.weight" not in names  # the output tied to the embedding
