"""The composition root: settings + checkpoint path -> backend, tokenizer, engine.

Shared by the server and the `mlxcel generate` / `mlxcel chat` commands, so every entry
point serves a model the same way. What the CLI settled before the load (the backend's
reason, the checked LoRA adapters, the speculative config) comes in as a `Startup`; the
backends are imported only once chosen, so the MLX path never loads torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mlxcel.backends import select
from mlxcel.backends.group import GroupBackend
from mlxcel.chat import builtin_templates
from mlxcel.config.progress import Progress
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.rope import RopeOverrides
from mlxcel.config.sampling import B10621_SAMPLING
from mlxcel.config.settings import ServerSettings
from mlxcel.engine.backend import ForwardRow, KVCacheTypeRefused, KVCacheTypes
from mlxcel.engine.engine import Engine
from mlxcel.engine.kv_manager import BLOCK_SIZE
from mlxcel.engine.grammar import GrammarError, for_tokenizer
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.speculative import DRAFT, ModelDrafter, NgramDrafter, SpecConfig, Speculator
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.models.lora import LoraError, LoraSet, checkpoint_shapes, load_adapter, validate
from mlxcel.models.registry import mlx_only
from mlxcel.models.vision import BudgetRefused, ImageBudget, VisionInput, is_vision, is_vision_checkpoint
from mlxcel.models.vision_mlx import serves_on_mlx
from mlxcel.runtime.memory import release_memory as default_release
from mlxcel.runtime.served import ServedModel, Startup
from mlxcel.steering.manager import SteeringManager

log = logging.getLogger("mlxcel.runtime")


def resolve_sampling_defaults(settings: ServerSettings, gen_defaults, n_vocab: int | None = None) -> SamplingParams:
    """Flag > checkpoint generation_config.json > b10621 default for the four knobs a checkpoint
    declares; every other sampler flag (`settings.sampling.overrides`, `-l`) over b10621's default."""
    def pick(flag, ckpt, default):
        return flag if flag is not None else (ckpt if ckpt is not None else default)

    b = B10621_SAMPLING
    bias: dict[int, float] = {}
    for tok, value in settings.sampling.logit_bias:
        if n_vocab is not None and not 0 <= tok < n_vocab:
            raise StartupRefusal(f"--logit-bias {tok}: token id outside the model's vocabulary (0..{n_vocab - 1})")
        bias[tok] = bias.get(tok, 0.0) + value
    return SamplingParams(
        temperature=pick(settings.sampling.temperature, gen_defaults.temperature, b.temperature),
        top_k=pick(settings.sampling.top_k, gen_defaults.top_k, b.top_k),
        top_p=pick(settings.sampling.top_p, gen_defaults.top_p, b.top_p),
        min_p=pick(settings.sampling.min_p, gen_defaults.min_p, b.min_p),
        seed=settings.sampling.seed if settings.sampling.seed >= 0 else None,
        logit_bias=bias,
        **settings.sampling.overrides,
    )


def cache_budget_bytes(settings: ServerSettings) -> int | None:
    """--prompt-cache-capacity-bytes, else --cache-ram in MiB: -1 no limit (None), 0 no prefix
    cache (the default is declared in config/settings.py KvSection)."""
    if settings.kv.prompt_cache_capacity_bytes is not None:
        b = settings.kv.prompt_cache_capacity_bytes
        return None if b < 0 else b
    mib = settings.kv.cache_ram_mib
    return None if mib < 0 else mib << 20


def select_backend(settings: ServerSettings, path: Path | None = None,
                   placed: select.Choice | None = None) -> select.Choice:
    """Resolve --backend/--device for the checkpoint at `path`; refuses what cannot be honoured.
    `placed`: the choice settled for the -m model at startup (runtime `Startup.placement`), which
    a later load asks for as given instead of resolving `auto` again."""
    config = json.loads((path / "config.json").read_text()) if path is not None else {}
    backend, device = (placed.backend, placed.device) if placed is not None else \
        (settings.backend.name, settings.backend.device)
    try:
        choice = select.choose(backend, device, quantized=select.quantization_mode(config),
                               vision=is_vision(config), vision_mlx=serves_on_mlx(config), mlx_only=mlx_only(config))
    except select.BackendRefused as e:
        raise StartupRefusal(str(e)) from None
    if choice.backend == "mlx" and choice.device != "cpu" and settings.backend.threads > 0:
        raise StartupRefusal(f"--threads {settings.backend.threads}: on Metal the GPU runs MLX's products, there is no "
                             f"CPU thread count to set (drop it, or pass --device cpu or --backend torch)")
    if choice.backend == "mlx" and settings.backend.torch_compile:
        raise StartupRefusal("--torch-compile applies to the torch backend, whose forward it compiles "
                             "(drop it, or pass --backend torch)")
    return choice


