"""The full-step decode program (the contract's `segment` class): one compiled program per batch
bucket, equal to the per-layer programs it replaces, counted in `graphs`, and falling back to the
per-layer programs when it cannot compile, while a layer's KV is on the host, or for a faulted step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pantheon.faults import FAULTS
from pantheon.engine.graphs import GraphRegistry
from pantheon.config import ENV_FULL_STEP
from pantheon.engine.runner import ModelRunner
from pantheon.gguf import open_gguf

from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from tests.fixtures.tiny_models import Q, write_tiny_llama
from tests.fixtures.tiny_qwen35moe import write_tiny_qwen35moe

CTX = 32
PROMPTS = ([1, 72, 101, 108, 108, 111, 44, 32], [1, 200, 31, 7, 250, 99])
STEPS = 5


@pytest.fixture(scope="module", params=["llama", "qwen35moe"])
def model_path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("fs")
    if request.param == "llama":
        return write_tiny_llama(d / "llama.gguf", weight_type=Q.Q8_0, n_layer=3)
    return write_tiny_qwen35moe(d / "q35.gguf", seed=5, n_layer=4, full_attention_interval=2)


def greedy_run(path, monkeypatch, full_step: bool, registry: GraphRegistry | None = None):
    """Prefill PROMPTS into slots 0 and 1, then STEPS greedy batched decode steps (and one at batch 1).
    Returns the decode logits [steps, 2, V] and the runner."""
    monkeypatch.setenv(ENV_FULL_STEP, "1" if full_step else "0")
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec), n_slots=2, ctx=CTX,
                         registry=registry)
    last = [int(np.argmax(np.asarray(runner.prefill(s, p, 0)))) for s, p in enumerate(PROMPTS)]
    out = []
    for i in range(STEPS):
        logits = np.asarray(runner.decode([0, 1], last, [len(p) + i for p in PROMPTS]))[:2]
        out.append(logits)
        last = [int(t) for t in logits.argmax(-1)]
    solo = np.asarray(runner.decode([0], [last[0]], [len(PROMPTS[0]) + STEPS]))[:1]
    return np.stack(out), solo, runner


def test_full_step_equals_per_layer_programs(model_path, monkeypatch):
    ref, ref_solo, per_layer = greedy_run(model_path, monkeypatch, full_step=False)
    # gated out by PANTHEON_FULL_STEP=0: its slots count ineligible (never compiled), not failed
    steps = [k for k in per_layer.registry._slots if k.program == "step"]
    assert {k.bucket for k in steps} == {(1,), (2,)}
    segment = per_layer.registry.counters("segment")
    assert segment["ineligible"] == 2 and segment["failed"] == 0
    assert all(per_layer.registry.counters(c)["ineligible"] == 0 for c in ("batched_attn", "prefill"))
    got, solo, runner = greedy_run(model_path, monkeypatch, full_step=True)
    assert ref.std() > 0.1  # not degenerate
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(solo, ref_solo, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # one `step` program per batch bucket used (2 and 1), live in the segment class; no per-layer
    # decode program ran
    steps = {k.bucket for k in runner.registry._slots if k.program == "step"}
    assert steps == {(1,), (2,)}
    assert runner.registry.counters("segment")["live"] >= 2
    assert not any(k.kind == "decode" and k.program != "step" for k in runner.registry._slots)


def test_failed_full_step_compile_falls_back_then_heals(model_path, monkeypatch):
    ref, _, _ = greedy_run(model_path, monkeypatch, full_step=False)
    registry = GraphRegistry(backoff_s=0.0)
    FAULTS.set("compile", 1)  # the first compile the run attempts (a prefill layer program)...
    try:
        got, _, runner = greedy_run(model_path, monkeypatch, full_step=True, registry=registry)
    finally:
        FAULTS.set("compile", 0)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    FAULTS.set("compile", 1)  # ...and now the full-step program of a new bucket
    try:
        logits = np.asarray(runner.decode([0, 1, 0], [3, 4, 5], [20, 20, 21]))
    finally:
        FAULTS.set("compile", 0)
    assert np.isfinite(logits).all()
    key = next(k for k in registry._slots if k.program == "step" and k.bucket == (4,))
    assert registry.counters("segment")["failed"] == 1
    # the step ran on the per-layer programs meanwhile
    assert any(k.kind == "decode" and k.program != "step" and k.bucket[0] == 4 for k in registry._slots)
    assert registry.retry_due() >= 1
    assert registry._slots[key].exe.compiled is not None
    assert registry.counters("segment")["failed"] == 0


def test_a_kernel_that_cannot_be_lowered_falls_back_to_the_reference(model_path, monkeypatch):
    """The `lowering` fault raises inside the trace where the (native) decode attention kernel is
    lowered: the full-step compile fails, then the per-layer program's; that one runs traced again
    with its kernels on the jnp reference. Same tokens; the failures are counted."""
    ref, ref_solo, _ = greedy_run(model_path, monkeypatch, full_step=False)
    registry = GraphRegistry(backoff_s=60.0)
    jax.clear_caches()  # the kernels are lowered while tracing: make this run trace afresh
    FAULTS.set("lowering", 2)
    try:
        got, solo, _ = greedy_run(model_path, monkeypatch, full_step=True, registry=registry)
    finally:
        FAULTS.set("lowering", 0)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(solo, ref_solo, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert registry.capture_failures == 2
    assert registry.counters("segment")["failed"] == 1
    decode_layers = {k.layer_class for k in registry._slots if k.kind == "decode" and k.program != "step"}
    assert sum(registry.counters(c)["failed"] for c in decode_layers) >= 1


def test_step_fault_and_host_kv_use_the_per_layer_programs(model_path, monkeypatch):
    _, _, runner = greedy_run(model_path, monkeypatch, full_step=True)
    FAULTS.set("step", 1)
    try:
        with pytest.raises(Exception, match="injected device step failure"):
            runner.decode([0], [3], [12])
    finally:
        FAULTS.set("step", 0)
    runner.repair()
    assert np.isfinite(np.asarray(runner.decode([0], [3], [12]))).all()


def sampled_run(path, monkeypatch, full_step: bool):
    """Two rows (one greedy, one seeded sampled with top logprobs) through runner.run's decode:
    the full step with the sampler inlined, or decode then sample."""
    from pantheon.engine.runner import DecodeWork, StepWork
    from pantheon.engine.sampler import SamplingParams

    monkeypatch.setenv(ENV_FULL_STEP, "1" if full_step else "0")
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    fam = family_of(spec)
    runner = ModelRunner(spec, fam.numerics_for(g, spec, "exact"), fam.load_params(g, spec), n_slots=2, ctx=CTX)
    states = [runner.start_sampling(0, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)),
              runner.start_sampling(1, SamplingParams(temperature=0.9, seed=7, logprobs=True, top_logprobs=3,
                                                      presence_penalty=0.5))]
    last = [int(np.argmax(np.asarray(runner.prefill(s, p, 0)))) for s, p in enumerate(PROMPTS)]
    tokens, logprobs = [], []
    for i in range(STEPS):
        out = runner.run(StepWork(decode=DecodeWork([0, 1], last, [len(p) + i for p in PROMPTS], states))).decode
        last = [int(t) for t in out.tokens[:2]]
        tokens.append(last)
        logprobs.append(np.concatenate([out.logprob[:2, None], out.top_logprobs[:2, :3]], 1))
    return np.array(tokens), np.stack(logprobs), runner


def test_sampling_inlined_in_the_full_step_gives_the_same_tokens(model_path, monkeypatch):
    ref_tokens, ref_lp, _ = sampled_run(model_path, monkeypatch, full_step=False)
    tokens, lp, runner = sampled_run(model_path, monkeypatch, full_step=True)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(lp, ref_lp, atol=1e-4, rtol=0)
    progs = {k.program for k in runner.registry._slots if k.kind == "decode"}
    assert progs == {"step_sample"}  # no separate decode or sample program ran for the decode rows
    assert not any(k.program == "sample" and k.bucket[0] == 2 for k in runner.registry._slots)


def test_attention_counters_say_whether_a_kernel_attends(model_path, monkeypatch):
    """`ondie` counts layers whose decode attention runs a kernel (here the native CPU one); the
    jnp reference attending is `host`, with its reason — never counted on-die."""
    _, _, runner = greedy_run(model_path, monkeypatch, full_step=True)
    a = runner.attention.counters(operator=True)
    assert a["ondie"] == a["total"] > 0 and a["host"] == 0 and "reasons" not in a
    monkeypatch.setenv("PANTHEON_KERNELS", "attention_decode=reference")
    a = runner.attention.counters(operator=True)
    assert a["ondie"] == 0 and a["host"] == a["total"] and a["reasons"] == {"no_flash_kernels": a["total"]}
