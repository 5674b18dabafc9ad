"""GGUF container reader.

Metadata is parsed eagerly with `struct` over an mmap (gguf-py's GGUFReader takes seconds on a
49k-vocab file; this takes tens of milliseconds). Tensor data is never copied: `tensor_data`
returns numpy views into the mmap. Every structural problem raises `GGUFError`, which names the
file and the problem.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20  # llama.cpp only needs a power of two; anything larger is corruption
MAX_ARRAY_DEPTH = 8  # arrays of arrays: real files nest at most once
MAX_TENSOR_NAME = 63  # llama.cpp: a name must fit GGML_MAX_NAME (64) with its NUL
MAX_KEY = (1 << 16) - 1  # the GGUF spec: a metadata key is at most 65535 bytes
MAX_MESSAGE = 480  # an error message longer than this is cut (it would be quoting file content)

# GGUF metadata value types -> struct format (scalars only).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
              7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Element types of plain (not block-quantized) tensors.
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32}


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) for an error message, cut to `limit` characters: a message names what it found
    in the file, but never echoes megabytes of it back (a corrupt length can make a "name" huge)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} chars)"


def clip(message: str, limit: int = MAX_MESSAGE) -> str:
    """The whole message cut to `limit` characters: the net under `shown`."""
    return message if len(message) <= limit else f"{message[:limit - 40]}... ({len(message) - limit + 40} chars cut)"


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the file and the problem named (at most MAX_MESSAGE
    characters: `clip`)."""

    def __init__(self, message: str):
        super().__init__(clip(str(message)))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: shape[-1] is GGUF's ne0, the contiguous axis
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][1]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (needed {n} bytes at offset {self.pos}, "
                            f"file has {len(self.buf)})")

    def scalar(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, limit: int | None = None, what: str = "string") -> str:
        n = self.scalar("<Q")
        if limit is not None and n > limit:  # refused before it is read: a corrupt length is not a name
            raise GGUFError(f"{self.path}: {what} at offset {self.pos - 8} is {n} bytes long "
                            f"(at most {limit}): corrupt header")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"{self.path}: metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels "
                                f"at offset {self.pos}: corrupt metadata")
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in (_STRING, _ARRAY):  # each element takes at least 8 (string) / 12 (array) bytes
                self.need(count * (8 if etype == _STRING else 12))
            if etype in _NP_SCALAR:
                dt = np.dtype(_NP_SCALAR[etype]).newbyteorder("<")
                self.need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}")