def load_backend(settings: ServerSettings, path: Path, placed: select.Choice | None = None):
    choice = select_backend(settings, path, placed)
    try:
        return _load_backend(settings, path, choice)
    except KVCacheTypeRefused as e:
        raise StartupRefusal(str(e)) from None


def _load_backend(settings: ServerSettings, path: Path, choice: select.Choice):
    kv_cache = KVCacheTypes(settings.kv.cache_type_k, settings.kv.cache_type_v)
    if choice.backend == "torch":
        if is_vision_checkpoint(path):
            from mlxcel.backends.torch.vlm import TorchVLMBackend as backend_class
        else:
            from mlxcel.backends.torch.backend import TorchBackend as backend_class
        b = settings.backend
        backend = backend_class(path, dtype=b.dtype, device=choice.device, threads=b.threads, rope=b.rope,
                                compile=b.torch_compile, build_env=b.build_env, kv_cache=kv_cache)
        if backend.device.type == "cpu" and backend.info.dtype in ("bfloat16", "float32"):
            log.info("torch on the CPU: decoding computes its %s matrix products with %s, prompts with %s; "
                     "fused operations: %s", backend.info.dtype, backend.row_kernel, backend.prompt_linears,
                     backend.fused_ops)
        return backend, choice
    import mlx.core as mx

    if is_vision_checkpoint(path):
        from mlxcel.backends.mlx.vlm import MLXVLMBackend as mlx_class
    else:
        from mlxcel.backends.mlx.backend import MLXBackend as mlx_class

    if choice.device == "cpu":
        mx.set_default_device(mx.cpu)
    b = settings.backend
    backend = mlx_class(path, dtype=b.dtype, rope=b.rope, threads=b.threads, kv_cache=kv_cache)
    if backend.split_modules:
        log.info("MLX on the CPU: %d large matrix products each split over %d threads (--threads)",
                 backend.split_modules, backend.threads)
    return backend, choice


def load_served_model(settings: ServerSettings, path: Path, served_id: str | None = None,
                      startup: Startup | None = None,
                      release_memory: Callable[[], None] = default_release) -> ServedModel:
    """Load `path` and start its engine. `served_id`: the name it answers to (default: the
    --alias, else -m as given); a model loaded by a switch answers to the name requested.
    `startup`: what the CLI settled before the load (without it, the adapters are read here).
    `release_memory`: the clean-up the engine runs when --sleep-idle-seconds drops the backend
    (the model host passes its own)."""
    startup = startup or Startup()
    lora = None
    if served_id is None and settings.lora.adapters:  # the adapters belong to the -m model, not to a switch target
        lora = startup.lora if startup.lora is not None else load_for_checkpoint(settings, path)

    def backend_with_adapters():
        if settings.distributed.active:  # adapters, switches and sleep are refused for a group (cli/distributed.py)
            return load_group(settings, path, startup)
        backend, choice = load_backend(settings, path, startup.placement)
        if lora is not None:
            backend.attach_lora(lora.adapters)
        return backend, choice

    bar = Progress(f"loading {path.name}", total=3 + int(settings.engine.warmup), unit="step")
    with bar:
        bar.stage("weights")
        backend, choice = backend_with_adapters()
        bar.update()
        bar.stage("tokenizer")
        tokenizer = Tokenizer(path)
        bar.update()
        bar.stage("engine")
        vision, engine = build_engine(settings, path, backend, tokenizer, lambda: backend_with_adapters()[0],
                                      release_memory)
        engine.lora = lora
        if served_id is None and startup.speculative is not None:  # the draft was chosen for the -m model only
            engine.speculator = load_speculator(settings, startup.speculative, engine, tokenizer, choice)
        bar.update()
        if settings.engine.warmup:
            bar.stage("warm-up step")
            warm_up(engine)
            bar.update()
    engine.start()
    served = ServedModel(
        id=served_id or model_id(settings),
        aliases=[] if served_id else list(settings.source.alias),
        tags=[] if served_id else list(settings.source.tags),  # like the aliases, they name the -m model
        info=backend.info,
        tokenizer=tokenizer,
        engine=engine,
        defaults=resolve_sampling_defaults(settings, tokenizer.generation_defaults, backend.info.vocab_size),
        ignore_eos=settings.sampling.ignore_eos,
        n_ctx=engine.n_ctx_slot,
        n_predict=settings.engine.n_predict,
        backend_reason=startup.backend_reason or choice.reason,
        steering=SteeringManager(int(backend.info.config.get("hidden_size") or 0), backend.info.num_layers,
                                 settings.steering.cluster_intensity_min, settings.steering.circuit_intensity_min,
                                 unavailable=GROUP_NO_SAE if isinstance(backend, GroupBackend) else None),
        grammars=for_tokenizer(tokenizer, backend.info.vocab_size),
        lora=lora,
        group=backend if isinstance(backend, GroupBackend) else None,
    )
    served.vision = vision
    load_default_grammar(settings, served)
    return served


