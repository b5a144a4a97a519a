"""Sampling parameters: every knob of b10621's sampler chain (defaults: config/sampling.py).

Owns the `SamplingParams` value (one per request, frozen), the seed fold into
b10621's uint32 seed space, the resolution of the request's `logit_bias` shapes
into a token-id map, and the sampler-order names. The chain itself lives in
`sampling.py`; API layers convert request fields into this value once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from mlxcel.config.limits import echo
from mlxcel.config.sampling import B10621_SAMPLING

UINT32_MAX = 0xFFFFFFFF
FLOAT32_MAX = 3.4028234663852886e38
INT32_MIN = -(2**31)
# b10621's LLAMA_DEFAULT_SEED: the "pick a random seed" sentinel.
RANDOM_SEED = UINT32_MAX

# Canonical stage names in b10621's default order, and the one-letter codes of --sampler-seq.
DEFAULT_SAMPLERS: tuple[str, ...] = B10621_SAMPLING.samplers
SAMPLER_CHARS: Mapping[str, str] = MappingProxyType({
    "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
    "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p",
})
SAMPLER_NAMES: frozenset[str] = frozenset(SAMPLER_CHARS.values())
# Alternative spellings upstream accepts where it allows alt names (the --samplers flag).
SAMPLER_ALT_NAMES: Mapping[str, str] = MappingProxyType({
    "top-k": "top_k", "top-p": "top_p", "top-n-sigma": "top_n_sigma", "nucleus": "top_p",
    "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p",
    "min-p": "min_p", "temp": "temperature", "adaptive-p": "adaptive_p",
})
# Stages this engine does not run: refused rather than silently dropped.
UNSUPPORTED_SAMPLERS: Mapping[str, str] = MappingProxyType({
    "infill": "the infill sampler is not supported",
})
DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = B10621_SAMPLING.dry_sequence_breakers
_D = B10621_SAMPLING  # the field defaults below


def fold_seed(seed: int | float | None) -> int | None:
    """Fold a request/flag seed into b10621's uint32 seed space.

    None, -1 and 4294967295 mean "random" and fold to None. Other negative values down
    to INT32_MIN wrap as two's complement (-2 -> 4294967294), as a C cast to uint32 does.
    Anything outside [INT32_MIN, UINT32_MAX] or not an integer is refused.
    """
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise ValueError("seed must be an integer, not a boolean")
    if isinstance(seed, float):
        if not seed.is_integer():
            raise ValueError(f"seed must be an integer, got {echo(seed)}")
        seed = int(seed)
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {type(seed).__name__}")
    if seed < INT32_MIN or seed > UINT32_MAX:
        raise ValueError(f"seed {seed} is outside [{INT32_MIN}, {UINT32_MAX}]")
    folded = seed & UINT32_MAX
    return None if folded == RANDOM_SEED else folded


def samplers_from_names(names: Sequence[str], *, allow_alt_names: bool = False) -> tuple[str, ...]:
    """Resolve a list of stage names (the JSON array form, or the ';'-split flag)."""
    out = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"sampler names must be strings, got {echo(name)}")
        canonical = name if name in SAMPLER_NAMES else (
            SAMPLER_ALT_NAMES.get(name) if allow_alt_names else None)
        if canonical is None:
            raise ValueError(f"unknown sampler name {echo(name)!r}")
        out.append(canonical)
    return _check_samplers(tuple(out))


def samplers_from_chars(chars: str) -> tuple[str, ...]:
    """Resolve the one-letter form (`--sampler-seq`, or the `samplers` field as a string)."""
    out = []
    for ch in chars:
        if ch not in SAMPLER_CHARS:
            raise ValueError(f"unknown sampler code {ch!r}")
        out.append(SAMPLER_CHARS[ch])
    return _check_samplers(tuple(out))


def _check_samplers(samplers: tuple[str, ...]) -> tuple[str, ...]:
    for name in samplers:
        if name not in SAMPLER_NAMES:
            raise ValueError(f"unknown sampler name {echo(name)!r}")
        if name in UNSUPPORTED_SAMPLERS:
            raise ValueError(UNSUPPORTED_SAMPLERS[name])
    return samplers


_STRTOL_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def _object_key_token(key: str) -> int | None:
    """Upstream parses an object key with strtol and takes it as an id when the whole key
    is consumed; that includes the empty key (id 0) and leading whitespace or a sign."""
    if key == "" or _STRTOL_INT.fullmatch(key):
        return int(key) if key.strip() else 0
    return None


def _bias_value(value: object) -> float | None:
    # false bans the token; true and non-numbers are skipped, as upstream does
    if isinstance(value, bool):
        return -math.inf if value is False else None
    if isinstance(value, (int, float)):
        bias = float(value)
        if math.isnan(bias):
            return None
        # upstream stores the bias as a C float
        return bias if abs(bias) <= FLOAT32_MAX else math.copysign(math.inf, bias)
    return None


def resolve_logit_bias(raw: object, tokenize: Callable[[str], Sequence[int]], *,
                       n_vocab: int) -> dict[int, float]:
    """Turn the request's `logit_bias` into {token id: summed bias}.

    Shapes (b10621): a list of [id_or_string, bias_or_false] pairs, or an object
    {"id_or_string": bias_or_false}. Strings are tokenized without special tokens and
    each resulting token gets the bias; `false` bans (-inf). Upstream skips, without an
    error, entries it cannot use (ids outside the vocabulary, `true`, malformed pairs);
    that is kept for drop-in compatibility. Repeated ids add up, as upstream applies
    each entry in turn.
    """
    entries: list[tuple[int, float]] = []

    def add_text(text: str, bias: float) -> None:
        entries.extend((int(tok), bias) for tok in tokenize(text))

    if isinstance(raw, list):
        for el in raw:
            if not (isinstance(el, (list, tuple)) and len(el) == 2):
                continue
            bias = _bias_value(el[1])
            if bias is None:
                continue
            key = el[0]
            if isinstance(key, int) and not isinstance(key, bool):
                if 0 <= key < n_vocab:
                    entries.append((key, bias))
            elif isinstance(key, str):
                add_text(key, bias)
    elif isinstance(raw, Mapping):
        for key, value in raw.items():
            bias = _bias_value(value)
            if bias is None or not isinstance(key, str):
                continue
            tok = _object_key_token(key)
            if tok is None:
                add_text(key, bias)
            elif 0 <= tok < n_vocab:
                entries.append((tok, bias))
    out: dict[int, float] = {}
    for tok, bias in entries:
        out[tok] = out.get(tok, 0.0) + bias
    return out


@dataclass(frozen=True)
class SamplingParams:
    """Every b10621 sampling knob for one request, named as the native request fields.

    `seed` is stored folded (None = random); `logit_bias` is already resolved to ids.
    Range clamps of the HTTP layer (native-fields.tsv) are applied before construction;
    this type only refuses values the chain cannot run with.
    """

    temperature: float = _D.temperature
    dynatemp_range: float = _D.dynatemp_range
    dynatemp_exponent: float = _D.dynatemp_exponent
    top_k: int = _D.top_k
    top_p: float = _D.top_p
    min_p: float = _D.min_p
    typical_p: float = _D.typical_p
    top_n_sigma: float = _D.top_n_sigma
    xtc_probability: float = _D.xtc_probability
    xtc_threshold: float = _D.xtc_threshold
    min_keep: int = _D.min_keep
    repeat_last_n: int = _D.repeat_last_n
    repeat_penalty: float = _D.repeat_penalty
    frequency_penalty: float = _D.frequency_penalty
    presence_penalty: float = _D.presence_penalty
    dry_multiplier: float = _D.dry_multiplier
    dry_base: float = _D.dry_base
    dry_allowed_length: int = _D.dry_allowed_length
    dry_penalty_last_n: int = _D.dry_penalty_last_n
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_SEQUENCE_BREAKERS
    mirostat: int = _D.mirostat
    mirostat_tau: float = _D.mirostat_tau
    mirostat_eta: float = _D.mirostat_eta
    adaptive_target: float = _D.adaptive_target
    adaptive_decay: float = _D.adaptive_decay
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    seed: int | None = None
    n_probs: int = 0
    post_sampling_probs: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", fold_seed(self.seed))
        object.__setattr__(self, "samplers", _check_samplers(tuple(self.samplers)))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {self.mirostat!r}")
        for name in ("n_probs", "min_keep", "dry_allowed_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("repeat_last_n", "dry_penalty_last_n"):
            if getattr(self, name) < -1:
                raise ValueError(f"{name} must be >= -1")
        for name, value in vars(self).items():
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{name} is NaN")
        if self.repeat_penalty <= 0.0:
            # dividing a logit by 0 (or flipping its sign) is no penalty upstream can mean
            raise ValueError("repeat_penalty must be > 0")
        bias = {}
        for tok, value in dict(self.logit_bias).items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            value = float(value)
            if math.isnan(value):
                raise ValueError(f"logit_bias for token {tok} is NaN")
            # past float32's range the biased logit is +inf and sampling has no answer; -inf bans
            if value > FLOAT32_MAX:
                raise ValueError(f"logit_bias for token {tok} is {value:g}, above the largest bias that can be "
                                 f"applied ({FLOAT32_MAX:.7g}); use false to ban a token")
            bias[tok] = value
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))

    @property
    def uses_adaptive_p(self) -> bool:
        """Upstream appends adaptive-p as the final selector when the order names it."""
        return "adaptive_p" in self.samplers

    @property
    def dry_enabled(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0
