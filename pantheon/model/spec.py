"""ModelSpec: the typed hyper-parameters of one architecture, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pantheon.gguf.reader import GGUFError, GGUFFile, shown
from pantheon.model.rope_scaling import RopeScaling, rope_scaling

# llama.cpp's rope variants: NORM rotates adjacent pairs (x[2i], x[2i+1]) — the llama converter
# permutes Q/K rows for it; NEOX rotates halves (x[i], x[i + d/2]).
ROPE_NORM, ROPE_NEOX = "norm", "neox"

DENSE_ARCHS = {"llama": ROPE_NORM, "mistral": ROPE_NORM, "minicpm": ROPE_NORM,
               "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX, "phi3": ROPE_NEOX, "gemma3": ROPE_NEOX, "qwen3moe": ROPE_NEOX}
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
    rope_scaling: RopeScaling | None = None  # llama3 rope_freqs, linear, YaRN (None: plain rope)
    # gemma3: sliding-window layers (their own rope base, unscaled; mistral's: every layer, the
    # global rope), norms after attention and after the FFN, a GELU-gated FFN, q scaled beyond
    # 1/sqrt(head_dim), logits soft-capped
    swa_layers: tuple[bool, ...] = ()
    swa_window: int = 0  # keys a sliding layer attends: q_pos - k_pos < swa_window
    rope_base_swa: float | None = None  # a sliding layer's own rope base, unscaled (gemma3); None: the global rope
    post_norms: bool = False
    ffn_act: str = "silu"  # or "gelu" (tanh form)
    q_scale: float = 1.0
    logit_softcap: float = 0.0
    # routed experts instead of the FFN (qwen3moe, llama with experts: Mixtral): softmax over the
    # router's logits, the top n_expert_used renormalised, each a SwiGLU of width n_ff_exp
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0

    def for_context(self, ctx: int) -> ModelSpec:
        """This spec for a cache of `ctx` positions a sequence (LongRoPE picks its factors by it)."""
        if self.rope_scaling is None or self.rope_scaling.long_factors is None:
            return self
        return replace(self, rope_scaling=self.rope_scaling.for_context(ctx))

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _first(value):
    """Some keys may be per-layer arrays; dense models use one value for all layers."""
    return value[0] if isinstance(value, list) and value else value


def _number(g: GGUFFile, full: str, value, kind=int):
    """`value` as an int (or float), or a GGUFError naming the key: never a TypeError/ValueError from
    a string, list or NaN where a number belongs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (kind is int and value != int(value)):
        what = "an integer" if kind is int else "a finite number"
        raise GGUFError(f"{g.path}: {full!r} must be {what}, got {repr(value)[:80]}")
    return kind(value)


def _check_ranges(g: GGUFFile, arch: str, **values: int) -> None:
    """Hyper-parameters that must be positive (keys without the arch prefix, e.g. block_count)."""
    for name, v in values.items():
        if v <= 0:
            raise GGUFError(f"{g.path}: {arch}.{name.replace('__', '.')} must be > 0, got {v}")


def _check_layers(g: GGUFFile, arch: str, n_layer: int) -> None:
    if n_layer > len(g.tensors):  # every layer has tensors: a corrupt count must not drive a huge loop
        raise GGUFError(f"{g.path}: {arch}.block_count {n_layer} exceeds the {len(g.tensors)} tensors in the file")


def _check_context(g: GGUFFile, arch: str, ctx: int) -> None:
    if ctx < 2:
        raise GGUFError(f"{g.path}: {arch}.context_length must be at least 2, got {ctx}")


def _check_vocab(g: GGUFFile, n_vocab: int) -> None:
    """Token strings are unique (llama.cpp asserts this; empty ones become [EMPTY_i]) and every token
    id has an embedding row."""
    tokens = g.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{g.path}: tokenizer.ggml.tokens must be an array of strings")
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t and t in seen:
                raise GGUFError(f"{g.path}: duplicate token in vocabulary: {shown(t)} has ids {seen[t]} and {i}")
            seen.setdefault(t, i)
    if len(tokens) > n_vocab:
        raise GGUFError(f"{g.path}: tokenizer.ggml.tokens has {len(tokens)} tokens, more than the "
                        f"{n_vocab} rows of the embedding (vocab_size)")


