"""--lora, --lora-scaled and --lora-init-without-apply: adapter specs at parse time.

Parse time checks what needs no checkpoint (a path exists and is an adapter directory, a
scale is a finite number); once -m resolves, `runtime.load.load_for_checkpoint` reads the
adapters and compares every term with the base's linear shapes, so a misfit stops startup in
one line before any weight is read. b10621 keeps --lora and --lora-scaled in one list in
command-line order; here the --lora adapters come first, then the --lora-scaled ones.
"""

from __future__ import annotations

from typing import Any

from mlxcel.config.refusal import StartupRefusal
from mlxcel.models.lora import LoraError, check_path, parse_lora, parse_lora_scaled


def _checked_specs(values: list[str], spelling: str, parse) -> list:
    """Every adapter the option's values name, each path checked; a LoraError is a startup refusal."""
    try:
        specs = [s for v in values for s in parse(v, spelling)]
        for spec in specs:
            check_path(spec.path)
    except LoraError as e:
        raise StartupRefusal(str(e)) from None
    return specs


def apply_lora(settings: Any, values: list[str], spelling: str) -> None:
    # --lora's adapters ahead of --lora-scaled's
    settings.lora.adapters = [*_checked_specs(values, spelling, parse_lora), *settings.lora.adapters]


def apply_lora_scaled(settings: Any, values: list[str], spelling: str) -> None:
    settings.lora.adapters = [*settings.lora.adapters, *_checked_specs(values, spelling, parse_lora_scaled)]


def refuse_without_generation(settings: Any) -> None:
    """Adapters on a server that runs no generation model (--embeddings / --reranking) would
    be parsed and never used: refused instead."""
    if settings.lora.adapters:
        raise StartupRefusal("--lora / --lora-scaled: LoRA adapters apply to a generation model, and this server "
                             "runs none (--embeddings / --reranking)")

