"""pantheon.gguf.reader on tiny files written by gguf-py (tests/fixtures/tiny_models.py): metadata and
tensors read back as written, zero-copy tensor views, and every malformed file raising GGUFError with
the file's path and the problem named (never a struct/numpy/OS exception). The ModelSpec checks on
top of the reader (unknown architecture, inconsistent shapes) are here too.

Malformed files are made by patching a valid one: `_tensor_record` finds a tensor's info record
(u64 name length, name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset) in the header."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from pantheon.gguf import open_gguf
from pantheon.gguf.quants import quantize_np
from pantheon.gguf.reader import GGUFError, GGUFFile
from pantheon.model.spec import spec_from_gguf
from tests.fixtures.tiny_models import (BOS_ID, CHATML, CONTEXT_LENGTH, EOS_ID, PAD_ID, UNK_ID, Q,
                                        tiny_llama_tensors, tiny_vocab, write_tiny_llama)

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=5)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("reader") / "tiny.gguf", weight_type=Q.Q8_0, **TINY)


@pytest.fixture(scope="module")
def tiny_bytes(tiny_path) -> bytes:
    return tiny_path.read_bytes()


@pytest.fixture(scope="module")
def data_start(tiny_path) -> int:
    return min(t.offset for t in GGUFFile(tiny_path).tensors.values())


def _write(tmp_path: Path, data: bytes | bytearray, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def _tensor_record(data: bytes, name: str) -> int:
    """Byte offset of the n_dims field of `name`'s tensor info record."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.find(key)
    assert pos > 0 and data.find(key, pos + 1) < 0, name
    return pos + len(key)


