"""The command line, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys


def pantheon(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pantheon", *args], capture_output=True, text=True, timeout=timeout)


def test_backend_prints_one_lowercase_token():
    out = pantheon("--backend")
    assert out.returncode == 0 and out.stdout.strip() in ("cpu", "cuda")


def test_tokenize_with_and_without_special(smollm2_path):
    out = pantheon("tokenize", "--model", str(smollm2_path), "<|im_start|>Hello world")
    assert json.loads(out.stdout) == [1, 19556, 905]
    out = pantheon("tokenize", "--no-special", "<|im_start|>")
    assert json.loads(out.stdout) == [44, 108, 306, 79, 3738, 108, 46]


def test_generate_json_greedy_first_token_equals_llamacpp(smollm2_path):
    out = pantheon("generate", "--model", str(smollm2_path), "--json", "--temperature", "0", "--max-tokens", "4",
                   "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_tokens"] == 37 and result["tokens"][0] == 60  # llama.cpp's first greedy token
    assert len(result["tokens"]) == 4 and result["text"].startswith("L'")


def test_generate_on_a_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    out = pantheon("generate", "--model", str(bad), "hi")
    assert out.returncode == 1 and "not a GGUF file" in out.stderr and "Traceback" not in out.stderr
