"""The resolved server configuration: built once from argv and the environment.

This is the one place configuration lands; nothing below the CLI reads `os.environ`.
`ServerSettings` is a composition of small sections, one per concern, each declaring its own
defaults; the b10621 flag surface (cli/options_*.py) addresses a field by its section path
("server.port"). What is resolved at startup (the backend/device `auto` settles on, the checked
adapters, the speculative config) is not written back here: the runtime carries it
(runtime/served.py `Startup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.config.distributed import GroupSpec
from mlxcel.config.rope import RopeOverrides

# slots: writing a name a section does not declare fails instead of adding a stray attribute
_section = dataclass(slots=True)


@_section
class SourceSection:
    """Where the model comes from and what it answers to."""

    model: str | None = None
    hf_repo: str | None = None  # --hf-repo as given; when set it is also `model`
    model_store_root: Path | None = None
    default_org: str = "mlx-community"
    offline: bool = False
    hf_token: str | None = None
    alias: list[str] = field(default_factory=list)
    any_model_name: bool = False  # --any-model-name: every requested name is served by the loaded model
    tags: list[str] = field(default_factory=list)  # --tags: informational, reported on /v1/models


@_section
class ServerSection:
    """The HTTP listener, its security, and which routes it serves."""

    host: str = "127.0.0.1"
    port: int = 8080
    unix_socket: str | None = None  # set when --host ends with .sock
    reuse_port: bool = False  # bind the TCP listener with SO_REUSEPORT
    api_keys: list[str] = field(default_factory=list)
    timeout: int = 3600  # HTTP socket read/write timeout, seconds
    shutdown_timeout: float = 30.0  # --shutdown-timeout: how long SIGTERM lets running requests finish
    sse_ping_interval: int = 30  # seconds; -1 disables
    ssl_key_file: Path | None = None
    ssl_cert_file: Path | None = None
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    api_prefix: str = ""  # every route is served under it (the ASGI gate strips it)
    webui: bool = True  # the chat page at / (api/webui)
    static_path: str = ""  # --path: a directory served at / instead of the built-in page
    metrics: bool = False
    props: bool = False
    slots: bool = True
    # native llama-server routes (b10621 --spm-infill, --slot-save-path)
    spm_infill: bool = False
    slot_save_path: Path | None = None
    # Vertex AI custom-container mode (AIP_MODE=PREDICTION)
    vertex_predict_route: str | None = None
    vertex_health_route: str | None = None


@_section
class EngineSection:
    """The scheduler's shape, and the model host's switch / idle behaviour."""

    ctx_size: int = 0  # 0 = the model's own context length
    n_predict: int = -1  # -1 = until the context is full
    parallel: int = 4
    kv_unified: bool = False  # --kv-unified: every slot may fill the whole context (else ctx_size / parallel)
    batch_size: int = 512
    ubatch_size: int | None = None  # accepted and reported only (no micro-batch on MLX)
    max_queue_depth: int = 64  # waiting requests beyond the free slots; -1 unbounded
    cont_batching: bool = True
    context_shift: bool = False
    keep: int = 0  # default n_keep for a context shift
    special: bool = False  # --special: generated special tokens are output as their text
    warmup: bool = True
    sleep_idle_seconds: int = -1  # --sleep-idle-seconds: unload the model after this idle time (< 0: never)
    # model switching (a /v1 request naming another store model): how long an unload waits for
    # running requests, and the weight budget a switch is checked against (None: free memory)
    graceful_unload_timeout: float = 30.0
    model_memory_budget_mib: int | None = None
    # memory planning (runtime/estimate.py): print the estimate and exit; refuse at startup what
    # cannot fit (--fit on, b10621's default); check every tensor before loading (--check-tensors)
    estimate_memory: bool = False
    fit: bool = True
    check_tensors: bool = False


@_section
class KvSection:
    """The KV cache and the prompt (prefix) cache."""

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_prompt: bool = True
    swa_full: bool = False  # --swa-full: keep the blocks behind a sliding window (engine/kv_manager.py)
    cache_ram_mib: int = 2048  # --cache-ram: mlxcel's default (b10621's is 8192); -1 no limit, 0 disable
    prompt_cache_capacity_bytes: int | None = None  # wins over cache_ram_mib when both are given


@_section
class BackendSection:
    """What was asked for: the backend and device as requested (`auto` included; the resolved
    choice lives in runtime `Startup`), and how the weights are loaded and run."""

    name: str = "auto"  # --backend: auto | mlx | torch
    device: str = "auto"  # auto | cpu | cuda[:N] | mps | metal
    dtype: str = "auto"
    wired_limit_bytes: int | None = None  # MLXCEL_WIRED_LIMIT: MLX's wired memory limit on Metal (read by the CLI)
    threads: int = -1  # torch CPU threads / MLX CPU threads per large product; <= 0 keeps the default
    torch_compile: bool = False  # --torch-compile: the torch backend's forward through torch.compile
    gpu_layers: str | None = None  # integer values are checked once the checkpoint is known
    rope: RopeOverrides = field(default_factory=RopeOverrides)  # --rope-* / --yarn-* (config/rope.py)
    # what building native pieces reads (compiler, PATH, cache folder: mlxcel/native_build.py);
    # None builds nothing (the torch backend's decode rows then keep torch's kernels)
    build_env: dict[str, str] | None = None


@_section
class SamplingSection:
    """Server-wide sampling defaults. The four a checkpoint may declare are None until a flag sets
    them (then generation_config.json, then config/sampling.py's b10621 value applies)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = -1
    # every other b10621 sampler default given on the command line: SamplingParams field -> value
    overrides: dict = field(default_factory=dict)
    dry_sequence_breakers_raw: list[str] | None = None  # --dry-sequence-breaker, escapes unprocessed
    escape: bool = True  # -e / --no-escape: process escapes in the breakers
    ignore_eos: bool = False  # --ignore-eos: every end-of-generation token banned by default
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # -l TOKEN_ID(+/-)BIAS
    # --grammar / --grammar-file ("gbnf", text) or --json-schema / --json-schema-file
    # ("json_schema", text): the native routes' default constraint
    grammar: tuple[str, str] | None = None


@_section
class LoraSection:
    # --lora / --lora-scaled as parsed (models/lora.AdapterSpec: path and scale), in id order;
    # parsed configuration, not loaded weights (those are checked and read into runtime `Startup`)
    adapters: list = field(default_factory=list)
    init_without_apply: bool = False  # every adapter starts at scale 0.0


@_section
class SpecSection:
    """Speculative decoding as given (cli/options_spec.py builds the engine's SpecConfig)."""

    type: str | None = None  # none | draft-simple | ngram-simple; None: not given (-md alone selects draft)
    draft_model: str | None = None  # -md as given
    draft_hf: str | None = None  # --spec-draft-hf as given (wins over -md)
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    ngram_simple_size_n: int = 12
    ngram_simple_size_m: int = 48
    ngram_simple_min_hits: int = 1  # checked only: ngram-simple never reads it (as in b10621)
    draft_cache_type_k: str = "f16"
    draft_cache_type_v: str = "f16"


@_section
class SteeringSection:
    state_dir: Path | None = None  # SQLite steering state (profiles, clusters); None: <store root>/.mlxcel-state
    cluster_intensity_min: float = 0.5  # CLUSTER_INTENSITY_MIN: a cluster's undeclared dial floor
    circuit_intensity_min: float = 0.0  # CIRCUIT_INTENSITY_MIN: a circuit's dial floor
    sae_dir: Path | None = None  # MLXCEL_SAE_DIR: where /api/saes may read SAEs, besides the model store


@_section
class RouterSection:
    """Router mode (mlxcel/router): --models-dir / --models-preset with no model argument."""

    models_dir: Path | None = None
    models_preset: Path | None = None
    models_max: int = 4  # loaded models at once, LRU eviction past it; 0 = unlimited
    models_autoload: bool = True  # a request naming an unloaded model loads it (?autoload= per request)


@_section
class WorkersSection:
    """Side workers: --embeddings / --reranking select a dedicated encoder worker and turn
    generation off; --embedding-model / --reranker-model name the side checkpoints."""

    embedding: bool = False
    reranking: bool = False
    embedding_model: str | None = None
    reranker_model: str | None = None
    pooling: str | None = None  # --pooling mean|cls|last (None = env, then the checkpoint)
    pooling_env: str | None = None  # MLXCEL_EMBEDDING_POOLING, read by the CLI layer
    embd_normalize: int | None = None  # None = the checkpoint's own normalize flag


@_section
class LoggingSection:
    verbose: bool = False
    disable: bool = False  # --log-disable
    file: Path | None = None  # --log-file
    colors: str = "auto"  # on | off | auto
    prefix: bool = True
    timestamps: bool = True
    verbosity: int = 3  # b10621 threshold: 0 generic, 1 error, 2 warn, 3 info, 4 trace, 5 debug
    secrets: list[str] = field(default_factory=list)  # values the log redaction pass hides


@_section
class ChatSection:
    """The chat surface: template, tool-call / reasoning parsing, template kwargs."""

    template: str | None = None  # --chat-template: Jinja text replacing the checkpoint's template
    template_file: str | None = None  # --chat-template-file's text (the inline template wins)
    template_kwargs: dict = field(default_factory=dict)  # server-wide template context extras
    jinja: bool = True  # --no-jinja: tools refused, no reasoning / tool-call parsing of the output
    skip_parsing: bool = False  # --skip-chat-parsing
    prefill_assistant: bool = True
    reasoning_format: str = "auto"  # none | deepseek | deepseek-legacy | auto
    reasoning_alias_field: str = "reasoning"  # none | reasoning: reasoning_content also reported as `reasoning`
    reasoning_budget: int = -1  # thinking tokens before the close is forced (-1: unlimited, 0: at once)
    reasoning_budget_message: str = ""  # forced just before the close tag when the budget runs out


@_section
class MediaSection:
    """Images and media URLs: api/media.py, models/vision.py."""

    mmproj: bool = True  # --no-mmproj refuses every media part
    image_min_tokens: int | None = None  # --image-min-tokens (None: the checkpoint's own)
    image_max_tokens: int | None = None
    media_path: Path | None = None  # --media-path: the root of file:// media URLs (None: refused)
    allow_private_media_urls: bool = False  # MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1, read by the CLI layer


@_section
class ServerSettings:
    source: SourceSection = field(default_factory=SourceSection)
    server: ServerSection = field(default_factory=ServerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    kv: KvSection = field(default_factory=KvSection)
    backend: BackendSection = field(default_factory=BackendSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    lora: LoraSection = field(default_factory=LoraSection)
    spec: SpecSection = field(default_factory=SpecSection)
    steering: SteeringSection = field(default_factory=SteeringSection)
    router: RouterSection = field(default_factory=RouterSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    chat: ChatSection = field(default_factory=ChatSection)
    media: MediaSection = field(default_factory=MediaSection)
    distributed: GroupSpec = field(default_factory=GroupSpec)  # --tp-size / --pp-size (config/distributed.py)
    # parse bookkeeping, not configuration: warnings decided while parsing (logged once logging
    # is up), and the option keys given on the command line or environment (presets yield to them)
    notices: list[str] = field(default_factory=list)
    cli_given: frozenset = frozenset()