GROUP_NO_SAE = ("SAEs do not attach to a model served across a distributed group (--tp-size / --pp-size): "
                "steering and activation capture need the whole residual stream on one process; serve it on one")


def load_group(settings: ServerSettings, path: Path, startup: Startup):
    """Rank 0 of a distributed group: its shard behind the GroupBackend (runtime/group.py)."""
    from mlxcel.runtime.group import load_group_backend

    choice = select_backend(settings, path, startup.placement)
    on_failure = startup.on_group_failure or (lambda reason: None)
    return load_group_backend(settings, path, choice, on_failure), choice


def build_engine(settings: ServerSettings, path: Path, backend, tokenizer: Tokenizer,
                 reload: Callable[[], object], release_memory: Callable[[], None]) -> tuple[VisionInput | None, Engine]:
    """The checkpoint's image side and its engine, not started yet."""
    template = settings.chat.template or settings.chat.template_file
    if template:  # --chat-template(-file) replaces the checkpoint's own template everywhere
        tokenizer.chat_template = builtin_templates.with_bos(template, tokenizer.adds_bos)
    vision = load_vision(settings, path, backend, tokenizer)  # before the engine starts: it may refuse
    n_ctx = settings.engine.ctx_size if settings.engine.ctx_size > 0 else backend.info.context_length
    e = settings.engine
    engine = Engine(backend, tokenizer, n_ctx=n_ctx, parallel=e.parallel, kv_unified=e.kv_unified,
                    batch_size=e.batch_size,
                    cache_prompt=settings.kv.cache_prompt, cache_budget_bytes=cache_budget_bytes(settings),
                    cont_batching=e.cont_batching, max_queue_depth=e.max_queue_depth,
                    context_shift=e.context_shift, keep=e.keep, special=e.special, swa_full=settings.kv.swa_full,
                    sleep_idle_seconds=e.sleep_idle_seconds, reload=reload, release_memory=release_memory)
    return vision, engine


def warm_up(engine: Engine) -> None:
    """One forward off the request path: first-call costs (kernel selection, allocation) land here."""
    seq = engine.kv.new_sequence()
    engine.backend.forward([ForwardRow([0], seq)])
    engine.kv.release(seq, donate=False)


