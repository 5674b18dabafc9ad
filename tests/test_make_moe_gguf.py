"""profiles/make_moe_gguf.py, the routed-experts benchmark model's writer: at a small size (the shapes
patched down), the file it writes reads back as the architecture it names, with the source's
vocabulary, and its experts load as the file's blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pantheon.gguf import open_gguf
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import load_params, numerics_for
from pantheon.native.qmatmul import QMatrix
from tests.fixtures.tiny_models import write_tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "profiles" / "make_moe_gguf.py"


@pytest.fixture(scope="module")
def writer():
    spec = importlib.util.spec_from_file_location("make_moe_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape,arch", [("qwen3moe", "qwen3moe"), ("mixtral", "llama")])
def test_the_written_model_loads_with_its_experts_in_blocks(tmp_path, writer, monkeypatch, shape, arch):
    monkeypatch.setitem(writer.SHAPES, shape, (3, 64, 4, 2, 16, 4, 2, 32))
    source = write_tiny_llama(tmp_path / "tok.gguf")
    out = writer.main([str(source), str(tmp_path / "moe.gguf"), "--shape", shape, "--layers", "2"])
    assert out == 0
    g = open_gguf(tmp_path / "moe.gguf")
    spec = spec_from_gguf(g)
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.n_expert, spec.n_expert_used) == (arch, 2, 64, 4, 2)
    assert spec.n_vocab == spec_from_gguf(open_gguf(source)).n_vocab
    layer = load_params(g, spec, numerics=numerics_for(g, spec, "exact"))["layers"][1]
    assert all(isinstance(layer[key], QMatrix) for key in ("exp_gate", "exp_up", "exp_down"))
