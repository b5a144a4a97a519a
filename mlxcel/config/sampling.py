"""b10621's sampler defaults: what a request gets for a knob that neither it, a flag, nor the
checkpoint's generation_config.json sets.

Declared once here; the engine's `SamplingParams` takes its field defaults from this value, the
composition root falls back to it under the checkpoint's own values, and the option table
prints it in `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    min_keep: int = 0
    repeat_last_n: int = 64          # -1: the whole history
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64     # -1: the model's training context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    # the chain's stage order
    samplers: tuple[str, ...] = (
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
    )


B10621_SAMPLING = SamplingDefaults()
