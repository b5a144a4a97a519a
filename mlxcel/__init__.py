"""mlxcel: an MLX-native LLM inference server, drop-in for llama-server and the OpenAI API."""

__version__ = "0.1.0"
