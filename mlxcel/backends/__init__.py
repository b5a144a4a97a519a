"""Backends: load weights, allocate per-sequence KV, run a forward over a step's rows."""
