"""The engine: backend-agnostic scheduling, sampling, stopping and detokenizing."""
