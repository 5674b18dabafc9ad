"""Admission estimates the bytes a model will really occupy (tensor by tensor, as the loaders place
them) and compares them with the memory of its target: its dies' budgets on an accelerator, the
host's available memory on the CPU."""

from __future__ import annotations

import jax
import pytest

from pantheon.config import ModelConfig
from pantheon.engine import pool as pool_mod
from pantheon.engine.dies import Die
from pantheon.engine.pool import ModelPool, PoolError, estimate_device_bytes
from pantheon.gguf import open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import spec_from_gguf
from pantheon.model.weights import params_nbytes
from tests.fixtures.reference_qwen35moe import write_f32, write_q3k_experts
from tests.fixtures.tiny_models import Q, write_tiny_llama


def weight_bytes(path) -> int:
    g = open_gguf(path)
    spec = spec_from_gguf(g)
    return params_nbytes(family_of(spec).load_params(g, spec))


@pytest.mark.parametrize("make", [
    lambda d: write_q3k_experts(d / "q3k.gguf"), lambda d: write_f32(d / "f32.gguf"),
    lambda d: write_tiny_llama(d / "q41.gguf", weight_type=Q.Q4_1, embd_type=Q.Q8_0)],
    ids=["qwen35moe-q3k-experts", "qwen35moe-f32", "llama-q4_1"])
def test_the_estimate_is_what_the_loader_places(tmp_path, make):
    path = make(tmp_path)
    per_slot = estimate_device_bytes(str(path), 64, 1) - estimate_device_bytes(str(path), 64, 0)
    weights = estimate_device_bytes(str(path), 64, 0) - per_slot  # n_slots=0 still holds the scratch slot
    actual = weight_bytes(path)
    assert abs(weights - actual) <= 0.02 * actual, (weights, actual)


def test_q3k_experts_are_charged_as_blocks(tmp_path):
    blocks = estimate_device_bytes(str(write_q3k_experts(tmp_path / "q.gguf")), 64, 0)
    dense = estimate_device_bytes(str(write_f32(tmp_path / "f.gguf")), 64, 0)
    assert blocks < 0.5 * dense


def test_an_accelerator_admits_against_its_dies_budget(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    need = estimate_device_bytes(str(path), 4096, 5)
    config = ModelConfig(path=str(path), name="m")
    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    die = lambda budget: [Die(0, 0, "gpu", budget, 0, "device")]
    monkeypatch.setattr(pool_mod, "visible_dies", lambda: die(4 * need))
    pool = ModelPool()
    pool._admit(config)  # fits
    monkeypatch.setattr(pool_mod, "visible_dies", lambda: die(need // 2))
    with pytest.raises(PoolError) as e:
        pool._admit(config)
    assert e.value.status == 507 and "on dies [0]" in e.value.message
