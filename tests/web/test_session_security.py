"""A session blob is KV a client hands the server: only a blob sealed under this server's key
(PANTHEON_SESSION_KEY) is accepted, non-finite KV is refused, restored KV serves only the id that
restored it, and the restore body is bounded by the largest blob a loaded model can produce.

In process (Quart's test client) over a tiny model; the body-size checks against the real server,
where a body arrives over a socket."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import struct
import time

import numpy as np
import pytest

from pantheon.config import session_key
from pantheon.engine import blob as session_blob
from pantheon.web.session_routes import restore_body_limit
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp

M = [{"role": "user", "content": "describe a lighthouse at night"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("blobsec") / "tiny.gguf")


@pytest.fixture(scope="module")
def source(tiny_path):
    """The server a conversation is exported from."""
    app = InProcessApp([(str(tiny_path), "tiny")])
    yield app
    app.close()


@pytest.fixture(scope="module")
def target(tiny_path):
    """The server blobs are restored into (same model, same process key)."""
    app = InProcessApp([(str(tiny_path), "tiny")])
    yield app
    app.close()


def ask(app, messages, **kw) -> dict:
    status, body, _ = app.post("/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 6,
                                                       "logit_bias": {"0": -100, "2": -100, "4": -100}, **kw})
    assert status == 200, body
    return body


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def exported(source) -> dict:
    turn = ask(source, M, session_id="src")
    status, out, _ = source.post("/admin/session/export", {"session_id": "src"})
    assert status == 200, out
    return {**out, "reply": turn["choices"][0]["message"]["content"]}


def wipe(app) -> None:
    """Forget every session and slot of the app's model (a clean cache between scenarios)."""
    engine = app.engine()

    def clear():
        for sid in list(engine.table.sessions):
            engine.table.release(sid)
        for slot in engine.table.slots:
            engine.table.invalidate(slot)

    app.run(engine.call(clear))


def restore(app, sid: str, blob: bytes | str, tokens: list[int]) -> tuple[int, dict]:
    b64 = blob if isinstance(blob, str) else base64.b64encode(blob).decode()
    status, body, _ = app.post("/session/restore", {"session_id": sid, "blob": b64, "tokens": tokens})
    return status, body


def split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<I", blob, 8)[0]
    return json.loads(blob[12:12 + n]), blob[12 + n:-32]


def framed(header: dict, payload: bytes, version: int = session_blob.VERSION) -> bytes:
    head = json.dumps(header).encode()
    return session_blob.MAGIC + struct.pack("<II", version, len(head)) + head + payload


def test_a_blob_resealed_without_the_servers_key_is_refused(target, exported):
    """The forger rewrites the header to claim other tokens and reseals it the ways it can: a plain
    sha256 (the old seal), an HMAC under a key of its own."""
    wipe(target)
    blob = base64.b64decode(exported["blob_b64"])
    header, payload = split(blob)
    other = [t for t in exported["tokens"]][::-1]
    header["tokens_sha256"] = session_blob.tokens_digest(other)
    body = framed(header, payload)
    for seal in (hashlib.sha256(body).digest(), hmac.new(b"a key of the forger's own", body, "sha256").digest()):
        status, err = restore(target, "forged", body + seal, other)
        assert status == 400 and err["error"]["type"] == "bad_session_blob", err
        assert "seal" in err["error"]["message"]
    old = framed(header, payload, version=2)
    status, err = restore(target, "forged", old + hashlib.sha256(old).digest(), other)
    assert status == 400 and err["error"]["type"] == "bad_session_blob" and "version" in err["error"]["message"]
    # the genuine blob still restores
    status, out = restore(target, "genuine", blob, exported["tokens"])
    assert status == 200 and out["restored"], out


def test_non_finite_kv_is_refused_even_under_the_servers_key(target, exported):
    wipe(target)
    header, arrays = session_blob.unpack(base64.b64decode(exported["blob_b64"]), session_key())
    header = {k: v for k, v in header.items() if k != "arrays"}
    for bad in (np.nan, np.inf):
        poisoned = {k: a.copy() for k, a in arrays.items()}
        first = next(iter(poisoned))
        poisoned[first].reshape(-1)[0] = bad
        status, err = restore(target, "nan", session_blob.pack(header, poisoned, session_key()), exported["tokens"])
        assert status == 400 and err["error"]["type"] == "bad_session_blob", err
        assert "non-finite" in err["error"]["message"]


