"""Pantheon: a compiled inference server for GGUF language models on JAX and Pallas."""

__version__ = "0.1.0"
