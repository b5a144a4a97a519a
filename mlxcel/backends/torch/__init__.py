"""The torch backend: transformers' family modules over mlxcel's paged KV (CPU, CUDA, MPS)."""
