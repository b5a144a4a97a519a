"""Anthropic-compatible routes (the Messages API)."""
