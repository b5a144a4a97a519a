"""Compatibility data: the llama-server b10621 manifest and helpers that read it."""
