#!/usr/bin/env python3
"""A random-weight routed-experts GGUF at a mid shape, with another file's tokenizer and chat template
(SmolLM2's, as ../shared/tools/make-shaped-gguf.py), as F16: quantize it with llama-quantize (e.g.
Q4_K_M) and measure it side by side with `pantheon bench --against`.

usage: make_moe_gguf.py TOKENIZER.gguf OUT.gguf --shape qwen3moe|mixtral [--layers N] [--seed 0]
Shapes (random N(0, 0.02) weights, norms 1; gibberish text: ban end of generation when measuring):
  qwen3moe: 12 layers, 1536 hidden, 16 heads of 128 (4 KV), QK-norm, 64 experts of 768, top 8
            (Qwen3-30B-A3B's proportions at ~2.8 B parameters, ~0.45 B active; Q4_K_M 1.65 GiB)
  mixtral:  `llama` with experts: 12 layers, 1024 hidden, 16 heads of 64 (4 KV), 8 experts of
            2816, top 2 (~0.9 B parameters; Q4_K_M 543 MiB)
The writer holds every tensor in memory until it writes (qwen3moe: ~5.8 GB of F16)."""

from __future__ import annotations

import argparse

import gguf
import numpy as np

# layers, hidden, heads, kv heads, head dim, experts, used, expert width
SHAPES = {"qwen3moe": (12, 1536, 16, 4, 128, 64, 8, 768), "mixtral": (12, 1024, 16, 4, 64, 8, 2, 2816)}
ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama"}


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
    n_layer, e, h, kv, hd, x, k, f = SHAPES[shape]
    n_layer = layers or n_layer
    src = gguf.GGUFReader(tokenizer)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(out, ARCH[shape])
    copy_tokenizer(src, w)
    w.add_block_count(n_layer)
    w.add_context_length(8192)
    w.add_embedding_length(e)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_expert_count(x)
    w.add_expert_used_count(k)
    if shape == "qwen3moe":
        w.add_rope_freq_base(1e6)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_feed_forward_length(f)
    else:
        w.add_rope_freq_base(1e4)
        w.add_rope_dimension_count(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)

    def mat(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(n_vocab, e))
    w.add_tensor("output_norm.weight", np.ones(e, np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(e, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(e, np.float32))
        w.add_tensor(p + "attn_q.weight", mat(h * hd, e))
        w.add_tensor(p + "attn_k.weight", mat(kv * hd, e))
        w.add_tensor(p + "attn_v.weight", mat(kv * hd, e))
        w.add_tensor(p + "attn_output.weight", mat(e, h * hd))
        if shape == "qwen3moe":
            w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((x, e), dtype=np.float32) * 0.02)
        w.add_tensor(p + "ffn_gate_exps.weight", mat(x, f, e))
        w.add_tensor(p + "ffn_up_exps.weight", mat(x, f, e))
        w.add_tensor(p + "ffn_down_exps.weight", mat(x, e, f))
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
