"""How long the hardening suites run: short and reproducible in `make test`, longer by
scripts/hardening.py, which sets these variables."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def examples(default: int) -> int:
    """MLXCEL_FUZZ_SCALE multiplies every fuzz test's example count (1 in CI)."""
    return max(1, int(default * float(os.environ.get("MLXCEL_FUZZ_SCALE", "1"))))


def fuzz_settings(default_examples: int, deadline_ms: int) -> settings:
    """Derandomized unless MLXCEL_FUZZ_SEED asks for a fresh search: CI sees the same cases
    every run, a long run explores new ones. No example database, so nothing is written."""
    seeded = "MLXCEL_FUZZ_SEED" in os.environ
    return settings(max_examples=examples(default_examples), deadline=deadline_ms, derandomize=not seeded,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def soak_seconds(default: float) -> float:
    return float(os.environ.get("MLXCEL_SOAK_SECONDS", default))
