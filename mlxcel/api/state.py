"""What the routes share: the settings and the served model (absent while it loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.api.stream_sessions import StreamStore
from mlxcel.config.settings import ServerSettings
from mlxcel.runtime.served import ServedModel, Startup


@dataclass
class SwitchState:
    """A model switch in progress (api/model_switch.py); every request gets model_busy meanwhile."""
    phase: str | None = None  # None | "unloading" | "loading"
    target: str | None = None  # the model being loaded
    previous: str | None = None  # the model being unloaded
    unloaded: str | None = None  # the model the management API unloaded (none loaded since)


@dataclass
class AppState:
    settings: ServerSettings
    model: ServedModel | None = None
    startup: Startup = field(default_factory=Startup)  # what the CLI settled for the -m model
    load_error: str | None = None
    # side workers (mlxcel/workers): present once loaded; `plan` says which were asked for
    plan: Any = None  # workers.plan.ServePlan; None = plain generation server
    embedder: Any = None  # workers.embedding.EmbeddingWorker
    reranker: Any = None  # workers.reranking.RerankWorker
    transcriber: Any = None  # workers.whisper.WhisperWorker (-m naming a Whisper checkpoint)
    steering_store: Any = None  # the SQLite SteeringStore (mlxcel.steering.store), opened at serve time
    store_root: Path | None = None  # where SAE store entries are looked up
    streams: StreamStore = field(default_factory=StreamStore)  # resumable SSE sessions (api/stream_sessions)
    steering_lock: str | None = None  # the model id locked for steering: /v1/models lists only it
    # set when /v1 requests may switch the generation model (a server started with one);
    # None: the loaded model is the only one
    switch: SwitchState | None = None
    # completion id -> (ReasoningControl, handles) of running requests armed with reasoning_control
    reasoning_controls: dict = field(default_factory=dict)
