"""Corrupt model files are refused at load, before anything reaches the device (issue 11): the
classes an outside fuzzer found loading and generating garbage, made here from the tiny models
(tests/fixtures/tiny_models.py, tests/fixtures/tiny_qwen35moe.py) by patching bytes or metadata.

Each is refused with a GGUFError (a ValueError) whose message is one line naming the file and the
problem, and `pantheon generate --model FILE` prints that one line and exits non-zero."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pantheon import cli
from pantheon.gguf.reader import GGUFError, GGUFFile
from pantheon.model.spec import spec_from_gguf
from pantheon.text.chat_template import ChatTemplate, ChatTemplateError
from pantheon.text.tokenizer import Tokenizer
from tests.fixtures.tiny_models import Q, tiny_vocab, write_tiny_llama
from tests.fixtures.tiny_qwen35moe import write_tiny_qwen35moe

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=3, weight_type=Q.Q8_0)
REPO = Path(__file__).resolve().parents[2]


# ---- making corrupt files ----------------------------------------------------------------------------
def _tensor_record(data: bytes, name: str) -> int:
    """Byte offset of the n_dims field of `name`'s tensor info record."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.find(key)
    assert pos > 0 and data.find(key, pos + 1) < 0, name
    return pos + len(key)


def _field(data: bytes, name: str, field: str) -> int:
    """Byte offset of a field ("ne0", "ne1", "type", "offset") of a tensor's info record."""
    pos = _tensor_record(data, name)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    if field.startswith("ne"):
        return pos + 4 + 8 * int(field[2:])
    return pos + 4 + 8 * n_dims + (0 if field == "type" else 4)


def _kv_value(data: bytes, key: str) -> int:
    """Byte offset of a scalar metadata value (after its u32 type)."""
    raw = struct.pack("<Q", len(key)) + key.encode()
    pos = data.find(raw)
    assert pos > 0, key
    return pos + len(raw) + 4


def _patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, pos, value)
    return bytes(out)


def _nested(data: bytes, depth: int) -> bytes:
    """A new key holding an array of arrays `depth` deep, inserted before the first key."""
    key = b"fuzz.nested"
    value = b"".join(struct.pack("<IQ", 9, 1) for _ in range(depth - 1)) + struct.pack("<IQ", 4, 0)
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + value
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    return data[:16] + struct.pack("<Q", n_kv + 1) + kv + data[24:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("corrupt") / "tiny.gguf",
                            extra_metadata={"general.alignment": 32}, **TINY)


def _bytes_variant(tiny: Path, kind: str) -> bytes:
    data = tiny.read_bytes()
    if kind == "count-1":
        (n,) = struct.unpack_from("<Q", data, 8)
        return _patch(data, 8, "<Q", n - 1)
    if kind in ("offset+32", "offset+4", "overlap"):
        pos = _field(data, "blk.0.attn_k.weight", "offset")
        (off,) = struct.unpack_from("<Q", data, pos)
        if kind == "overlap":
            (prev,) = struct.unpack_from("<Q", data, _field(data, "blk.0.attn_q.weight", "offset"))
            return _patch(data, pos, "<Q", prev + 32)
        return _patch(data, pos, "<Q", off + int(kind[7:]))
    if kind.startswith("alignment="):
        return _patch(data, _kv_value(data, "general.alignment"), "<I", int(kind[10:]))
    if kind == "swapped-dims":
        pos = _field(data, "blk.0.ffn_down.weight", "ne0")
        ne0, ne1 = struct.unpack_from("<QQ", data, pos)
        return _patch(_patch(data, pos, "<Q", ne1), pos + 8, "<Q", ne0)
    if kind == "type-q8_0->q4_0":
        return _patch(data, _field(data, "blk.0.attn_q.weight", "type"), "<I", int(Q.Q4_0))
    if kind == "type-f32->f16":
        return _patch(data, _field(data, "blk.1.attn_norm.weight", "type"), "<I", int(Q.F16))
    if kind == "nested":
        return _nested(data, 5000)
    raise AssertionError(kind)


