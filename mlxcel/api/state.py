"""What the routes share: the settings and the model host that holds the served model (absent
while it loads)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.api.stream_sessions import StreamStore
from mlxcel.config.settings import ServerSettings
from mlxcel.runtime.host import ModelHost
from mlxcel.runtime.served import ServedModel


@dataclass
class AppState:
    settings: ServerSettings
    # the served model and why none is loaded live on the host; given here, they start it
    model: InitVar[ServedModel | None] = None
    load_error: InitVar[str | None] = None
    # the served model's lifecycle (runtime/host.py); a host of its own when none is given
    host: ModelHost | None = None
    # side workers (mlxcel/workers): present once loaded; `plan` says which were asked for
    plan: Any = None  # workers.plan.ServePlan; None = plain generation server
    embedder: Any = None  # workers.embedding.EmbeddingWorker
    reranker: Any = None  # workers.reranking.RerankWorker
    transcriber: Any = None  # workers.whisper.WhisperWorker (-m naming a Whisper checkpoint)
    steering_store: Any = None  # the SQLite SteeringStore (mlxcel.steering.store), opened at serve time
    store_root: Path | None = None  # where SAE store entries are looked up
    streams: StreamStore = field(default_factory=StreamStore)  # resumable SSE sessions (api/stream_sessions)
    steering_lock: str | None = None  # the model id locked for steering: /v1/models lists only it
    # completion id -> (ReasoningControl, handles) of running requests armed with reasoning_control
    reasoning_controls: dict = field(default_factory=dict)

    def __post_init__(self, model: ServedModel | None, load_error: str | None) -> None:
        if self.host is None:
            self.host = ModelHost(self.settings)
        if model is not None:
            self.host.model = model
        if load_error is not None:
            self.host.load_error = load_error


# Properties set after the class: a dataclass field of the same name (the InitVars above) would
# otherwise take the property for its default.
AppState.model = property(lambda self: self.host.model, lambda self, m: setattr(self.host, "model", m))
AppState.load_error = property(lambda self: self.host.load_error,
                               lambda self, e: setattr(self.host, "load_error", e))
# the host when /v1 requests may switch the generation model (a server started with one), with
# its phase (every request gets model_busy meanwhile); None: the loaded model is the only one
AppState.switch = property(lambda self: self.host if self.host.switching else None)