class GGUFFile:
    """An opened GGUF file: `metadata` (dict), `tensors` (name -> TensorInfo), zero-copy data views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: file not found") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except (OSError, ValueError) as e:  # permissions, mmap failures
            raise GGUFError(f"{self.path}: cannot open: {e}") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def release_pages(self) -> None:
        """Drop this process's resident pages of the file mapping. A loader that has copied tensors
        out of it calls this (layer by layer): otherwise every page it read stays in the process's
        RSS beside the copy (a 1.8 GB Q4_K_M file: 1.8 GB of the load's peak). The data stays
        readable: a later access faults the page in again from the page cache."""
        if isinstance(self._mm, mmap.mmap):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.path)
        if len(self._mm) < 4 or bytes(self._mm[:4]) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise GGUFError(f"{self.path}: implausible header ({n_tensors} tensors, {n_kv} keys)")
        for _ in range(n_kv):
            key = cur.string(MAX_KEY, "metadata key")
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string(MAX_TENSOR_NAME, "tensor name")
            n_dims = cur.scalar("<I")
            if n_dims > 4:
                raise GGUFError(f"{self.path}: tensor {shown(name)} has {n_dims} dims (max 4)")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            gtype, offset = cur.scalar("<I"), cur.scalar("<Q")
            raw_infos.append((name, ne, gtype, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1) \
                or align > MAX_ALIGNMENT:
            raise GGUFError(f"{self.path}: general.alignment must be a power of two up to {MAX_ALIGNMENT}, "
                            f"got {shown(align)}")
        data_start = (cur.pos + align - 1) // align * align
        for name, ne, gtype, offset in raw_infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: duplicate tensor name {shown(name)}")
            self.tensors[name] = self._tensor_info(name, ne, gtype, data_start + offset)
        self._check_layout(raw_infos, align, data_start)

    def _check_layout(self, raw_infos, align: int, data_start: int) -> None:
        """llama.cpp's rule: tensor data is laid out in header order, each tensor at the aligned end of
        the previous one. So offsets are aligned, no two tensors overlap and none leaves a gap; the
        data section ends inside the file, and no tensor's worth of bytes is left after it (a header
        that lost a tensor record shifts every tensor's data)."""
        expected, prev = 0, None
        for name, _, _, offset in raw_infos:
            info = self.tensors[name]
            if offset % align:
                raise GGUFError(f"{self.path}: tensor {shown(name)} data offset {offset} is not a multiple of "
                                f"general.alignment {align}")
            if offset < expected:
                raise GGUFError(f"{self.path}: tensor {shown(name)} (data offset {offset}) overlaps tensor "
                                f"{shown(prev)} (which ends at data offset {expected}): corrupt tensor offsets")
            if offset > expected:
                raise GGUFError(f"{self.path}: tensor {shown(name)} has data offset {offset}, expected {expected} "
                                f"(right after tensor {shown(prev)}; tensor data must be contiguous): corrupt tensor "
                                f"offsets, or a wrong type or shape for {shown(prev)}")
            if info.offset + info.nbytes > len(self._mm):
                raise GGUFError(f"{self.path}: tensor {shown(name)} runs past the end of the file (needs bytes "
                                f"{info.offset}..{info.offset + info.nbytes}, file has {len(self._mm)}): "
                                f"truncated file")
            expected = offset + (info.nbytes + align - 1) // align * align
            prev = name
        end = data_start + expected  # padded end of the data section
        if raw_infos and len(self._mm) >= end + align:
            raise GGUFError(f"{self.path}: {len(self._mm) - end} bytes after the end of the tensor data "
                            f"(data section ends at {end}, file has {len(self._mm)}): corrupt tensor count, "
                            f"alignment, offsets or types")

    def _tensor_info(self, name: str, ne: list[int], gtype: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(gtype)
            block, tsize = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{self.path}: tensor {shown(name)} has unknown ggml type {gtype}") from None
        if ne and ne[0] % block:
            raise GGUFError(f"{self.path}: tensor {shown(name)} row length {ne[0]} is not a multiple of "
                            f"the {qtype.name} block size {block}")
        n_elems = math.prod(ne) if ne else 1  # Python ints: a corrupt size cannot wrap around
        nbytes = n_elems // block * tsize
        return TensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype, offset, nbytes)

    # ---- metadata helpers -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: missing general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing required metadata key {shown(key)}")
        return self.metadata[key]

    # ---- tensor data --------------------------------------------------------------------------
    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {shown(name)}") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """Zero-copy view. Float/int types come typed in numpy shape; block-quantized types come as
        uint8 of shape (*shape[:-1], row_bytes)."""
        info = self.tensor_info(name)
        dtype = _FLOAT_DTYPES.get(info.ggml_type)
        if dtype is not None:
            return np.frombuffer(self._mm, dtype=dtype, count=info.nbytes // np.dtype(dtype).itemsize,
                                 offset=info.offset).reshape(info.shape)
        if info.ggml_type == GGMLQuantizationType.BF16:
            return np.frombuffer(self._mm, dtype=np.uint16, count=info.nbytes // 2,
                                 offset=info.offset).reshape(info.shape)
        row_bytes = info.shape[-1] // info.block_size * info.type_size
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes,
                             offset=info.offset).reshape(*info.shape[:-1], row_bytes)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.metadata.get('general.architecture')!r}, " \
               f"{len(self.tensors)} tensors)"


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)
