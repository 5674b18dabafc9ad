"""Long rows' K-quant blocks load K-tile-major for exact numerics where the fixed-point kernel runs
(AVX-512 VNNI; native/qmatmul.tile_k): the model answers exactly as with the file's row order, in
decode (the kernel), short prefill (the kernel) and long prefill (the blocks dequantized), and
llamacpp numerics or another CPU keep the row order."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.config import ENV_FULL_STEP
from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf
from pantheon.model import weights
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.native import build
from pantheon.native import qmatmul as native
from tests.fixtures.tiny_models import Q, write_tiny_llama

SHORT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]
LONG = (SHORT * 43)[:512]  # one chunk of 512 rows: past every kernel's rows, so the blocks are dequantized for XLA's GEMM
STEPS = [40, 41, 42]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Down projections of 2304 (nine super-blocks: a full tile and a short one) in Q4_K, Q6_K, Q5_K."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiled") / "tiled.gguf", n_layer=3, n_embd=256, n_head=4,
                            n_head_kv=2, n_ff=2304, weight_type=Q.Q4_K, embd_type=Q.Q8_0, seed=11,
                            type_overrides={"blk.1.ffn_down.weight": Q.Q6_K, "blk.2.ffn_down.weight": Q.Q5_K})


def run(path, mode: str):
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    numerics = family_of(spec).numerics_for(g, spec, mode)
    params = weights.load_params(g, spec, numerics=numerics)
    outs = []
    for prompt in (SHORT, LONG):
        runner = ModelRunner(spec, numerics, params, n_slots=1, ctx=1024)
        prefill = np.asarray(runner.prefill(0, prompt, 0, all_logits=True))
        steps = [np.asarray(runner.decode([0], [t], [len(prompt) + i]))[0] for i, t in enumerate(STEPS)]
        outs.append((prefill, np.stack(steps)))
    return outs, [layer["w_down"].qtype for layer in params["layers"]]


def test_long_rows_load_tiled_and_answer_as_in_row_order(model, monkeypatch):
    monkeypatch.setenv(ENV_FULL_STEP, "0")
    monkeypatch.setattr(native, "TILE_MIN_IN", 2048)  # the tiny model's rows of 2304 count as long
    tiled, types = run(model, "exact")
    if build.fixed_point():
        assert types == [Q.Q4_K + native.TILED, Q.Q6_K + native.TILED, Q.Q5_K + native.TILED]
    else:  # the f32 kernels (AVX2) read row order only
        assert types == [Q.Q4_K, Q.Q6_K, Q.Q5_K]
    monkeypatch.setattr(native, "TILE_MIN_IN", 1 << 30)  # the same kernels, the rows loaded in order
    rows, types = run(model, "exact")
    assert types == [Q.Q4_K, Q.Q6_K, Q.Q5_K]
    for (p_t, s_t), (p_r, s_r) in zip(tiled, rows):
        np.testing.assert_array_equal(p_t, p_r)
        np.testing.assert_array_equal(s_t, s_r)


def test_llamacpp_numerics_keep_row_order(model, monkeypatch):
    monkeypatch.setattr(native, "TILE_MIN_IN", 2048)
    g = open_gguf(model)
    spec = spec_from_gguf(g)
    params = weights.load_params(g, spec, numerics=family_of(spec).numerics_for(g, spec, "llamacpp"))
    assert [layer["w_down"].qtype for layer in params["layers"]] == [Q.Q4_K, Q.Q6_K, Q.Q5_K]
