"""GGUF files: the container reader and the quant block formats."""

from pantheon.gguf.reader import GGUFError, GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "open_gguf"]
