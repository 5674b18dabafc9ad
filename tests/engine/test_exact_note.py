"""The startup note where `exact` numerics take the f32 kernels (a CPU without AVX-512 VNNI)."""

from __future__ import annotations

from pantheon.engine import engine


def test_the_note_names_the_f32_kernels_only_where_they_run(monkeypatch):
    monkeypatch.setattr(engine.native_build, "available", lambda: True)
    monkeypatch.setattr(engine.native_build, "fixed_point", lambda: False)  # an AVX2 kind
    note = engine.exact_kernels_note("cpu", "exact", quantized=True)
    assert "no AVX-512 VNNI" in note and "--numerics llamacpp" in note
    assert engine.exact_kernels_note("cpu", "llamacpp", quantized=True) == ""
    assert engine.exact_kernels_note("gpu", "exact", quantized=True) == ""
    assert engine.exact_kernels_note("cpu", "exact", quantized=False) == ""  # F32/F16 files: no 8-bit path to offer
    monkeypatch.setattr(engine.native_build, "fixed_point", lambda: True)  # AVX-512 VNNI: exact integer products
    assert engine.exact_kernels_note("cpu", "exact", quantized=True) == ""
    monkeypatch.setattr(engine.native_build, "available", lambda: False)
    assert engine.exact_kernels_note("cpu", "exact", quantized=True) == ""
