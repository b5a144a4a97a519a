"""The composition root: settings + checkpoint path -> backend, tokenizer, engine.

Shared by the server and the `mlxcel generate` / `mlxcel chat` commands, so every entry
point serves a model the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlxcel.api.state import ServedModel
from mlxcel.cli.settings import ServerSettings
from mlxcel.engine.sampling_params import SamplingParams

log = logging.getLogger("mlxcel.runtime")

DEFAULT_CACHE_RAM_MIB = 2048  # mlxcel's --cache-ram default (b10621's is 8192)

# b10621's sampling defaults, used when neither a flag nor generation_config.json says.
B10621_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def resolve_sampling_defaults(settings: ServerSettings, gen_defaults) -> SamplingParams:
    """Flag > checkpoint generation_config.json > b10621 default."""
    def pick(flag, ckpt, default):
        return flag if flag is not None else (ckpt if ckpt is not None else default)

    b = B10621_SAMPLING
    return SamplingParams(
        temperature=pick(settings.temperature, gen_defaults.temperature, b.temperature),
        top_k=pick(settings.top_k, gen_defaults.top_k, b.top_k),
        top_p=pick(settings.top_p, gen_defaults.top_p, b.top_p),
        min_p=pick(settings.min_p, gen_defaults.min_p, b.min_p),
        seed=settings.seed if settings.seed >= 0 else None,
    )


def cache_budget_bytes(settings: ServerSettings) -> int | None:
    """--prompt-cache-capacity-bytes, else --cache-ram in MiB: -1 no limit (None), 0 no prefix
    cache, unset: mlxcel's 2048 MiB."""
    if settings.prompt_cache_capacity_bytes is not None:
        b = settings.prompt_cache_capacity_bytes
        return None if b < 0 else b
    mib = settings.cache_ram_mib
    if mib is None:
        return DEFAULT_CACHE_RAM_MIB << 20
    return None if mib < 0 else mib << 20


def select_backend(settings: ServerSettings, path: Path | None = None):
    """Resolve --backend/--device for the checkpoint at `path`; refuses what cannot be honoured."""
    import json

    from mlxcel.backends.select import BackendRefused, choose
    from mlxcel.cli.refusal import StartupRefusal

    config = json.loads((path / "config.json").read_text()) if path is not None else {}
    try:
        choice = choose(settings.backend, settings.device, mlx_quantized=bool(config.get("quantization")))
    except BackendRefused as e:
        raise StartupRefusal(str(e)) from None
    if choice.backend == "mlx" and settings.threads > 0:
        raise StartupRefusal(f"--threads {settings.threads}: the thread count applies to the torch backend; MLX has "
                             f"no CPU thread setting (drop it, or pass --backend torch)")
    return choice


def load_backend(settings: ServerSettings, path: Path):
    choice = select_backend(settings, path)
    if choice.backend == "torch":
        from mlxcel.backends.torch.backend import TorchBackend

        return TorchBackend(path, dtype=settings.dtype, device=choice.device, threads=settings.threads), choice
    import mlx.core as mx

    from mlxcel.backends.mlx.backend import MLXBackend

    if choice.device == "cpu":
        mx.set_default_device(mx.cpu)
    return MLXBackend(path, dtype=settings.dtype), choice


def load_served_model(settings: ServerSettings, path: Path) -> ServedModel:
    from mlxcel.backends.base import ForwardRow
    from mlxcel.engine.engine import Engine
    from mlxcel.engine.grammar import for_tokenizer
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.steering.manager import SteeringManager

    backend, choice = load_backend(settings, path)
    tokenizer = Tokenizer(path)
    template = settings.chat_template or settings.chat_template_file
    if template:  # --chat-template(-file) replaces the checkpoint's own template everywhere
        tokenizer.chat_template = template
    n_ctx = settings.ctx_size if settings.ctx_size > 0 else backend.info.context_length
    engine = Engine(backend, tokenizer, n_ctx=n_ctx, parallel=settings.parallel, batch_size=settings.batch_size,
                    cache_prompt=settings.cache_prompt, cache_budget_bytes=cache_budget_bytes(settings),
                    cont_batching=settings.cont_batching, max_queue_depth=settings.max_queue_depth,
                    context_shift=settings.context_shift, keep=settings.keep)
    if settings.warmup:
        seq = backend.new_sequence()
        backend.forward([ForwardRow([0], seq)])  # first-call costs off the request path
        seq.release()
    engine.start()
    served = ServedModel(
        id=model_id(settings),
        aliases=list(settings.alias),
        info=backend.info,
        tokenizer=tokenizer,
        engine=engine,
        defaults=resolve_sampling_defaults(settings, tokenizer.generation_defaults),
        n_ctx=engine.n_ctx_slot,
        n_predict=settings.n_predict,
        backend_reason=settings.backend_reason or choice.reason,
        steering=SteeringManager(int(backend.info.config.get("hidden_size") or 0), backend.info.num_layers,
                                 settings.cluster_intensity_min, settings.circuit_intensity_min),
        grammars=for_tokenizer(tokenizer, backend.info.vocab_size),
    )
    load_default_grammar(settings, served)
    return served


def load_default_grammar(settings: ServerSettings, served: ServedModel) -> None:
    """Compile the --grammar / --json-schema default against the model's vocabulary. A
    schema was already checked at startup; a GBNF grammar that does not parse is logged
    and then refuses each request that would use it, as b10621 does."""
    from mlxcel.engine.grammar import GrammarError

    if settings.default_grammar is None:
        return
    kind, text = settings.default_grammar
    try:
        served.default_grammar = served.grammars.compile(kind, text)
    except GrammarError as e:
        if kind != "gbnf":
            raise
        served.default_grammar_error = str(e)
        log.error("failed to parse the --grammar default: %s", e)


def model_id(settings: ServerSettings) -> str:
    return settings.alias[0] if settings.alias else str(settings.model)
