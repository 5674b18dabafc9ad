"""The session blob: a self-describing container for one slot's decode state.

    b"PNSB" | u32 version | u32 header length | header JSON | array bytes... | sha256 (32 bytes)

The header names the architecture, the weights version, n_tok (the committed tokens' count),
`tokens_sha256` (the digest of those tokens, `tokens_digest`: a restore must send exactly them), and
each array (name, dtype, shape) in payload order. Arrays are generic: attention models store
k.<layer>/v.<layer>; recurrent models add their conv/ssm state arrays under their own names, so
a new architecture adds fields without a new format."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

MAGIC, VERSION = b"PNSB", 2  # 2: the header carries tokens_sha256


class BlobError(ValueError):
    pass


def tokens_digest(tokens: list[int]) -> str:
    """sha256 of the token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(tokens, "<i8").tobytes()).hexdigest()


def pack(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    meta = dict(header, arrays=[{"name": k, "dtype": str(a.dtype), "shape": list(a.shape)} for k, a in arrays.items()])
    head = json.dumps(meta).encode()
    body = MAGIC + struct.pack("<II", VERSION, len(head)) + head
    body += b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return body + hashlib.sha256(body).digest()


def unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    if len(blob) < 12 + 32 or blob[:4] != MAGIC:
        raise BlobError("not a session blob (bad magic)")
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise BlobError("session blob is corrupt (checksum mismatch)")
    version, n = struct.unpack_from("<II", body, 4)
    if version != VERSION:
        raise BlobError(f"unsupported session blob version {version}")
    try:
        header = json.loads(body[12:12 + n])
        arrays, off = {}, 12 + n
        for spec in header["arrays"]:
            dtype, shape = np.dtype(spec["dtype"]), tuple(int(d) for d in spec["shape"])
            size = int(np.prod(shape)) * dtype.itemsize
            if off + size > len(body):
                raise BlobError("session blob is truncated")
            arrays[spec["name"]] = np.frombuffer(body, dtype, int(np.prod(shape)), off).reshape(shape)
            off += size
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, BlobError):
            raise
        raise BlobError(f"session blob header is malformed: {e}") from None
    if off != len(body):
        raise BlobError("session blob has trailing bytes")
    return header, arrays