def test_restored_kv_never_seeds_another_id_or_an_anonymous_request(target, exported):
    """The issue-26 attack: KV restored under one id, then released, must not answer anyone else.
    A continuation of the restored conversation by anyone else prefills from scratch; the id that
    restored it resumes from it."""
    follow = M + [{"role": "assistant", "content": exported["reply"]}, {"role": "user", "content": "and at dawn?"}]
    n_tok = exported["n_tok"]

    wipe(target)  # anonymous, while the restored session lives
    assert restore(target, "r", base64.b64decode(exported["blob_b64"]), exported["tokens"])[0] == 200
    assert cached(ask(target, follow)) == 0
    wipe(target)  # another id
    assert restore(target, "r", base64.b64decode(exported["blob_b64"]), exported["tokens"])[0] == 200
    assert cached(ask(target, follow, session_id="victim")) == 0
    wipe(target)  # anonymous, after the restoring id released its session
    assert restore(target, "r", base64.b64decode(exported["blob_b64"]), exported["tokens"])[0] == 200
    status, _, _ = target.post("/session/release", {"session_id": "r"})
    assert status == 200
    assert cached(ask(target, follow)) == 0
    wipe(target)  # the restoring id itself is served from it
    assert restore(target, "r", base64.b64decode(exported["blob_b64"]), exported["tokens"])[0] == 200
    own = ask(target, follow, session_id="r")
    assert cached(own) == n_tok
    assert own["choices"][0]["message"] == ask(target, follow, cache_prompt=False)["choices"][0]["message"]


def test_the_restore_body_limit_is_the_largest_blob_a_model_can_produce(target):
    """The largest blob in base64 plus its tokens (never below PANTHEON_MAX_BODY_BYTES, which
    bounds the tiny model here)."""
    engine = target.engine()
    per_model = restore_body_limit(engine)
    assert 4 * engine.max_blob_bytes // 3 < per_model < 4 * engine.max_blob_bytes // 3 + engine.ctx * 8 + (1 << 20)
    limit = target.state.body_limit("/session/restore")
    assert limit == max(per_model, target.state.config.max_body_bytes)
    status, body, _ = target.post("/session/restore", {"session_id": "s", "blob": "A" * limit, "tokens": [1]})
    assert status == 413 and body["error"]["type"] == "request_too_large", body
    assert str(limit) in body["error"]["message"]


# ---- over a socket: the real server refuses a huge restore body without buffering it ------------------
def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def raw_exchange(port: int, head: bytes, chunks, timeout: float = 60) -> bytes:
    """Send `head` then the body chunks (stopping when the server closes), return the response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for chunk in chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0


def test_a_256_mib_restore_body_is_refused_without_growing_the_servers_memory(smol_server):
    port, pid = smol_server.port, smol_server.proc.pid
    size = 256 << 20
    before = rss_kib(pid)
    # declared: refused from its Content-Length, unread
    head = (f"POST /session/restore HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    response = raw_exchange(port, head, [b'{"blob":"' + b"A" * 65536])
    assert status_of(response) == 413 and b"request_too_large" in response, response[:300]
    # chunked: read up to the limit, then refused
    head = b"POST /session/restore HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"A" * (1 << 20)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    response = raw_exchange(port, head, (chunk for _ in range(size >> 20)))
    assert status_of(response) == 413 and b"request_too_large" in response, response[:300]
    time.sleep(0.5)
    grown = rss_kib(pid) - before
    # the limit for SmolLM2 at 4096 tokens is ~251 MB: the chunked body was buffered up to it, and
    # freed with the refusal (measured: +68 KiB under glibc malloc)
    assert grown < 8 << 10, f"RSS grew by {grown >> 10} MiB"


@pytest.mark.parametrize("arrays,words", [
    (["k.0"], "arrays[0] must be an object with 'name', 'dtype' and 'shape'"),
    ([{"name": "k.0", "dtype": "O", "shape": [1]}], "arrays[0].dtype must name a numeric array type"),
    ([{"name": "k.0", "dtype": "float32", "shape": "12"}], "arrays[0].shape must be a list"),
    ([{"name": 5, "dtype": "float32", "shape": [1]}], "arrays[0].name must be a string"),
    ("all", "must be an object with an 'arrays' list"),
])
def test_a_malformed_blob_header_is_refused_in_words(target, exported, arrays, words):
    """Even sealed under the right key (a server bug, a leaked key), a header is checked field by
    field: the refusal names the field, never Python's exception text (issue 26: "string indices
    must be integers", "cannot create an OBJECT array from memory buffer")."""
    header = {"arch": "llama", "arrays": arrays}
    body = framed(header, b"")
    status, err = restore(target, "h", body + session_blob.seal(session_key(), body), exported["tokens"])
    assert status == 400 and err["error"]["type"] == "bad_session_blob", err
    assert words in err["error"]["message"]
    assert "indices" not in err["error"]["message"] and "OBJECT" not in err["error"]["message"]
