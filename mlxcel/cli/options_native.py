"""mlxcel's own server options (no b10621 entry), the last section of the option table."""

from __future__ import annotations

from mlxcel.cli import options_apply as a
from mlxcel.cli.options_model import FLAG, SUPPORTED, VALUE, Option, make

NATIVE = "mlxcel"

NATIVE_OPTIONS: tuple[Option, ...] = (
    make("--model-store-root", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="DIR",
         apply=a.setter("source.model_store_root", "path"), path_value=True,
         help="the local model store (default: $MLXCEL_MODELS_DIR, else ~/.cache/mlxcel/models)"),
    make("--state-dir", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="DIR",
         apply=a.setter("steering.state_dir", "path"), path_value=True,
         help="server state (steering profiles and clusters, SQLite; default: <model store root>/.mlxcel-state)"),
    make("--dtype", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{auto,float16,bfloat16,float32}",
         apply=a.stored("backend.dtype", lambda v, sp: a.one_of(v, sp, ("auto", "float16", "bfloat16", "float32"))),
         help="compute dtype for unquantized weights"),
    make("--prompt-cache-capacity-bytes", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N",
         apply=lambda s, v, sp: a.assign(s, "kv.prompt_cache_capacity_bytes", max(a.as_int(v, sp), -1)),
         help="prompt cache budget in bytes (-1 = no limit, 0 = disable); wins over --cache-ram"),
    make("--backend", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{auto,mlx,torch}",
         apply=lambda s, v, sp: a.assign(s, "backend.name", a.one_of(v, sp, ("auto", "mlx", "torch"))),
         help="inference backend: auto = MLX on Apple Silicon, torch on CUDA and on other CPUs (default: auto)"),
    make("--torch-compile", FLAG, section=NATIVE, state=SUPPORTED, native=True, apply=a.flag_to("backend.torch_compile"),
         help="run the torch backend's forward through torch.compile (slow first steps while it compiles; "
              "off by default, see docs/benchmarks.md); refused on the MLX backend"),
    make("--max-queue-depth", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N",
         apply=lambda s, v, sp: a.assign(s, "engine.max_queue_depth", max(a.as_int(v, sp), -1)),
         help="requests that may wait for a slot (and, per side worker, for the worker) before new ones get "
              "503 (default: 64, -1 = unbounded)"),
    make("--graceful-unload-timeout", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="SECONDS",
         env="GRACEFUL_UNLOAD_TIMEOUT",
         apply=lambda s, v, sp: a.assign(s, "engine.graceful_unload_timeout", max(a.as_float(v, sp), 0.0)),
         help="a model switch waits this long for running requests before unloading (default: 30)"),
    make("--shutdown-timeout", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="SECONDS",
         apply=lambda s, v, sp: a.assign(s, "server.shutdown_timeout", max(a.as_float(v, sp), 0.0)),
         help="on SIGTERM/SIGINT, running requests get this long to finish; then they end with an error "
              "(default: 30)"),
    make("--model-memory-budget", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MiB",
         apply=lambda s, v, sp: a.assign(s, "engine.model_memory_budget_mib", max(a.as_int(v, sp), 0)),
         help="weights a model switch may load, in MiB (default: the free memory after the unload)"),
    make("--estimate-memory", FLAG, section=NATIVE, state=SUPPORTED, native=True,
         apply=a.flag_to("engine.estimate_memory"),
         help="print what this configuration holds in memory (weights, KV per slot at -c/-np, the prompt cache's "
              "budget, the total) and what the device has available, before loading any weight; then exit"),
    make("--any-model-name", FLAG, section=NATIVE, state=SUPPORTED, native=True,
         apply=a.flag_to("source.any_model_name"),
         help="serve every requested model name with the loaded model, as llama-server does (the response says "
              "so in X-miLLM-Model-Substituted); default: a name other than the model's id, aliases or path is "
              "a 404"),
    make("--embedding-model", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MODEL",
         apply=a.setter("workers.embedding_model"), help="embedding checkpoint served on the embedding routes"),
    make("--reranker-model", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MODEL",
         apply=a.setter("workers.reranker_model"), help="cross-encoder checkpoint served on the rerank routes"),
    make("--reasoning-alias-field", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{none,reasoning}",
         apply=lambda s, v, sp: a.assign(s, "chat.reasoning_alias_field", a.one_of(v, sp, ("none", "reasoning"))),
         help="also report reasoning_content as 'reasoning' on chat messages and deltas (OpenRouter-style "
              "clients; default: reasoning), or none for b10621's field alone"),
    make("--dump-flag-surface", FLAG, section=NATIVE, state=SUPPORTED, native=True, hidden=True,
         apply=lambda *_: None),
)
