"""How a dense model's arrays split over the dies of a mesh (axis "tp"): attention heads and FFN
columns, Megatron-style, so each die holds 1/n of every matrix and GSPMD inserts one all-reduce
after the attention output and one after the FFN down projection. Norms and the embedding table
are replicated; the KV cache splits on its KV-head axis."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

AXIS = "tp"
# params key -> spec for layer matrices stored [in, out]
_LAYER = {"wq": P(None, AXIS), "wk": P(None, AXIS), "wv": P(None, AXIS), "wo": P(AXIS, None),
          "w_gate": P(None, AXIS), "w_up": P(None, AXIS), "w_down": P(AXIS, None),
          "bq": P(AXIS), "bk": P(AXIS), "bv": P(AXIS)}
KV_CACHE = P(None, None, AXIS, None)  # [slots + 1, ctx, K, D]


def layer_spec(key: str) -> P:
    return _LAYER.get(key, P())


def check_divisible(spec, n_dies: int) -> None:
    """A mesh needs heads, KV heads and FFN columns divisible by the die count."""
    if n_dies <= 1:
        return
    for what, count in (("attention heads", spec.n_head), ("KV heads", spec.n_head_kv), ("FFN columns", spec.n_ff)):
        if count % n_dies:
            raise ValueError(f"{what} ({count}) are not divisible by {n_dies} dies; bind this model to a die "
                             f"count that divides them")
