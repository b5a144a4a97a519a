"""What the routes share: the settings and the model host that holds the served model (absent
while it loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.api.stream_sessions import StreamStore
from mlxcel.config.settings import ServerSettings
from mlxcel.runtime.host import ModelHost
from mlxcel.runtime.served import ServedModel

_ON_HOST: Any = object()  # `model` / `load_error` not given: whatever the host holds


@dataclass
class AppState:
    settings: ServerSettings
    # the served model's lifecycle (runtime/host.py); a host of its own when none is given
    host: ModelHost | None = None
    # the served model and why none is loaded: kept on the host (the properties below)
    model: ServedModel | None = _ON_HOST
    load_error: str | None = _ON_HOST
    # side workers (mlxcel/workers): present once loaded; `plan` says which were asked for
    plan: Any = None  # workers.plan.ServePlan; None = plain generation server
    embedder: Any = None  # workers.embedding.EmbeddingWorker
    reranker: Any = None  # workers.reranking.RerankWorker
    transcriber: Any = None  # workers.whisper.WhisperWorker (-m naming a Whisper checkpoint)
    speaker: Any = None  # workers.speech.SpeechWorker (-m naming a Kokoro checkpoint)
    worker_queues: dict = field(default_factory=dict)  # side worker kind -> its workers.queue.JobQueue
    workers_closed: str | None = None  # set when a shutdown drain closed the queues: the reason
    steering_store: Any = None  # the SQLite SteeringStore (mlxcel.steering.store), opened at serve time
    store_root: Path | None = None  # where SAE store entries are looked up
    streams: StreamStore = field(default_factory=StreamStore)  # resumable SSE sessions (api/stream_sessions)
    steering_lock: str | None = None  # the model id locked for steering: /v1/models lists only it
    # completion id -> (ReasoningControl, handles) of running requests armed with reasoning_control
    reasoning_controls: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._own_host()

    def _own_host(self) -> ModelHost:
        if self.host is None:  # the generated __init__ may set `model` before __post_init__ runs
            self.host = ModelHost(self.settings)
        return self.host

    @property
    def switch(self) -> ModelHost | None:
        """The host when /v1 requests may switch the generation model (a server started with
        one), with its phase (every request gets model_busy meanwhile); None: the loaded model
        is the only one."""
        return self.host if self.host.switching else None


def _on_host(name: str) -> property:
    def get(self: AppState) -> Any:
        return getattr(self._own_host(), name)

    def set_(self: AppState, value: Any) -> None:
        if value is not _ON_HOST:
            setattr(self._own_host(), name, value)

    return property(get, set_)


# Set after the class: a property in its body would become the dataclass fields' default.
AppState.model = _on_host("model")
AppState.load_error = _on_host("load_error")
