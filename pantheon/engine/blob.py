"""The session blob: a self-describing container for one slot's decode state.

    b"PNSB" | u32 version | u32 header length | header JSON | array bytes... | seal (32 bytes)

The header names the architecture, the weights version, n_tok (the committed tokens' count),
`tokens_sha256` (the digest of those tokens, `tokens_digest`: a restore must send exactly them), and
each array (name, dtype, shape) in payload order. Arrays are generic: attention models store
k.<layer>/v.<layer>; recurrent models add their conv/ssm state arrays under their own names, so
a new architecture adds fields without a new format.

The seal is HMAC-SHA256 of everything before it under the server's session key
(PANTHEON_SESSION_KEY, `config.session_key`): a blob is the KV a client will be served from, so
only a blob this server (or one sharing its key) exported is accepted. A plain digest would let
anyone who runs the same public model rewrite a blob and reseal it."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np

MAGIC, VERSION = b"PNSB", 3  # 2: the header carries tokens_sha256; 3: the seal is keyed


MAX_HEADER_BYTES = 64 << 10  # the header JSON and framing of any blob this server writes (a few KB)


class BlobError(ValueError):
    pass


def tokens_digest(tokens: list[int]) -> str:
    """sha256 of the token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(tokens, "<i8").tobytes()).hexdigest()


def _array_spec(spec, i: int) -> tuple[str, np.dtype, tuple[int, ...]]:
    """(name, dtype, shape) of the header's i-th array entry, or BlobError saying what is wrong."""
    where = f"session blob header: arrays[{i}]"
    if not isinstance(spec, dict):
        raise BlobError(f"{where} must be an object with 'name', 'dtype' and 'shape'")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise BlobError(f"{where}.name must be a string")
    try:
        dtype = np.dtype(dtype) if isinstance(dtype, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.hasobject or dtype.itemsize == 0:
        raise BlobError(f"{where}.dtype must name a numeric array type such as 'float32'")
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
        raise BlobError(f"{where}.shape must be a list of at most 8 non-negative integers")
    return name, dtype, tuple(shape)


def seal(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def pack(header: dict, arrays: dict[str, np.ndarray], key: bytes) -> bytes:
    meta = dict(header, arrays=[{"name": k, "dtype": str(a.dtype), "shape": list(a.shape)} for k, a in arrays.items()])
    head = json.dumps(meta).encode()
    body = MAGIC + struct.pack("<II", VERSION, len(head)) + head
    body += b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return body + seal(key, body)


def unpack(blob: bytes, key: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of a blob sealed under `key`; BlobError when it is not one. Nothing of
    the blob is parsed before its seal verifies."""
    if len(blob) < 12 + 32 or blob[:4] != MAGIC:
        raise BlobError("not a session blob (bad magic)")
    version, n = struct.unpack_from("<II", blob, 4)
    if version != VERSION:
        raise BlobError(f"unsupported session blob version {version} (this server writes {VERSION})")
    body, mac = blob[:-32], blob[-32:]
    if not hmac.compare_digest(seal(key, body), mac):
        raise BlobError("session blob's seal does not verify: it was altered, or exported by a server "
                        "with another session key (PANTHEON_SESSION_KEY)")
    try:
        header = json.loads(body[12:12 + n])
    except ValueError:  # incl. UnicodeDecodeError
        raise BlobError("session blob header is not JSON") from None
    specs = header.get("arrays") if isinstance(header, dict) else None
    if not isinstance(specs, list):
        raise BlobError("session blob header must be an object with an 'arrays' list")
    arrays, off = {}, 12 + n
    for i, spec in enumerate(specs):
        name, dtype, shape = _array_spec(spec, i)
        count = int(np.prod(shape))
        if off + count * dtype.itemsize > len(body):
            raise BlobError("session blob is truncated")
        arrays[name] = np.frombuffer(body, dtype, count, off).reshape(shape)
        off += count * dtype.itemsize
    if off != len(body):
        raise BlobError("session blob has trailing bytes")
    return header, arrays
