"""The dtype a model computes in on its device.

On a GPU the dense weights (matrices and embeddings), the KV cache and the operands of every
matmul and attention product are bfloat16 — tensor cores, half the bytes streamed per decode step,
attention tiles that fit shared memory — with float32 accumulation (`preferred_element_type`) and
float32 wherever the numerics need it: the residual stream, norms, rope, softmax statistics, the
MoE router and shared-expert gate, the DeltaNet conv taps and conv/delta-rule state (llama.cpp
keeps the recurrent state F32 too), and the logits. Q3_K experts stay in their blocks either way.

The CPU keeps float32: XLA:CPU's bf16 dot is ~10x slower than its f32 one, and the native decode
kernels read the GGUF quant blocks (pantheon/native). `PANTHEON_DTYPE=float32|bfloat16` overrides
the choice (`auto`, the default, picks by backend); tests use it to run the bf16 path on the CPU
against float32 with stated tolerances (tests/model/test_bf16.py)."""

from __future__ import annotations


import jax.numpy as jnp

from pantheon.config import ENV_DTYPE, compute_dtype_name
from pantheon.pallas.dispatch import GPU_BACKENDS

_NAMES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def compute_dtype(backend: str, env: str | None = None):
    """The dtype of weights, KV and matmul operands for a model on `backend`."""
    value = (compute_dtype_name() if env is None else env).strip().lower() or "auto"
    if value == "auto":
        return jnp.bfloat16 if backend in GPU_BACKENDS else jnp.float32
    if value not in _NAMES:
        raise ValueError(f"{ENV_DTYPE}: unknown dtype {value!r} (auto, float32 or bfloat16)")
    return _NAMES[value]


# q8_0: ggml's 8-bit blocks (per 32 values an fp16 scale and 32 int8 codes, 34 bytes), held as the
# bytes (uint8, a head's D values in D / 32 * 34 of them): the native CPU attention reads them.
Q8_0_KV = jnp.dtype(jnp.uint8)
KV_DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "q8_0": Q8_0_KV}  # config.KV_DTYPE_CHOICES
_KV_LONG_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "uint8": "q8_0"}  # numpy's names -> ours


def kv_dtype_name(dtype) -> str:
    """A KV cache dtype as --kv-dtype names it (f32, f16, bf16, q8_0)."""
    return _KV_LONG_NAMES[jnp.dtype(dtype).name]


def kv_value_bytes(dtype) -> float:
    """Bytes a cached value takes: the dtype's size, or q8_0's 34 / 32."""
    return 34 / 32 if jnp.dtype(dtype) == Q8_0_KV else jnp.dtype(dtype).itemsize


def kv_head_width(dtype, head_dim: int) -> int:
    """A cache row's last dimension for one head of head_dim values: head_dim, or its q8_0 bytes."""
    if jnp.dtype(dtype) != Q8_0_KV:
        return head_dim
    if head_dim % 32:
        raise ValueError(f"a q8_0 KV cache needs a head dimension divisible by 32 (this model's is {head_dim}): "
                         "use --kv-dtype f16")
    return head_dim // 32 * 34


def kv_cache_dtype(backend: str, name: str = "auto", numerics: str = "exact"):
    """The KV cache's dtype (--kv-dtype / PANTHEON_KV_DTYPE): `auto` is the compute dtype on a GPU
    (bf16); on the CPU f16 — llama.cpp's default cache type, half f32's bytes — with `exact`
    numerics, f32 with `llamacpp` numerics. The native decode attention widens each value to f32
    exactly as it reads it and every product stays f32, so writing a key or value rounds it to the
    cache's type (f16: ~5e-4 relative) and nothing else: SmolLM2's logits move by <= 0.015 in
    `exact`. `llamacpp` numerics round activations to 8 bits, which turns that into flips (up to
    1.1 in SmolLM2's logits), and ggml's f16 cache path also rounds Q and the probabilities to f16,
    which this one does not: llama.cpp's tokens are reproduced with f32 (pass f16 to trade that for
    the memory). q8_0 (the CPU only: the Pallas kernels read f32/f16/bf16) holds a value in 8.5
    bits, as llama.cpp's `-ctk q8_0 -ctv q8_0` does."""
    name = (name or "auto").strip().lower()
    name = _KV_LONG_NAMES.get(name, name)
    if name == "auto":
        return jnp.bfloat16 if backend in GPU_BACKENDS else jnp.float32 if numerics == "llamacpp" else jnp.float16
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache type {name!r} (auto, f32, f16, bf16 or q8_0)")
    if name == "q8_0" and backend in GPU_BACKENDS:
        raise ValueError("a q8_0 KV cache is read by the CPU kernels only: on a GPU use --kv-dtype bf16, f16 or f32")
    return KV_DTYPES[name]


def backend_of(device) -> str:
    """The platform of a Device, of a Mesh's dies, or of the default backend (None)."""
    import jax

    if device is None:
        return jax.default_backend()
    if hasattr(device, "devices"):  # a Mesh
        return device.devices.flat[0].platform
    return device.platform


def itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize
