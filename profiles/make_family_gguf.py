#!/usr/bin/env python3
"""A random-weight GGUF of a family beyond the llama shapes of ../shared/tools/make-shaped-gguf.py, at a
real model's shape, with another file's tokenizer and chat template, as F16: quantize it with
llama-quantize (e.g. Q4_K_M) and measure it side by side with `pantheon bench --against`.

usage: make_family_gguf.py TOKENIZER.gguf OUT.gguf --shape SHAPE [--layers N] [--seed 0]
Shapes (random N(0, 0.02) weights, norms 1; gibberish text: ban end of generation when measuring):
  qwen3moe: 12 layers, 1536 hidden, 16 heads of 128 (4 KV), QK-norm, 64 experts of 768, top 8
            (Qwen3-30B-A3B's proportions at ~2.8 B parameters, ~0.45 B active; Q4_K_M 1.65 GiB)
  mixtral:  `llama` with experts: 12 layers, 1024 hidden, 16 heads of 64 (4 KV), 8 experts of
            2816, top 2 (~0.9 B parameters; Q4_K_M 543 MiB)
  qwen3:    Qwen3-1.7B's dims: 28 layers, 2048 hidden, 16 heads of 128 (8 KV), QK-norm, FFN 6144
  qwen2:    Qwen2.5-1.5B's dims: 28 layers, 1536 hidden, 12 heads of 128 (2 KV), q/k/v biases, FFN 8960
  gemma3:   Gemma 3 1B's dims: 26 layers, 1152 hidden, 4 heads of 256 (1 KV), QK-norm, post-norms,
            FFN 6912, sliding window 512 (give it a Gemma file's tokenizer for its 262k vocabulary;
            rows of 1152 are no multiple of 256, so llama-quantize's Q4_K_M falls back to Q5_0/Q8_0)
The dense shapes tie the output to the embedding, as those models do. The writer holds every tensor
in memory until it writes (qwen3moe: ~5.8 GB of F16)."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import gguf
import numpy as np


class Shape(NamedTuple):
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the dense FFN's width, or each expert's
    experts: int = 0
    experts_used: int = 0


SHAPES = {"qwen3moe": Shape("qwen3moe", 12, 1536, 16, 4, 128, 768, 64, 8),
          "mixtral": Shape("llama", 12, 1024, 16, 4, 64, 2816, 8, 2),
          "qwen3": Shape("qwen3", 28, 2048, 16, 8, 128, 6144),
          "qwen2": Shape("qwen2", 28, 1536, 12, 2, 128, 8960),
          "gemma3": Shape("gemma3", 26, 1152, 4, 1, 256, 6912)}
QK_NORM = ("qwen3moe", "qwen3", "gemma3")


def copy_tokenizer(src: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    """The source's general/tokenizer keys (not its architecture's)."""
    for k, f in src.fields.items():
        if not k.startswith(("tokenizer.", "general.")) or k in ("general.architecture", "general.file_type"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") if sub == gguf.GGUFValueType.STRING
                    else f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(k, vals, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(k, bytes(f.parts[f.data[0]]).decode("utf-8"), vt)
        else:
            w.add_key_value(k, f.parts[f.data[0]].tolist()[0], vt)


def write(tokenizer: str, out: str, shape: str, layers: int | None = None, seed: int = 0) -> str:
    sh = SHAPES[shape]
    n_layer, e, hd = layers or sh.layers, sh.hidden, sh.head_dim
    src = gguf.GGUFReader(tokenizer)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(out, sh.arch)
    copy_tokenizer(src, w)
    w.add_block_count(n_layer)
    w.add_context_length(32768 if sh.arch == "gemma3" else 8192)
    w.add_embedding_length(e)
    w.add_feed_forward_length(sh.ffn)
    w.add_head_count(sh.heads)
    w.add_head_count_kv(sh.kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    if sh.experts:
        w.add_expert_count(sh.experts)
        w.add_expert_used_count(sh.experts_used)
    if sh.arch == "llama":
        w.add_rope_freq_base(1e4)
        w.add_rope_dimension_count(hd)
    else:
        w.add_rope_freq_base(1e6)
        w.add_key_length(hd)
        w.add_value_length(hd)
    if sh.arch == "qwen3moe":
        w.add_expert_feed_forward_length(sh.ffn)
    if sh.arch == "gemma3":
        w.add_sliding_window(512)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)

    def mat(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n):
        return np.ones(n, np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, e))  # the dense shapes' output too (tied)
    w.add_tensor("output_norm.weight", ones(e))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(e))
        w.add_tensor(p + "ffn_norm.weight", ones(e))
        w.add_tensor(p + "attn_q.weight", mat(sh.heads * hd, e))
        w.add_tensor(p + "attn_k.weight", mat(sh.kv_heads * hd, e))
        w.add_tensor(p + "attn_v.weight", mat(sh.kv_heads * hd, e))
        w.add_tensor(p + "attn_output.weight", mat(e, sh.heads * hd))
        if sh.arch in QK_NORM:
            w.add_tensor(p + "attn_q_norm.weight", ones(hd))
            w.add_tensor(p + "attn_k_norm.weight", ones(hd))
        if sh.arch == "qwen2":
            for name, rows in (("attn_q", sh.heads * hd), ("attn_k", sh.kv_heads * hd), ("attn_v", sh.kv_heads * hd)):
                w.add_tensor(p + name + ".bias", rng.standard_normal(rows, dtype=np.float32) * 0.02)
        if sh.arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", ones(e))
            w.add_tensor(p + "post_ffw_norm.weight", ones(e))
        if sh.experts:
            w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((sh.experts, e), dtype=np.float32) * 0.02)
            w.add_tensor(p + "ffn_gate_exps.weight", mat(sh.experts, sh.ffn, e))
            w.add_tensor(p + "ffn_up_exps.weight", mat(sh.experts, sh.ffn, e))
            w.add_tensor(p + "ffn_down_exps.weight", mat(sh.experts, e, sh.ffn))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(sh.ffn, e))
            w.add_tensor(p + "ffn_up.weight", mat(sh.ffn, e))
            w.add_tensor(p + "ffn_down.weight", mat(e, sh.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokenizer")
    ap.add_argument("out")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3moe")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(write(a.tokenizer, a.out, a.shape, a.layers, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
