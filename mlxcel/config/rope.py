"""The RoPE override flags as given (--rope-scaling, --rope-scale / --rope-freq-scale,
--rope-freq-base, --yarn-*); models/rope_overrides.py turns them into a family's config."""

from __future__ import annotations

from dataclasses import dataclass

SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeOverrides:
    """The flags as given; 0 and negative values are b10621's "from the model" sentinels."""

    scaling: str | None = None      # --rope-scaling none|linear|yarn (None: the checkpoint's)
    freq_base: float = 0.0          # --rope-freq-base (0: the checkpoint's rope_theta)
    freq_scale: float = 0.0         # --rope-freq-scale, or 1/N from --rope-scale (0: the checkpoint's)
    yarn_orig_ctx: int = 0          # 0: the checkpoint's original context
    yarn_ext_factor: float = -1.0   # < 0: the model's (1.0 for a YaRN rotation)
    yarn_attn_factor: float = -1.0  # < 0: the model's (1.0)
    yarn_beta_slow: float = -1.0    # < 0: the checkpoint's, else 1
    yarn_beta_fast: float = -1.0    # < 0: the checkpoint's, else 32

    @property
    def yarn_knobs(self) -> list[str]:
        knobs = [("--yarn-orig-ctx", self.yarn_orig_ctx > 0), ("--yarn-ext-factor", self.yarn_ext_factor >= 0),
                 ("--yarn-attn-factor", self.yarn_attn_factor >= 0), ("--yarn-beta-slow", self.yarn_beta_slow >= 0),
                 ("--yarn-beta-fast", self.yarn_beta_fast >= 0)]
        return [name for name, given in knobs if given]

    @property
    def requested(self) -> bool:
        return bool(self.scaling or self.freq_base > 0 or self.freq_scale > 0 or self.yarn_knobs)

    @property
    def moves_rotation(self) -> bool:
        """Anything beyond --yarn-* knobs, which only tune a YaRN rotation already in force."""
        return bool(self.scaling or self.freq_base > 0 or self.freq_scale > 0)