def _duplicate_vocab() -> list[str]:
    tokens = list(tiny_vocab()[0])
    tokens[10] = tokens[11]
    return tokens


META_VARIANTS = {  # kind -> (extra metadata, words the message names)
    "head_count=0": ({"llama.attention.head_count": 0}, ("llama.attention.head_count must be > 0",)),
    "head_count_kv=0": ({"llama.attention.head_count_kv": 0}, ("head_count_kv 0",)),
    "head_count_kv=3": ({"llama.attention.head_count_kv": 3}, ("head_count 4", "head_count_kv 3")),
    "embedding%heads": ({"llama.attention.head_count": 6, "llama.attention.head_count_kv": 6},
                        ("embedding_length 64 is not a multiple of attention.head_count 6",)),
    "block_count=0": ({"llama.block_count": 0}, ("llama.block_count must be > 0",)),
    "block_count=huge": ({"llama.block_count": 1 << 30}, ("block_count 1073741824 exceeds",)),
    "context_length=0": ({"llama.context_length": 0}, ("context_length must be at least 2, got 0",)),
    "context_length=1": ({"llama.context_length": 1}, ("context_length must be at least 2, got 1",)),
    "head_count=string": ({"llama.attention.head_count": "four"}, ("'llama.attention.head_count' must be an integer",)),
    "duplicate-vocab": ({"tokenizer.ggml.tokens": _duplicate_vocab()},
                        ("duplicate token in vocabulary", "ids 10 and 11")),
}
TEMPLATE_VARIANTS = {  # kind -> (chat template, words)
    "template-raises": ("{{ raise_exception('this template is broken') }}",
                        ("chat template fails", "this template is broken")),
    "template-undefined": ("{{ nope() }}", ("chat template fails", "'nope' is undefined")),
    "template-syntax": ("{% for m in messages %}", ("chat template syntax error",)),
    "template-range": ("{% for i in range(10**9) %}x{% endfor %}", ("chat template fails", "Range too big")),
    "template-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                       ("did not finish rendering", "3 s")),
    "template-huge-output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
                             ("chat template output exceeds",)),
}
BYTE_VARIANTS = {  # kind -> words
    "count-1": ("bytes after the end of the tensor data", "corrupt tensor count"),
    "offset+32": ("'blk.0.attn_k.weight'", "expected", "contiguous"),
    "offset+4": ("'blk.0.attn_k.weight'", "not a multiple of general.alignment 32"),
    "overlap": ("'blk.0.attn_k.weight'", "overlaps tensor 'blk.0.attn_q.weight'"),
    "alignment=64": ("general.alignment 64",),
    "alignment=0": ("general.alignment must be a power of two", "got 0"),
    "alignment=3": ("general.alignment must be a power of two", "got 3"),
    "alignment=huge": ("general.alignment must be a power of two",),
    "swapped-dims": ("'blk.0.ffn_down.weight'", "shape (128, 64)", "expected (64, 128)"),
    "type-q8_0->q4_0": ("'blk.0.attn_k.weight'", "right after tensor 'blk.0.attn_q.weight'"),
    "type-f32->f16": ("right after tensor 'blk.1.attn_norm.weight'", "wrong type or shape"),
    "nested": ("nested deeper than 8 levels",),
}


def _make(tiny: Path, tmp_path: Path, kind: str) -> tuple[Path, tuple[str, ...]]:
    path = tmp_path / f"{kind.replace('>', '')}.gguf"
    if kind in META_VARIANTS:
        meta, words = META_VARIANTS[kind]
        return write_tiny_llama(path, extra_metadata=meta, **TINY), words
    if kind in TEMPLATE_VARIANTS:
        template, words = TEMPLATE_VARIANTS[kind]
        return write_tiny_llama(path, chat_template=template, **TINY), words
    variant = "alignment=1073741824" if kind == "alignment=huge" else kind
    path.write_bytes(_bytes_variant(tiny, variant))
    return path, BYTE_VARIANTS[kind]