def spec_from_gguf(g: GGUFFile) -> ModelSpec | HybridSpec:
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{g.path}: unsupported architecture {shown(arch)} "
                        f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    if arch in HYBRID_ARCHS:
        return hybrid_spec_from_gguf(g)

    def key(name, default=None, required=False, kind=int):
        full = f"{arch}.{name}"
        value = _first(g.require(full) if required else g.get(full, default))
        return value if value is None else _number(g, full, value, kind)

    n_embd = key("embedding_length", required=True)
    n_head = key("attention.head_count", required=True)
    n_layer = key("block_count", required=True)
    _check_ranges(g, arch, embedding_length=n_embd, attention__head_count=n_head, block_count=n_layer)
    _check_layers(g, arch, n_layer)
    n_head_kv = key("attention.head_count_kv", n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{g.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if key("attention.key_length") is None and n_embd % n_head:
        raise GGUFError(f"{g.path}: {arch}.embedding_length {n_embd} is not a multiple of "
                        f"attention.head_count {n_head}")
    head_dim = key("attention.key_length", n_embd // n_head)
    tokens = g.get("tokenizer.ggml.tokens")
    n_vocab = key("vocab_size", len(tokens) if isinstance(tokens, list) else 0)
    n_ff = key("feed_forward_length", required=True)
    _check_dense_variant(g, arch)
    ctx_train = key("context_length", 4096)
    window = key("attention.sliding_window", None)
    # gemma3 interleaves sliding layers with global ones; a `mistral` file (Mistral v0.1) slides in
    # every layer, with the global rope. llama.cpp b11434 reads no window for `llama` and disables
    # Phi-3's ("Phi SWA is currently disabled"): those attend over the whole context, as it does.
    sliding = dict(swa_layers=(True,) * n_layer, swa_window=int(window)) if arch == "mistral" and window else {}
    rope_dim = key("rope.dimension_count", head_dim)
    _check_ranges(g, arch, attention__key_length=head_dim, feed_forward_length=n_ff, vocab_size=n_vocab)
    _check_context(g, arch, ctx_train)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise GGUFError(f"{g.path}: {arch}.rope.dimension_count {rope_dim} must be even and within "
                        f"the head size {head_dim}")
    _check_vocab(g, n_vocab)
    spec = ModelSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab,
        ctx_train=ctx_train, rope_base=key("rope.freq_base", 10000.0, kind=float),
        rope_dim=rope_dim, rope_style=DENSE_ARCHS[arch],
        rms_eps=key("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
        tied_embeddings="output.weight" not in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        rope_scaling=rope_scaling(g, arch, key, rope_dim, ctx_train),
        **{**_scales(key, arch, n_layer, n_embd),
           **(_gemma3(g, key, n_layer, n_embd, n_head, head_dim, window) if arch == "gemma3" else sliding),
           **_experts(g, key, n_ff)},
    )
    _check_shapes(g, spec)
    return spec


def _check_dense_variant(g: GGUFFile, arch: str) -> None:
    """Variants of the dense architectures this forward does not implement: refused at load with the
    reason, instead of running them wrong."""
    if "blk.0.ffn_gate_inp.weight" in g.tensors and arch not in ("llama", "qwen3moe"):
        raise GGUFError(f"{g.path}: {arch} with routed experts (ffn_gate_inp) is not supported")
    if arch == "qwen3moe" and "blk.0.ffn_gate_inp.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: qwen3moe without routed experts (no blk.0.ffn_gate_inp.weight)")


def _scales(key, arch: str, n_layer: int, n_embd: int) -> dict[str, float]:
    """embed_scale, residual_scale, logit_scale (the logits are divided by it). A MiniCPM file
    without the keys takes llama.cpp's defaults for older MiniCPM exports: 12, 1.4 / sqrt(n_layer)
    and 256 / n_embd (llama.cpp's loader sets these before reading the optional keys, and its graph
    divides the logits by f_logit_scale); every other architecture, 1."""
    minicpm = arch == "minicpm"
    return {"embed_scale": key("embedding_scale", 12.0 if minicpm else 1.0, kind=float),
            "residual_scale": key("residual_scale", 1.4 / math.sqrt(n_layer) if minicpm else 1.0, kind=float),
            "logit_scale": key("logit_scale", 256.0 / n_embd if minicpm else 1.0, kind=float)}


def _gemma3(g: GGUFFile, key, n_layer: int, n_embd: int, n_head: int, head_dim: int, window) -> dict:
    """Gemma 3's variant fields, as llama.cpp's llama_model_gemma3 loads them: sliding-window layers
    by `attention.sliding_window_pattern` (a per-layer array, or n: every n-th layer global; absent:
    6), their rope base `rope.freq_base_swa` (10000), embeddings scaled by sqrt(n_embd), q by
    1/sqrt(head_dim) (the 62-layer 27B: 1/sqrt(n_embd / n_head)), `final_logit_softcapping`."""
    swa = [False] * n_layer
    if window:
        pattern = g.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            if len(pattern) != n_layer or not all(isinstance(v, (bool, int)) for v in pattern):
                raise GGUFError(f"{g.path}: gemma3.attention.sliding_window_pattern must hold {n_layer} flags")
            swa = [bool(v) for v in pattern]
        else:
            n = _number(g, "gemma3.attention.sliding_window_pattern", pattern)
            swa = [n == 0 or i % n < n - 1 for i in range(n_layer)]
    scale = 1.0 / math.sqrt(n_embd / n_head) if n_layer == 62 else 1.0 / math.sqrt(head_dim)
    return dict(swa_layers=tuple(swa), swa_window=int(window or 0),
                rope_base_swa=key("rope.freq_base_swa", 10000.0, kind=float),
                post_norms=True, ffn_act="gelu", embed_scale=math.sqrt(n_embd), q_scale=scale * math.sqrt(head_dim),
                logit_softcap=key("final_logit_softcapping", 0.0, kind=float))


def _experts(g: GGUFFile, key, n_ff: int) -> dict:
    """The routed experts of a dense-family file (`ffn_gate_inp` in its layers): how many, how many a
    token uses, their width (`expert_feed_forward_length`, else the FFN's)."""
    if "blk.0.ffn_gate_inp.weight" not in g.tensors:
        return {}
    n_expert, used = key("expert_count", required=True), key("expert_used_count", required=True)
    if not 0 < used <= n_expert <= 4096:
        raise GGUFError(f"{g.path}: expert_used_count {used} must be within 1..expert_count ({n_expert})")
    return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=key("expert_feed_forward_length", n_ff))


def _check_shapes(g: GGUFFile, spec: ModelSpec) -> None:
    """Fail at load, with the tensor named, rather than deep inside a jitted function."""
    expect = {"token_embd.weight": (spec.n_vocab, spec.n_embd), "output_norm.weight": (spec.n_embd,)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        expect[p + "attn_norm.weight"] = (spec.n_embd,)
        expect[p + "ffn_norm.weight"] = (spec.n_embd,)
        expect[p + "attn_output.weight"] = (spec.n_embd, spec.n_head * spec.head_dim)
        if spec.n_expert:
            x, f = spec.n_expert, spec.n_ff_exp
            expect[p + "ffn_gate_inp.weight"] = (x, spec.n_embd)
            expect[p + "ffn_gate_exps.weight"] = expect[p + "ffn_up_exps.weight"] = (x, f, spec.n_embd)
            expect[p + "ffn_down_exps.weight"] = (x, spec.n_embd, f)
        else:
            expect[p + "ffn_down.weight"] = (spec.n_embd, spec.n_ff)
        if spec.arch == "phi3":
            expect[p + "attn_qkv.weight"] = (spec.n_head * spec.head_dim + 2 * spec.kv_dim, spec.n_embd)
            expect[p + "ffn_up.weight"] = (2 * spec.n_ff, spec.n_embd)
        else:
            expect[p + "attn_q.weight"] = (spec.n_head * spec.head_dim, spec.n_embd)
            expect[p + "attn_k.weight"] = (spec.kv_dim, spec.n_embd)
            expect[p + "attn_v.weight"] = (spec.kv_dim, spec.n_embd)
            if not spec.n_expert:
                expect[p + "ffn_gate.weight"] = (spec.n_ff, spec.n_embd)
                expect[p + "ffn_up.weight"] = (spec.n_ff, spec.n_embd)
        if spec.qk_norm:
            expect[p + "attn_q_norm.weight"] = expect[p + "attn_k_norm.weight"] = (spec.head_dim,)
        if spec.post_norms:
            expect[p + "post_attention_norm.weight"] = expect[p + "post_ffw_norm.weight"] = (spec.n_embd,)
        if p + "attn_q.bias" in g.tensors:
            expect[p + "attn_q.bias"] = (spec.n_head * spec.head_dim,)
            expect[p + "attn_k.bias"] = expect[p + "attn_v.bias"] = (spec.kv_dim,)
    if not spec.tied_embeddings:
        expect["output.weight"] = (spec.n_vocab, spec.n_embd)
    for name, shape in expect.items():
        info = g.tensor_info(name)
        if info.shape != shape:
            raise GGUFError(f"{g.path}: tensor {shown(name)} has shape {info.shape}, expected {shape} "
                            f"from the {spec.arch} metadata")


# ---- hybrid models (qwen35moe: Gated DeltaNet + gated full attention, every layer MoE) ----------------
@dataclass(frozen=True)
class HybridSpec:
    """Hyper-parameters of qwen35moe. DeltaNet sizes follow llama.cpp's `ssm.*` keys: ssm_n_group is
    the number of key heads, ssm_dt_rank the number of value heads, ssm_d_state both head dims."""

    arch: str
    n_layer: int  # trunk layers (block_count minus trailing MTP blocks)
    n_embd: int
    n_vocab: int
    ctx_train: int
    rms_eps: float
    tied_embeddings: bool
    recurrent: tuple[bool, ...]  # per layer: True = Gated DeltaNet, False = full attention
    # full attention
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_sections: tuple[int, ...]  # IMROPE sections; for text positions they do not change the result
    # MoE + shared expert
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    # Gated DeltaNet
    ssm_d_conv: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    rope_style: str = ROPE_NEOX

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def key_dim(self) -> int:  # all DeltaNet key heads
        return self.ssm_n_group * self.ssm_d_state

    @property
    def value_dim(self) -> int:  # all DeltaNet value heads (= ssm.inner_size)
        return self.ssm_dt_rank * self.ssm_d_state

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: q | k | v
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if not r)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if r)


