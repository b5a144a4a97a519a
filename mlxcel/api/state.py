"""What the routes share: the settings and the served model (absent while it loads)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.api.stream_sessions import StreamStore
from mlxcel.engine.backend import ModelInfo
from mlxcel.config.settings import ServerSettings
from mlxcel.engine.engine import Engine
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.tokenizer import Tokenizer


@dataclass
class ServedModel:
    id: str  # the name clients send and /v1/models lists
    aliases: list[str]
    info: ModelInfo
    tokenizer: Tokenizer
    engine: Engine
    defaults: SamplingParams  # server-wide sampling defaults, already resolved
    n_ctx: int
    n_predict: int
    ignore_eos: bool = False  # --ignore-eos: a request that does not say inherits it
    backend_reason: str = ""  # why this backend and device were chosen ("requested", "auto: ...")
    steering: Any = None  # the SteeringManager of this model's SAEs (mlxcel.steering.manager)
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: Any = None  # engine.grammar.GrammarCompiler for this tokenizer
    default_grammar: Any = None  # the --grammar / --json-schema default (a CompiledGrammar)
    default_grammar_error: str | None = None  # why the --grammar default failed to parse
    tags: list[str] = field(default_factory=list)  # --tags, reported on /v1/models (informational)
    vision: Any = None  # models.vision.VisionInput of a vision-language checkpoint (None: text only)
    lora: Any = None  # the LoRA adapters and their live scales (models/lora.LoraSet); None: no adapters

    def request_bias(self, bias: Mapping[int, float] | None, ignore_eos: bool) -> dict[int, float]:
        """A request's logit bias: its own set, else the server's -l set; ignore_eos bans
        every end-of-generation token on top, as b10621 appends its EOG biases."""
        out = dict(self.defaults.logit_bias if bias is None else bias)
        if ignore_eos:
            for t in self.tokenizer.eos_token_ids:
                out[t] = -math.inf
        return out

    def answers_to(self, name: str | None) -> bool:
        return name is None or name == "" or name == self.id or name in self.aliases or name == str(self.info.path)


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
