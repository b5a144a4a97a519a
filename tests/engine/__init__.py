"""The fast engine tier: the real Engine over a deterministic fake backend (fake_backend.py),
no checkpoint and no model framework."""