def _per_layer(g: GGUFFile, full: str, value, layers) -> int:
    """A scalar key, or a per-layer array that must hold one value over `layers`."""
    if not isinstance(value, list):
        return value
    try:
        picked = {value[i] for i in layers if i < len(value)}
    except TypeError:  # unhashable: arrays of arrays
        picked = set()
    if len(picked) != 1:
        raise GGUFError(f"{g.path}: {full!r} must have one value over layers {list(layers)}, got {value}")
    return picked.pop()


def hybrid_spec_from_gguf(g: GGUFFile) -> HybridSpec:
    arch = g.architecture
    missing = object()

    def key(name, default=missing):
        full = f"{arch}.{name}"
        return g.require(full) if default is missing else g.get(full, default)

    def bad(name, why):
        return GGUFError(f"{g.path}: {arch}.{name} {why}")

    def num(name, default=missing, kind=int):
        return _number(g, f"{arch}.{name}", key(name, default), kind)

    n_layer_all = num("block_count")
    n_layer = n_layer_all - num("nextn_predict_layers", 0)  # MTP blocks are never run
    if n_layer <= 0:
        raise bad("block_count", f"must leave at least one trunk layer, got {n_layer_all} "
                                 f"(nextn_predict_layers {n_layer_all - n_layer})")
    _check_layers(g, arch, n_layer_all)
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is None:
        interval = num("full_attention_interval", 4)
        _check_ranges(g, arch, full_attention_interval=interval)
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer_all)]
    if not isinstance(recurrent, list) or len(recurrent) != n_layer_all:
        raise bad("attention.recurrent_layers", f"must be a list of {n_layer_all} flags, got {shown(recurrent)}")
    recurrent = tuple(bool(r) for r in recurrent[:n_layer])
    attn = [i for i, r in enumerate(recurrent) if not r] or [0]

    n_embd = num("embedding_length")
    n_head = _number(g, f"{arch}.attention.head_count",
                     _per_layer(g, f"{arch}.attention.head_count", key("attention.head_count"), attn))
    n_head_kv = _number(g, f"{arch}.attention.head_count_kv",
                        _per_layer(g, f"{arch}.attention.head_count_kv", key("attention.head_count_kv", n_head), attn))
    _check_ranges(g, arch, embedding_length=n_embd, attention__head_count=n_head)
    if key("attention.key_length", None) is None and n_embd % n_head:
        raise bad("embedding_length", f"{n_embd} is not a multiple of attention.head_count {n_head}")
    head_dim = num("attention.key_length", n_embd // n_head)
    _check_ranges(g, arch, attention__key_length=head_dim)
    if num("attention.value_length", head_dim) != head_dim:
        raise bad("attention.value_length", f"must equal attention.key_length ({head_dim})")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise bad("attention.head_count_kv", f"{n_head_kv} does not divide head_count {n_head}")
    sections = key("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4 or not all(isinstance(x, int) for x in sections):
        raise bad("rope.dimension_sections", f"must be 4 integers, got {shown(sections)}")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise bad("rope.scaling.type", f"{shown(scaling)} is not supported")

    every = range(n_layer)
    n_used = _number(g, f"{arch}.expert_used_count",
                     _per_layer(g, f"{arch}.expert_used_count", key("expert_used_count"), every))
    _check_ranges(g, arch, expert_used_count=n_used)
    n_ff = key("feed_forward_length", None)  # only a fallback for the two expert sizes
    if n_ff is not None:
        n_ff = _number(g, f"{arch}.feed_forward_length", _per_layer(g, f"{arch}.feed_forward_length", n_ff, every))
    n_ff_exp = key("expert_feed_forward_length", None if n_ff is None else n_ff // n_used)
    n_ff_shexp = key("expert_shared_feed_forward_length", n_ff)
    if n_ff_exp is None or n_ff_shexp is None:
        missing_key = "expert_feed_forward_length" if n_ff_exp is None else "expert_shared_feed_forward_length"
        raise GGUFError(f"{g.path}: missing required metadata key {f'{arch}.{missing_key}'!r}")

    d_state, n_group, dt_rank = num("ssm.state_size"), num("ssm.group_count"), num("ssm.time_step_rank")
    if num("ssm.inner_size") != d_state * dt_rank:
        raise bad("ssm.inner_size", f"must equal ssm.state_size * ssm.time_step_rank ({d_state * dt_rank})")
    if n_group <= 0 or dt_rank % n_group:
        raise bad("ssm.group_count", f"{n_group} does not divide ssm.time_step_rank {dt_rank}")

    tokens = g.get("tokenizer.ggml.tokens")
    n_vocab = num("vocab_size", len(tokens) if isinstance(tokens, list) and tokens
                  else g.tensor_info("token_embd.weight").shape[0])
    _check_ranges(g, arch, vocab_size=n_vocab, ssm__state_size=d_state, ssm__time_step_rank=dt_rank)
    _check_context(g, arch, num("context_length"))
    _check_vocab(g, n_vocab)
    spec = HybridSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab, ctx_train=num("context_length"),
        rms_eps=num("attention.layer_norm_rms_epsilon", kind=float), tied_embeddings="output.weight" not in g.tensors,
        recurrent=recurrent, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        rope_dim=num("rope.dimension_count", head_dim), rope_base=num("rope.freq_base", 10000.0, kind=float),
        rope_sections=tuple(int(s) for s in sections), n_expert=num("expert_count"), n_expert_used=n_used,
        n_ff_exp=_number(g, f"{arch}.expert_feed_forward_length",
                         _per_layer(g, f"{arch}.expert_feed_forward_length", n_ff_exp, every)),
        n_ff_shexp=_number(g, f"{arch}.expert_shared_feed_forward_length",
                           _per_layer(g, f"{arch}.expert_shared_feed_forward_length", n_ff_shexp, every)),
        ssm_d_conv=num("ssm.conv_kernel"), ssm_d_state=d_state, ssm_n_group=n_group, ssm_dt_rank=dt_rank)
    if spec.rope_dim % 2 or not 0 < spec.rope_dim <= head_dim:
        raise bad("rope.dimension_count", f"{spec.rope_dim} must be even and within head_dim {head_dim}")
    _check_ranges(g, arch, expert_feed_forward_length=spec.n_ff_exp, ssm__conv_kernel=spec.ssm_d_conv,
                  expert_shared_feed_forward_length=spec.n_ff_shexp)
    if not 0 < spec.n_expert_used <= spec.n_expert:
        raise bad("expert_used_count", f"{spec.n_expert_used} is not in 1..expert_count ({spec.n_expert})")
    _check_hybrid_shapes(g, spec)
    return spec


def hybrid_tensor_shapes(g: GGUFFile, spec: HybridSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the trunk reads, with its numpy shape (GGUF ne reversed)."""
    e, x = spec.n_embd, spec.n_expert
    shapes = {"token_embd.weight": (spec.n_vocab, e), "output_norm.weight": (e,)}
    if not spec.tied_embeddings:
        shapes["output.weight"] = (spec.n_vocab, e)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (e,), p + "post_attention_norm.weight": (e,),
                       p + "ffn_gate_inp.weight": (x, e), p + "ffn_down_exps.weight": (x, e, spec.n_ff_exp),
                       p + "ffn_gate_inp_shexp.weight": (e,), p + "ffn_gate_shexp.weight": (spec.n_ff_shexp, e),
                       p + "ffn_up_shexp.weight": (spec.n_ff_shexp, e),
                       p + "ffn_down_shexp.weight": (e, spec.n_ff_shexp)})
        if p + "ffn_gate_up_exps.weight" in g.tensors:  # fused variant: gate rows first, then up
            shapes[p + "ffn_gate_up_exps.weight"] = (x, 2 * spec.n_ff_exp, e)
        else:
            shapes[p + "ffn_gate_exps.weight"] = shapes[p + "ffn_up_exps.weight"] = (x, spec.n_ff_exp, e)
        if spec.recurrent[i]:
            nv, dv = spec.ssm_dt_rank, spec.ssm_d_state
            shapes.update({p + "attn_qkv.weight": (spec.conv_dim, e), p + "attn_gate.weight": (spec.value_dim, e),
                           p + "ssm_beta.weight": (nv, e), p + "ssm_alpha.weight": (nv, e),
                           p + "ssm_conv1d.weight": (spec.conv_dim, spec.ssm_d_conv), p + "ssm_dt.bias": (nv,),
                           p + "ssm_a": (nv,), p + "ssm_norm.weight": (dv,), p + "ssm_out.weight": (e, spec.value_dim)})
        else:
            q = spec.n_head * spec.head_dim
            shapes.update({p + "attn_q.weight": (2 * q, e), p + "attn_k.weight": (spec.kv_dim, e),
                           p + "attn_v.weight": (spec.kv_dim, e), p + "attn_q_norm.weight": (spec.head_dim,),
                           p + "attn_k_norm.weight": (spec.head_dim,), p + "attn_output.weight": (e, q)})
    return shapes


def _check_hybrid_shapes(g: GGUFFile, spec: HybridSpec) -> None:
    for name, shape in hybrid_tensor_shapes(g, spec).items():
        info = g.tensor_info(name)  # GGUFError "missing tensor 'name'"
        if info.shape != shape:
            raise GGUFError(f"{g.path}: tensor {shown(name)} has shape {info.shape}, expected {shape} "
                            f"from the {spec.arch} metadata")
