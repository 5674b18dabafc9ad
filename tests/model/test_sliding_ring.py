"""Sliding-window layers hold rings (model/state.py): a gemma3 model whose window is much shorter
than its context keeps only the last R positions in its sliding layers. The ring must compute what
the whole-context cache computes — in chunked prefill past the wrap, in decode, after a session's
export and restore — for a fraction of the memory; and a slot resumes only from a prefix whose
window the ring still holds."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.runner import ModelRunner
from pantheon.engine.sessions import SlotTable
from pantheon.gguf.reader import open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.model.state import RING_WRITES, allocate_kv_cache, ring_len, rewind
from tests.fixtures.tiny_models import write_tiny_llama

WINDOW, CTX = 8, 2048
SLIDING = {"gemma3.attention.sliding_window": WINDOW, "gemma3.attention.sliding_window_pattern": 2,
           "gemma3.context_length": CTX}
# gemma3 interleaves (every 2nd layer global here); Mistral v0.1 (`mistral`) slides in every layer
MODELS = {"gemma3": dict(arch="gemma3", qk_norm=True, extra_metadata=SLIDING),
          "mistral": dict(arch="mistral", extra_metadata={"mistral.attention.sliding_window": WINDOW,
                                                          "mistral.context_length": CTX})}


@pytest.fixture(scope="module", params=list(MODELS))
def gemma(request, tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("ring") / "g.gguf", n_layer=4, seed=16, **MODELS[request.param])
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)

    def runner(windowed: bool) -> ModelRunner:
        r = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec), n_slots=2, ctx=CTX)
        if not windowed:
            r.cache = allocate_kv_cache(spec, 2, CTX, windowed=False)
        return r

    return spec, runner(True), runner(False), path


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 60, n)]


def test_sliding_layers_hold_rings_and_global_ones_the_context(gemma):
    spec, ring, full, _ = gemma
    r = ring_len(spec, CTX)
    assert r % 256 == 0 and WINDOW + RING_WRITES <= r < CTX
    lengths = [r if sliding else CTX for sliding in spec.swa_layers]
    assert lengths == ([r, CTX, r, CTX] if spec.arch == "gemma3" else [r] * 4)
    assert [ring.cache.k[i].shape[1] for i in range(4)] == lengths
    assert [ring.cache.is_ring(i) for i in range(4)] == [n == r for n in lengths]
    assert not any(full.cache.is_ring(i) for i in range(4))
    assert ring.cache.nbytes == full.cache.nbytes * sum(lengths) // (4 * CTX)


def test_prefill_past_the_wrap_and_decode_equal_the_whole_cache(gemma):
    spec, ring, full, _ = gemma
    prompt = tokens(1500, 1)  # chunks of 512, 512, 476: the ring (1280) wraps in the third
    got = np.asarray(ring.prefill(0, prompt, 0, all_logits=True))
    want = np.asarray(full.prefill(0, prompt, 0, all_logits=True))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    other = tokens(40, 2)  # a second row beside it, early in its own context
    ring.prefill(1, other, 0), full.prefill(1, other, 0)
    a, b = [int(np.argmax(got[-1]))], [int(np.argmax(want[-1]))]
    for step in range(12):
        pos = [len(prompt) + step, len(other) + step]
        la = np.asarray(ring.decode([0, 1], [a[-1], 5], pos))[:2]
        lb = np.asarray(full.decode([0, 1], [b[-1], 5], pos))[:2]
        np.testing.assert_allclose(la, lb, atol=1e-5, rtol=1e-5)
        a.append(int(np.argmax(la[0]))), b.append(int(np.argmax(lb[0])))
    assert a == b


def test_an_exported_ring_restores_into_another_slot(gemma):
    spec, ring, _, _ = gemma
    prompt = tokens(1400, 3)
    ring.prefill(0, prompt, 0)
    names = ring.positional()
    assert "k.0" not in names and ("k.1" in names) == (spec.arch == "gemma3")  # a ring exports its whole row
    arrays = ring.export_slot(0, len(prompt))
    assert arrays["k.0"].shape[0] == ring_len(spec, CTX)
    assert {k: (a.shape, str(a.dtype)) for k, a in arrays.items()} == {
        k: (tuple(s), d) for k, (s, d) in ring.slot_layout(len(prompt)).items()}
    ring.import_slot(1, arrays)
    pos = len(prompt)
    logits = np.asarray(ring.decode([0, 1], [7, 7], [pos, pos]))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_slot_resumes_only_within_the_rings_reach(gemma):
    spec = gemma[0]
    back = rewind(spec, CTX)
    assert back == ring_len(spec, CTX) - WINDOW - RING_WRITES > 0
    table = SlotTable(1, 4, rewind=back)
    history = tokens(3000, 4)
    near = history[:len(history) - back] + [1, 2, 3]
    far = history[:len(history) - back - 1] + [1, 2, 3]
    assert table._reusable(history, near) == len(history) - back
    assert table._reusable(history, far) == 0  # its window was overwritten: prefill from the start
    assert SlotTable(1, 4)._reusable(history, far) == len(far) - 3  # a whole-context cache resumes anywhere


def test_a_window_near_the_context_keeps_the_whole_cache(tmp_path):
    path = write_tiny_llama(tmp_path / "g.gguf", arch="gemma3", n_layer=2, qk_norm=True,
                            extra_metadata={**SLIDING, "gemma3.context_length": 1024})
    spec = spec_from_gguf(open_gguf(path))
    assert ring_len(spec, 1024) == 0 and rewind(spec, 1024) is None
    assert ring_len(spec, 1 << 15) > 0


def test_admission_counts_the_rings(gemma):
    """What admission expects a model to hold counts a sliding layer's ring, not the whole context."""
    from pantheon.engine.pool import estimate_device_bytes

    spec, ring, full, path = gemma
    slots = 2  # and the scratch slot
    weights = estimate_device_bytes(str(path), 0, slots, kv_dtype="f32")
    assert estimate_device_bytes(str(path), CTX, slots, kv_dtype="f32") - weights == ring.cache.nbytes < full.cache.nbytes