def load_speculator(settings: ServerSettings, config: SpecConfig, engine: Engine, tokenizer: Tokenizer,
                    target: select.Choice) -> Speculator:
    """The engine's Speculator for `config`: an n-gram drafter, or the draft checkpoint loaded on
    the target's backend and device, `target` (the CLI checked its vocabulary and backend before
    the load started)."""
    if engine.kv.recurrent:  # verification trims rejected draft tokens off the row's KV
        raise StartupRefusal(f"speculative decoding: {engine.backend.info.model_type} has recurrent layers, whose "
                             "state cannot be rewound past a rejected draft token; serve it without --spec-type / -md")
    if config.kind != DRAFT:
        return Speculator(config, NgramDrafter(config))
    path = config.draft_model
    # the draft runs as its checkpoint says: --rope-* overrides and LoRA adapters are the target's
    as_given = replace(settings, backend=replace(settings.backend, rope=RopeOverrides()))
    draft, choice = load_backend(as_given, path, target)
    if choice.backend != target.backend:
        raise RuntimeError(f"the draft model {path.name} would run on {choice.backend}, the target on {target.backend}")
    drafter = ModelDrafter(draft, config, n_ctx_slot=engine.n_ctx_slot, parallel=engine.parallel,
                           batch_size=engine.batch_size, block_size=BLOCK_SIZE,
                           target_vocab=engine.backend.info.vocab_size)
    log.info("speculative decoding: draft-simple with %s (n_max %d)", path.name, config.n_max)
    return Speculator(config, drafter)


def load_vision(settings: ServerSettings, path: Path, backend, tokenizer: Tokenizer | None) -> VisionInput | None:
    """A vision-language checkpoint's image side (models/vision.py), with the image-token budget
    applied; None for a text-only checkpoint. A budget it cannot honour refuses the load."""
    budget = ImageBudget(settings.media.image_min_tokens, settings.media.image_max_tokens)
    # a family the MLX backend does not run as a vision-language model takes no images there
    if not is_vision_checkpoint(path) or (backend.info.backend == "mlx" and not serves_on_mlx(backend.info.config)):
        if budget.requested:  # no processor took the budget: the same refusal as a fixed-geometry one
            flag = "--image-min-tokens" if settings.media.image_min_tokens else "--image-max-tokens"
            raise StartupRefusal(f"{path.name} takes no images, so {flag} has nothing to bound; drop {flag} or "
                                 f"serve a vision-language checkpoint")
        return None
    tensors = "pt"
    if backend.info.backend == "mlx":
        from mlxcel.backends.mlx.vlm import media_for as mlx_media

        media_for, tensors = mlx_media(backend.image_token_id), "np"
    else:
        from mlxcel.backends.torch.vlm import media_for
    try:
        return VisionInput(path, backend.info.config, tokenizer.hf, budget, media=media_for, tensors=tensors)
    except BudgetRefused as e:
        raise StartupRefusal(str(e)) from None


def load_default_grammar(settings: ServerSettings, served: ServedModel) -> None:
    """Compile the --grammar / --json-schema default against the model's vocabulary. A
    schema was already checked at startup; a GBNF grammar that does not parse is logged
    and then refuses each request that would use it, as b10621 does."""
    if settings.sampling.grammar is None:
        return
    kind, text = settings.sampling.grammar
    try:
        served.default_grammar = served.grammars.compile(kind, text)
    except GrammarError as e:
        if kind != "gbnf":
            raise
        served.default_grammar_error = str(e)
        log.error("failed to parse the --grammar default: %s", e)


def model_id(settings: ServerSettings) -> str:
    return settings.source.alias[0] if settings.source.alias else str(settings.source.model)


def load_for_checkpoint(settings: ServerSettings, path: Path) -> LoraSet | None:
    """The --lora / --lora-scaled adapters, read and checked against the checkpoint at `path`
    (every term against the base's linear shapes from the safetensors headers, so a misfit
    refuses in one line before any weight is read), at their starting scales (0.0 each under
    --lora-init-without-apply); None without adapters."""
    if not settings.lora.adapters:
        return None
    config = json.loads((Path(path) / "config.json").read_text())
    shapes = checkpoint_shapes(path, config)
    adapters = []
    try:
        for spec in settings.lora.adapters:
            adapter = load_adapter(spec.path)
            validate(adapter, shapes)
            adapters.append(adapter)
    except LoraError as e:
        raise StartupRefusal(str(e)) from None
    scales = [0.0 if settings.lora.init_without_apply else s.scale for s in settings.lora.adapters]
    return LoraSet(adapters, scales)
