"""The graph registry: compiles once per key, counts residency, falls back on a failed compile."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.engine.graphs import GraphKey, GraphRegistry


@partial(jax.jit, static_argnames=("scale",))
def scaled(x, *, scale):
    return x * scale


def test_compiles_once_per_key_and_counts_live_graphs():
    reg = GraphRegistry()
    k1, k2 = GraphKey("decode", "dense", (1,)), GraphKey("decode", "dense", (2,))
    for _ in range(3):
        np.testing.assert_allclose(reg.call(k1, scaled, (jnp.ones(1),), {"scale": 2.0}), [2.0])
    reg.call(k2, scaled, (jnp.ones(2),), {"scale": 3.0})
    assert reg.counters() == {"live": 2, "total": 2, "failed": 0, "ineligible": 0, "pending": 0}
    assert reg.captures == 2 and reg.capture_failures == 0


class Unlowerable:
    """Lowering fails; calling works — like a kernel whose compile fails but whose reference runs."""

    def lower(self, *a, **k):
        raise RuntimeError("lowering failed")

    def __call__(self, x, **k):
        return x + 1


def test_failed_compile_falls_back_counts_failed_then_gives_up():
    reg = GraphRegistry(max_retries=2, backoff_s=0.0)
    key = GraphKey("prefill", "segment", (1,))
    fn = Unlowerable()
    for _ in range(4):
        assert reg.call(key, fn, (1,)) == 2  # correct output through the fallback
    c = reg.counters()
    assert c["failed"] == 1 and c["live"] == 0 and c["gave_up"] == 1
    assert reg.capture_failures == 2  # retried once on the backoff, then gave up


def test_ineligible_is_not_a_failure_and_classes_split():
    reg = GraphRegistry()
    reg.mark_ineligible(GraphKey("decode", "batched_ssm", (1,)))
    reg.call(GraphKey("decode", "batched_attn", (1,)), scaled, (jnp.ones(1),), {"scale": 1.0})
    assert reg.counters("batched_ssm") == {"live": 0, "total": 1, "failed": 0, "ineligible": 1, "pending": 0}
    assert reg.counters("batched_attn")["live"] == 1
    assert reg.classes() == ["batched_attn", "batched_ssm"]


@jax.jit
def squared(x):
    return x * x


def test_forget_traces_drops_jaxs_second_copy_after_each_compile():
    """jax keeps its own trace, lowering and executable of every program the registry compiles; the
    registry holds the executable it calls, so with forget_traces (serving, after the warm-up) a
    compile drops jax's caches. The compiled program still runs; a jitted helper traces again."""
    np.testing.assert_allclose(squared(jnp.full(3, 2.0)), [4.0] * 3)
    keep = GraphRegistry()
    keep.call(GraphKey("decode", "dense", (3,)), scaled, (jnp.ones(3),), {"scale": 2.0})
    assert squared._cache_size() == 1  # jax's copies stay by default
    reg = GraphRegistry(forget_traces=True)
    key = GraphKey("decode", "dense", (5,))
    np.testing.assert_allclose(reg.call(key, scaled, (jnp.ones(5),), {"scale": 4.0}), [4.0] * 5)
    assert squared._cache_size() == 0
    np.testing.assert_allclose(reg.call(key, scaled, (jnp.ones(5),), {"scale": 4.0}), [4.0] * 5)
    assert reg.captures == 1  # the held executable: no recompile
    np.testing.assert_allclose(squared(jnp.full(2, 3.0)), [9.0] * 2)


def test_forget_traces_spares_a_failed_programs_fallback():
    """A program whose compile failed runs traced (jax's caches hold that trace): while one does,
    a later compile leaves the caches alone, so the fallback does not trace again each time."""
    reg = GraphRegistry(forget_traces=True, max_retries=5, backoff_s=60.0)
    failing = GraphKey("decode", "dense", (7,))
    np.testing.assert_allclose(reg.call(failing, Unlowerable(), (np.ones(2),)), [2.0, 2.0])
    np.testing.assert_allclose(squared(jnp.full(2, 3.0)), [9.0] * 2)
    reg.call(GraphKey("decode", "dense", (8,)), scaled, (jnp.ones(8),), {"scale": 2.0})
    assert reg.captures == 1 and squared._cache_size() == 1
