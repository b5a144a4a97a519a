"""Configuration: the resolved server settings, the startup refusal, and the plain values every
layer reads (RoPE overrides as given, b10621's sampler defaults). Imports nothing of mlxcel."""
