"""ModelSpec: the typed hyper-parameters of one architecture, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.gguf.reader import GGUFError, GGUFFile

# llama.cpp's rope variants: NORM rotates adjacent pairs (x[2i], x[2i+1]) — the llama converter
# permutes Q/K rows for it; NEOX rotates halves (x[i], x[i + d/2]).
ROPE_NORM, ROPE_NEOX = "norm", "neox"

DENSE_ARCHS = {"llama": ROPE_NORM, "mistral": ROPE_NORM, "minicpm": ROPE_NORM,
               "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX, "phi3": ROPE_NEOX}
HYBRID_ARCHS = {"qwen35moe"}
SUPPORTED_ARCHS = set(DENSE_ARCHS) | HYBRID_ARCHS


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    ctx_train: int
    rope_base: float
    rope_dim: int  # leading dims of each head that are rotated
    rope_style: str
    rms_eps: float
    tied_embeddings: bool
    qk_norm: bool = False  # qwen3: RMSNorm over each q/k head before rope
    embed_scale: float = 1.0  # minicpm: token embeddings are multiplied by this
    residual_scale: float = 1.0  # minicpm: each block's output is multiplied by this
    logit_scale: float = 1.0  # logits are divided by this

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _first(value):
    """Some keys may be per-layer arrays; dense models use one value for all layers."""
    return value[0] if isinstance(value, list) else value


def spec_from_gguf(g: GGUFFile) -> ModelSpec:
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{g.path}: unsupported architecture {arch!r} "
                        f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    if arch in HYBRID_ARCHS:
        raise GGUFError(f"{g.path}: architecture {arch!r} is recognised but its model is not built yet")

    def key(name, default=None, required=False):
        full = f"{arch}.{name}"
        if required:
            return _first(g.require(full))
        return _first(g.get(full, default))

    n_embd = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    n_head_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    tokens = g.get("tokenizer.ggml.tokens")
    n_vocab = int(g.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{g.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_layer = int(key("block_count", required=True))
    spec = ModelSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=int(key("feed_forward_length", required=True)), n_vocab=n_vocab,
        ctx_train=int(key("context_length", 4096)), rope_base=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)), rope_style=DENSE_ARCHS[arch],
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        embed_scale=float(key("embedding_scale", 1.0)),
        residual_scale=float(key("residual_scale", 1.0)),
        logit_scale=float(key("logit_scale", 1.0)),
    )
    _check_shapes(g, spec)
    return spec


def _check_shapes(g: GGUFFile, spec: ModelSpec) -> None:
    """Fail at load, with the tensor named, rather than deep inside a jitted function."""
    expect = {"token_embd.weight": (spec.n_vocab, spec.n_embd)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        expect[p + "attn_norm.weight"] = (spec.n_embd,)
        expect[p + "ffn_norm.weight"] = (spec.n_embd,)
        expect[p + "attn_output.weight"] = (spec.n_embd, spec.n_head * spec.head_dim)
        expect[p + "ffn_down.weight"] = (spec.n_embd, spec.n_ff)
        if spec.arch == "phi3":
            expect[p + "attn_qkv.weight"] = (spec.n_head * spec.head_dim + 2 * spec.kv_dim, spec.n_embd)
            expect[p + "ffn_up.weight"] = (2 * spec.n_ff, spec.n_embd)
        else:
            expect[p + "attn_q.weight"] = (spec.n_head * spec.head_dim, spec.n_embd)
            expect[p + "attn_k.weight"] = (spec.kv_dim, spec.n_embd)
            expect[p + "attn_v.weight"] = (spec.kv_dim, spec.n_embd)
            expect[p + "ffn_gate.weight"] = (spec.n_ff, spec.n_embd)
            expect[p + "ffn_up.weight"] = (spec.n_ff, spec.n_embd)
    if not spec.tied_embeddings:
        expect["output.weight"] = (spec.n_vocab, spec.n_embd)
    for name, shape in expect.items():
        info = g.tensor_info(name)
        if info.shape != shape:
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                            f"from the {spec.arch} metadata")