def _raises(path: Path, *words: str, fn=GGUFFile) -> GGUFError:
    with pytest.raises(GGUFError) as info:
        fn(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return info.value


# ---- a valid file reads back as written ---------------------------------------------------------------
def test_metadata_values_as_written(tiny_path):
    g = open_gguf(tiny_path)
    m = g.metadata
    assert g.version == 3
    assert g.architecture == "llama" and m["general.name"] == "tiny-llama"
    assert m["llama.block_count"] == 2 and m["llama.embedding_length"] == 64
    assert m["llama.attention.head_count"] == 4 and m["llama.attention.head_count_kv"] == 2
    assert m["llama.context_length"] == CONTEXT_LENGTH
    assert m["llama.rope.freq_base"] == 10000.0
    assert m["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)  # stored as FLOAT32
    tokens, types, merges = tiny_vocab()
    assert m["tokenizer.ggml.tokens"] == tokens and m["llama.vocab_size"] == len(tokens)
    assert m["tokenizer.ggml.token_type"] == types
    assert m["tokenizer.ggml.merges"] == merges
    assert (m["tokenizer.ggml.bos_token_id"], m["tokenizer.ggml.eos_token_id"]) == (BOS_ID, EOS_ID)
    assert (m["tokenizer.ggml.unknown_token_id"], m["tokenizer.ggml.padding_token_id"]) == (UNK_ID, PAD_ID)
    assert m["tokenizer.ggml.add_bos_token"] is False
    assert m["tokenizer.chat_template"] == CHATML
    assert g.get("no.such.key", 7) == 7
    assert g.require("general.architecture") == "llama"


@pytest.mark.parametrize("weight_type, dims", [(Q.Q8_0, {}), (Q.F16, {}), (Q.Q4_K, dict(n_embd=256, n_ff=256))],
                         ids=["q8_0", "f16", "q4_k"])
def test_tensors_as_written(tmp_path, weight_type, dims):
    cfg = {**TINY, **dims}
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=weight_type, **cfg)
    floats = tiny_llama_tensors(n_vocab=len(tiny_vocab()[0]), **cfg)
    g = open_gguf(path)
    assert list(g.tensors) == list(floats)  # same names, same order
    align = g.get("general.alignment", 32)
    for name, want in floats.items():
        info = g.tensor_info(name)
        assert info.shape == want.shape, name
        assert info.ggml_type == (Q.F32 if want.ndim == 1 else weight_type), name
        assert info.offset % align == 0, name
        block, tsize = GGML_QUANT_SIZES[info.ggml_type]
        assert info.nbytes == want.size // block * tsize
        raw = g.tensor_data(name)
        if info.ggml_type == Q.F32:
            assert raw.dtype == np.float32 and np.array_equal(raw, want)
        elif info.ggml_type == Q.F16:
            assert raw.dtype == np.float16 and np.array_equal(raw, want.astype(np.float16))
        else:
            assert raw.dtype == np.uint8 and raw.shape == (*want.shape[:-1], want.shape[-1] // block * tsize)
            assert np.array_equal(raw, quantize_np(want, weight_type))
            assert np.abs(gguf_dequantize(raw, weight_type).reshape(want.shape) - want).max() < 0.1 * np.abs(want).max()


def test_tensor_data_is_a_zero_copy_view_of_the_mmap(tiny_path):
    g = open_gguf(tiny_path)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.1.ffn_down.weight"):
        a, b = g.tensor_data(name), g.tensor_data(name)
        assert not a.flags.owndata and not a.flags.writeable  # a read-only mapping, not a copy
        assert np.shares_memory(a, b)
        base = a
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        assert isinstance(base, mmap.mmap), type(base)
    # views of different tensors do not overlap
    assert not np.shares_memory(g.tensor_data("blk.0.attn_q.weight"), g.tensor_data("blk.0.attn_k.weight"))


def test_missing_tensor_and_key_are_named(tiny_path):
    g = open_gguf(tiny_path)
    _raises(tiny_path, "missing tensor", "'blk.9.attn_q.weight'", fn=lambda p: g.tensor_info("blk.9.attn_q.weight"))
    _raises(tiny_path, "missing required metadata key", "'llama.nope'", fn=lambda p: g.require("llama.nope"))


# ---- malformed files: GGUFError with the path and the problem ---------------------------------------------
def test_bad_magic(tmp_path, tiny_bytes):
    _raises(_write(tmp_path, b"GGML" + tiny_bytes[4:]), "not a GGUF file", "magic")
    _raises(_write(tmp_path, b"", "empty.gguf"), "not a GGUF file")
    _raises(_write(tmp_path, b"GG", "short.gguf"), "not a GGUF file")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path, tiny_bytes, version):
    data = bytearray(tiny_bytes)
    data[4:8] = struct.pack("<I", version)
    _raises(_write(tmp_path, data), "unsupported GGUF version", str(version))


def test_truncated_in_tensor_data(tmp_path, tiny_bytes, data_start):
    cut = (data_start + len(tiny_bytes)) // 2
    _raises(_write(tmp_path, tiny_bytes[:cut]), "truncated", "runs past the end of the file")
    _raises(_write(tmp_path, tiny_bytes[:-1], "minus1.gguf"), "truncated", "'output_norm.weight'")


def test_truncated_in_header(tmp_path, tiny_bytes, data_start):
    _raises(_write(tmp_path, tiny_bytes[:data_start // 2]), "truncated GGUF header")
    _raises(_write(tmp_path, tiny_bytes[:12], "counts.gguf"), "truncated GGUF header")  # inside n_tensors


def test_every_truncation_point_raises_gguferror(tmp_path, tiny_bytes, data_start):
    """A sweep over cut points (dense in the header, sparse in the data): always GGUFError naming the path."""
    cuts = list(range(0, data_start + 64, 29)) + list(range(data_start, len(tiny_bytes), 4099)) + [len(tiny_bytes) - 1]
    for cut in cuts:
        _raises(_write(tmp_path, tiny_bytes[:cut], "cut.gguf"))


def test_directory_and_missing_file(tmp_path):
    _raises(tmp_path, "is a directory")
    _raises(tmp_path / "nope.gguf", "not found")


def test_implausible_counts(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    data[8:16] = struct.pack("<Q", 1 << 40)  # n_tensors
    _raises(_write(tmp_path, data), "implausible header")


def test_unknown_metadata_value_type(tmp_path, tiny_bytes):
    # the first key (general.architecture): u64 length, key, then its u32 value type
    (klen,) = struct.unpack_from("<Q", tiny_bytes, 24)
    data = bytearray(tiny_bytes)
    data[32 + klen:36 + klen] = struct.pack("<I", 99)
    _raises(_write(tmp_path, data), "unknown metadata value type 99")


def test_too_many_dims(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    pos = _tensor_record(tiny_bytes, "token_embd.weight")
    data[pos:pos + 4] = struct.pack("<I", 5)
    _raises(_write(tmp_path, data), "'token_embd.weight'", "5 dims")


def test_unknown_ggml_type(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    pos = _tensor_record(tiny_bytes, "blk.0.attn_q.weight") + 4 + 2 * 8  # n_dims, ne0, ne1 -> type
    assert struct.unpack_from("<I", tiny_bytes, pos)[0] == Q.Q8_0
    data[pos:pos + 4] = struct.pack("<I", 1234)
    _raises(_write(tmp_path, data), "'blk.0.attn_q.weight'", "unknown ggml type 1234")


def test_row_not_a_multiple_of_the_block_size(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    pos = _tensor_record(tiny_bytes, "token_embd.weight") + 4  # ne0
    assert struct.unpack_from("<Q", tiny_bytes, pos)[0] == 64
    data[pos:pos + 8] = struct.pack("<Q", 48)
    _raises(_write(tmp_path, data), "'token_embd.weight'", "row length 48", "Q8_0 block size 32")


def test_element_count_overflow(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    pos = _tensor_record(tiny_bytes, "token_embd.weight") + 4 + 8  # ne1 (rows)
    (rows,) = struct.unpack_from("<Q", tiny_bytes, pos)
    data[pos:pos + 8] = struct.pack("<Q", rows + (1 << 58))  # 64 * 2^58 = 2^64: the product wraps to the same size
    path = _write(tmp_path, data)
    _raises(path, "'token_embd.weight'", fn=lambda p: GGUFFile(p).tensor_data("token_embd.weight"))


@pytest.mark.parametrize("alignment", [0, 3])
def test_bad_alignment(tmp_path, alignment):
    path = write_tiny_llama(tmp_path / "align.gguf", extra_metadata={"general.alignment": alignment}, **TINY)
    _raises(path, "alignment")


# ---- ModelSpec on top of the reader ------------------------------------------------------------------------
def test_spec_unknown_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "foo.gguf", arch="foo", **TINY)
    g = open_gguf(path)  # the container itself is fine
    assert g.architecture == "foo"
    _raises(path, "unsupported architecture 'foo'", "llama", fn=lambda p: spec_from_gguf(g))


def test_spec_missing_architecture(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    data[32:32 + len("general.architecture")] = b"general.architectur_"
    path = _write(tmp_path, data)
    g = open_gguf(path)
    _raises(path, "missing general.architecture", fn=lambda p: spec_from_gguf(g))


@pytest.mark.parametrize("tensor, shape, words", [
    ("blk.1.attn_q.weight", (96, 64), ("'blk.1.attn_q.weight'", "(96, 64)", "expected (64, 64)")),
    ("blk.0.attn_k.weight", (64, 64), ("'blk.0.attn_k.weight'", "expected (32, 64)")),
    ("blk.0.ffn_down.weight", (64, 96), ("'blk.0.ffn_down.weight'", "expected (64, 128)")),
    ("token_embd.weight", (320, 64), ("'token_embd.weight'",)),
    ("blk.0.ffn_norm.weight", (32,), ("'blk.0.ffn_norm.weight'", "expected (64,)")),
    ("blk.1.ffn_gate.weight", None, ("missing tensor", "'blk.1.ffn_gate.weight'")),
])
def test_spec_inconsistent_shapes(tmp_path, tensor, shape, words):
    bad = None if shape is None else np.zeros(shape, np.float32)
    path = write_tiny_llama(tmp_path / "shapes.gguf", tensor_overrides={tensor: bad}, **TINY)
    g = open_gguf(path)
    _raises(path, *words, fn=lambda p: spec_from_gguf(g))


@pytest.mark.parametrize("meta, words", [
    ({"llama.attention.head_count_kv": 3}, ("head_count 4", "head_count_kv 3")),
    ({"llama.block_count": None}, ("missing required metadata key", "'llama.block_count'")),
    ({"llama.embedding_length": 96}, ("expected",)),
])
def test_spec_inconsistent_metadata(tmp_path, meta, words):
    path = write_tiny_llama(tmp_path / "meta.gguf", extra_metadata=meta, **TINY)
    g = open_gguf(path)
    _raises(path, *words, fn=lambda p: spec_from_gguf(g))
