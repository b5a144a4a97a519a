"""Command lines: `mlxcel-server` (llama-server compatible) and `mlxcel` (subcommands)."""
