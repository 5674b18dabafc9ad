"""Native CPU kernels called from compiled JAX programs through XLA's FFI (see qmatmul.py)."""