def _refuse(path: Path) -> None:
    """What Engine does before it touches the device: reader, spec, tokenizer, template probe."""
    g = GGUFFile(path)
    spec_from_gguf(g)
    try:
        ChatTemplate.from_gguf(g, Tokenizer.from_gguf(g)).probe()
    except ChatTemplateError as e:  # Engine re-raises these as GGUFError naming the file
        raise GGUFError(f"{path}: {e}") from None


ALL = list(BYTE_VARIANTS) + list(META_VARIANTS) + list(TEMPLATE_VARIANTS)


@pytest.mark.parametrize("kind", ALL)
def test_corrupt_file_is_refused_with_one_line(tiny, tmp_path, kind):
    path, words = _make(tiny, tmp_path, kind)
    with pytest.raises(GGUFError) as info:
        _refuse(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.parametrize("kind", ["count-1", "swapped-dims", "type-q8_0->q4_0", "nested", "head_count=0",
                                  "context_length=1", "duplicate-vocab", "template-raises", "template-range"])
def test_generate_prints_one_line(tiny, tmp_path, capsys, kind):
    path, words = _make(tiny, tmp_path, kind)
    rc = cli.main(["generate", "--model", str(path), "--max-tokens", "2", "hello"])
    out, err = capsys.readouterr()
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pantheon: ") and "Traceback" not in err, err
    assert words[0] in lines[0], lines[0]
    assert out == ""


def test_generate_subprocess_looping_template(tmp_path):
    """The real command line: one line on stderr, exit code 1, no traceback, within the probe's limit."""
    path = write_tiny_llama(tmp_path / "loops.gguf", chat_template=TEMPLATE_VARIANTS["template-loops"][0], **TINY)
    proc = subprocess.run([sys.executable, "-m", "pantheon", "generate", "--model", str(path), "hi"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pantheon: ")]
    assert len(lines) == 1 and "did not finish rendering" in lines[0], proc.stderr


def test_nested_metadata_within_the_limit_still_reads(tiny, tmp_path):
    """Nesting itself is legal GGUF: a shallow array of arrays parses (the data section moves with the
    inserted bytes, so this checks the header only)."""
    data = tiny.read_bytes()
    nested = _nested(data, 3)
    from pantheon.gguf.reader import _Cursor

    cur = _Cursor(nested, tmp_path / "x.gguf")
    cur.pos = 24 + 8 + len("fuzz.nested") + 4
    assert cur.value(9) == [[[]]]


# ---- the hybrid family ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return write_tiny_qwen35moe(tmp_path_factory.mktemp("corrupt_moe") / "moe.gguf")


@pytest.mark.parametrize("meta, words", [
    ({"qwen35moe.attention.head_count": 0}, ("qwen35moe.attention.head_count must be > 0",)),
    ({"qwen35moe.context_length": 0}, ("context_length must be at least 2, got 0",)),
    ({"qwen35moe.context_length": 1}, ("context_length must be at least 2, got 1",)),
    ({"qwen35moe.block_count": 0}, ("qwen35moe.block_count must leave at least one trunk layer",)),
    ({"qwen35moe.ssm.conv_kernel": 0}, ("qwen35moe.ssm.conv_kernel must be > 0",)),
    ({"tokenizer.ggml.tokens": _duplicate_vocab()}, ("duplicate token in vocabulary",)),
], ids=["head_count=0", "context_length=0", "context_length=1", "block_count=0", "conv_kernel=0", "dup-vocab"])
def test_hybrid_metadata_refused(tmp_path, meta, words):
    path = write_tiny_qwen35moe(tmp_path / "moe.gguf", extra_metadata=meta)
    with pytest.raises(GGUFError) as info:
        spec_from_gguf(GGUFFile(path))
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    for w in words:
        assert w in msg, msg


def test_hybrid_swapped_and_retyped_tensors_refused(tiny_moe, tmp_path):
    data = tiny_moe.read_bytes()
    pos = _field(data, "blk.0.ffn_gate_inp.weight", "ne0")
    ne0, ne1 = struct.unpack_from("<QQ", data, pos)
    path = tmp_path / "swapped.gguf"
    path.write_bytes(_patch(_patch(data, pos, "<Q", ne1), pos + 8, "<Q", ne0))
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate_inp\.weight' has shape \(64, 4\), expected \(4, 64\)"):
        spec_from_gguf(GGUFFile(path))
    path = tmp_path / "retyped.gguf"
    path.write_bytes(_patch(data, _field(data, "blk.0.ssm_out.weight", "type"), "<I", int(Q.F16)))
    with pytest.raises(GGUFError, match="expected"):
        GGUFFile(path)
    (n,) = struct.unpack_from("<Q", data, 8)
    path = tmp_path / "count.gguf"
    path.write_bytes(_patch(data, 8, "<Q", n - 1))
    with pytest.raises(GGUFError, match="after the end of the tensor data"):
        GGUFFile(path)


# ---- good files still load ------------------------------------------------------------------------------------
def test_valid_files_pass_every_check(tiny, tiny_moe, smollm2_path, qwen35moe_f32_gguf, qwen35moe_q3k_experts_gguf,
                                      qwen35moe_q3_k_m_gguf):
    for path in (tiny, tiny_moe, smollm2_path, qwen35moe_f32_gguf, qwen35moe_q3k_experts_gguf, qwen35moe_q3_k_m_gguf):
        _refuse(path)  # raises nothing
    g = GGUFFile(tiny)
    assert np.isfinite(g.tensor_data("output_norm.weight")).all()


def test_pool_load_refuses_with_load_failed(tiny, tmp_path):
    """The serve's load path: a refused file is `load_failed` with the one-line message, nothing stays loaded."""
    from pantheon.config import ServeConfig
    from pantheon.engine.pool import ModelPool, PoolError

    pool = ModelPool()
    for kind in ("count-1", "context_length=0", "template-raises"):
        path, words = _make(tiny, tmp_path, kind)
        with pytest.raises(PoolError) as info:
            pool.load(ServeConfig().model_config(str(path), kind))
        assert info.value.type == "load_failed" and info.value.status == 500
        assert "\n" not in info.value.message and words[0] in info.value.message, info.value.message
    assert pool.entries() == []


# ---- no message echoes the file back (issue 26: a 60 MB error body from a corrupt name length) -------
@pytest.mark.parametrize("length", [64, 5000, 60_000_000])
def test_a_corrupt_tensor_name_length_is_refused_before_it_is_read(tiny, tmp_path, length):
    data = tiny.read_bytes()
    name = "blk.0.attn_k.weight"
    pos = data.find(struct.pack("<Q", len(name)) + name.encode())
    path = tmp_path / "name.gguf"
    path.write_bytes(_patch(data, pos, "<Q", length))
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    msg = str(info.value)
    assert f"tensor name at offset {pos} is {length} bytes long (at most 63)" in msg, msg
    assert len(msg) < len(str(path)) + 120


def test_no_refusal_quotes_more_than_a_few_hundred_bytes_of_the_file(tiny, tmp_path):
    tokens = list(tiny_vocab()[0])
    tokens[10] = tokens[11] = "x" * 100_000  # a duplicate token 100 KB long
    path = write_tiny_llama(tmp_path / "dup.gguf", extra_metadata={"tokenizer.ggml.tokens": tokens}, **TINY)
    with pytest.raises(GGUFError) as info:
        _refuse(path)
    msg = str(info.value)
    assert "duplicate token in vocabulary" in msg and len(msg) <= 480, len(msg)
    long_arch = write_tiny_llama(tmp_path / "arch.gguf", extra_metadata={"general.architecture": "a" * 50_000}, **TINY)
    with pytest.raises(GGUFError) as info:
        _refuse(long_arch)
    assert "unsupported architecture" in str(info.value) and len(str(info.value)) <= 480
