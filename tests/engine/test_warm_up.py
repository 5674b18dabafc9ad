"""The compile warm-up at load (runner.warm_up): every prefill chunk bucket's programs, the sampler
after a prefill and the full decode step of every batch bucket are compiled from abstract shapes,
so no request waits for a compile. After it, prefills of any length and decode steps at any batch
size compile nothing new, give the same logits as a runner that compiled on first use, and the
residency counters still count only the slots a forward has reached."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.chunks import CHUNK_BUCKETS
from pantheon.engine.runner import DecodeWork, ModelRunner
from pantheon.engine.sampler import SamplingParams
from pantheon.gguf import open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from tests.fixtures.tiny_models import Q, write_tiny_llama
from tests.fixtures.tiny_qwen35moe import write_tiny_qwen35moe

CTX = 64  # chunk buckets 16-64: enough to cover three prompt lengths, cheap to compile


@pytest.fixture(scope="module", params=["llama", "qwen35moe"])
def model_path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    if request.param == "llama":
        return write_tiny_llama(d / "llama.gguf", weight_type=Q.Q8_0, n_layer=2)
    return write_tiny_qwen35moe(d / "q35.gguf", seed=5, n_layer=2, full_attention_interval=2)


def runner_for(path) -> ModelRunner:
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    return ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec), n_slots=2, ctx=CTX)


def serve(runner: ModelRunner) -> list[np.ndarray]:
    """Prefills of three lengths (one at a later position) and a sampled one, then decode steps at
    batch 1 and 2 (the slots' buckets; a 2-slot runner never decodes 4 or 8 rows)."""
    out = [np.asarray(runner.prefill(0, list(range(1, 6)), 0)),
           np.asarray(runner.prefill(1, list(range(3, 43)), 0)),
           np.asarray(runner.prefill(0, list(range(7, 27)), 5))]
    sampling = [runner.start_sampling(s, SamplingParams(temperature=0)) for s in range(2)]
    out.append(np.asarray(runner.sample(runner.prefill(1, [6], 40)[None], [1], [sampling[1]]).tokens))
    for slots, pos in (([0], 25), ([0, 1], 41)):
        work = DecodeWork(slots, [11] * len(slots), [pos] * len(slots), [sampling[s] for s in slots])
        out.append(np.asarray(runner.decode_and_sample(work).tokens))
    return out


def test_warm_up_compiles_what_serving_needs(model_path):
    cold = runner_for(model_path)
    expected = serve(cold)
    warm = runner_for(model_path)
    seconds = warm.warm_up()
    assert seconds > 0 and warm.registry.capture_failures == 0
    assert warm.registry.counters()["total"] == 0  # nothing exercised yet: no slot counted
    compiled = warm.registry.captures
    assert compiled >= len([c for c in CHUNK_BUCKETS if c <= CTX]) + 2  # prefill buckets + the decode steps
    got = serve(warm)
    assert warm.registry.captures == compiled  # not one compile while serving
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert warm.registry.counters()["live"] == warm.registry.counters()["total"] > 0


def test_the_warm_up_hands_what_compiling_freed_back_to_the_os(model_path, monkeypatch):
    """Tracing and compiling free most of what they allocate, but the allocator keeps the pages: the
    warm-up ends by collecting garbage and handing them back (memory.release_free_memory)."""
    import pantheon.engine.runner as runner_module

    runner = runner_for(model_path)
    compiled_before = []
    monkeypatch.setattr(runner_module, "release_free_memory", lambda: compiled_before.append(runner.registry.captures))
    runner.warm_up()
    assert compiled_before == [runner.registry.captures] and runner.registry.captures > 0  # once, after every compile
