"""How a prompt is cut into prefill chunks: the chunk buckets (one compiled program each), the most
a chunk may take by what else runs (`chunk_budget`), and how many tokens the next chunk takes
(`chunk_length`), by what a padded row costs on this model's kernels (`padding_is_free`)."""

from __future__ import annotations

import jax
import numpy as np

from pantheon.model.family import DENSE, family_of
from pantheon.model.layers import native_gemm
from pantheon.model.spec import ModelSpec
from pantheon.model.state import RING_WRITES
from pantheon.native.qmatmul import QMatrix

# Prefill is compute-bound: where the products compute padded rows, padding costs its full share
# (SmolLM2 on 2 cores: 16 tokens 54-66 ms, 32: 82-105, 48: 104-109, 64: 128), so short prompts get
# finer buckets. Each costs one compile.
CHUNK_BUCKETS = (16, 32, 48, 64, 96, 128, 256, 512)
assert CHUNK_BUCKETS[-1] <= RING_WRITES, "a sliding layer's ring holds one chunk's writes beyond its window"


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


# An extra chunk costs about this many padded rows' work (a step's dispatch and attention).
CHUNK_SPLIT_ROWS = 8


def _largest_bucket_below(n: int) -> int | None:
    return max((b for b in CHUNK_BUCKETS if b < n), default=None)


def _prefill_rows(n: int) -> int:
    """The rows (real and padded, an extra chunk counted as CHUNK_SPLIT_ROWS) that n tokens cost in
    chunk_length's chunks."""
    full = _largest_bucket_below(n)
    whole = bucket_for(n, CHUNK_BUCKETS)
    return whole if full is None else min(whole, full + CHUNK_SPLIT_ROWS + _prefill_rows(n - full))


def chunk_length(remaining: int, limit: int, padding_free: bool = False) -> int:
    """How many of a prompt's `remaining` tokens the next prefill chunk takes, at most `limit`.
    A chunk is padded to its bucket, and a padded row costs what a real one does: a remainder far
    from its bucket goes in more chunks, the largest bucket it fills first (138 tokens: 128 + 16
    rows, not 256; 400: 256 + 128 + 16, not 512), unless the extra chunks cost as much as the
    padding they save. Where padded rows cost next to nothing (`padding_is_free`), the remainder
    goes in one chunk: a product over more rows runs nearer the cores' peak (the 1 B's 678-token
    prompt 512 + 128 + 38 -> 512 + 166 rows: 3.62 -> 3.34 s; 400 tokens 2.22 -> 1.96 s)."""
    n = min(remaining, limit)
    full = _largest_bucket_below(n)
    if n < remaining or full is None or padding_free:
        return n
    return full if full + CHUNK_SPLIT_ROWS + _prefill_rows(n - full) < bucket_for(n, CHUNK_BUCKETS) else n


STEP_TOKENS = 512  # a prompt alone on the device prefills in chunks of this many tokens
SHARED_CHUNKS = (128, 64, 16)  # ... and in chunks of one of these while other sequences are in flight,
SHARED_STEP_KEYS = 128 * 2048  # the largest whose chunk tokens x keys attended stays within this
SCORED_CHUNK = 64  # a scored prompt's chunks, whatever else runs: its scores do not depend on the load
SCORED_LOGITS = 2**24  # ... and fewer where their logits (every row's come back) would pass 64 MiB


def chunk_budget(prefill_at: int, alone: bool, scored_vocab: int = 0) -> int:
    """The most tokens a prompt's next chunk may take (chunk_length's `limit`), its first `prefill_at`
    tokens done: STEP_TOKENS when the prompt has the device to itself (`alone`). Shared with other
    sequences, a chunk is bounded in tokens and in attention work (chunk x keys attended): deep into
    a long prompt each token attends to thousands of keys, and a fixed-size chunk would stall
    everyone else's step for seconds. A scored prompt (scored_vocab: its vocabulary's size) takes
    the same chunks alone or beside others (other chunkings move scores by up to ~2e-3, measured on
    SmolLM2: other kernels, other summation orders), bounded in bytes too: every row's logits come back."""
    if scored_vocab:
        return max([b for b in CHUNK_BUCKETS if b <= SCORED_CHUNK and b * scored_vocab <= SCORED_LOGITS],
                   default=CHUNK_BUCKETS[0])
    if alone:
        return STEP_TOKENS
    return next((t for t in SHARED_CHUNKS if t * (prefill_at + t) <= SHARED_STEP_KEYS), SHARED_CHUNKS[-1])


def padding_is_free(spec: ModelSpec, params) -> bool:
    """Whether a prefill chunk's padded rows cost next to nothing: every matrix of every layer is
    multiplied by the native kernels at any row count (layers.native_gemm), which leave the rows of
    zeros llama.block holds padding at out of the arithmetic (attention still computes them: little
    beside the products, as long as it is the native kernel's; Gemma 3 270M's 678-token prompt in
    one chunk took 0.67 -> 0.78 s while its sliding layers' attention was jnp's, 0.57 -> 0.53 now).
    Not with routed experts: padding rows are routed like real ones."""
    if spec.n_expert or family_of(spec) is not DENSE:
        return False
    layers = params.get("layers") if isinstance(params, dict) else None
    leaves = jax.tree_util.tree_leaves(layers, is_leaf=lambda x: isinstance(x, QMatrix))
    matrices = [w for w in leaves if isinstance(w, QMatrix) or np.ndim(w) >= 2]
    return bool(matrices) and all(native_gemm(w) for w in matrices)
