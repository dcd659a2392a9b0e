"""kvd: KV-cache and encoder-cache transfer daemon over NVIDIA NIXL."""

__version__ = "0.1.0"
