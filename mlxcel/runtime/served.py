"""What the composition root hands the API: one loaded model (`ServedModel`), and what was
settled at startup for the -m model before it loaded (`Startup`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mlxcel.backends.group import GroupBackend
from mlxcel.backends.select import Choice
from mlxcel.engine.backend import ModelInfo
from mlxcel.engine.engine import Engine
from mlxcel.engine.grammar import CompiledGrammar, GrammarCompiler
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.speculative import SpecConfig
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.models.lora import LoraSet
from mlxcel.models.vision import VisionInput
from mlxcel.steering.manager import SteeringManager


@dataclass(frozen=True)
class Startup:
    """Resolved by the CLI for the -m model before its load: the backend and device `auto`
    settled on (and why), its LoRA adapters (read and fit-checked) and its speculative decoding.
    Settings keep what was asked for; every later load (a switch target, the draft, a capacity
    check) asks for `placement` as given. A model a switch loads keeps the placement and its
    reason and gets neither the adapters nor the draft."""

    placement: Choice | None = None
    lora: LoraSet | None = None
    speculative: SpecConfig | None = None
    # --tp-size / --pp-size: what rank 0 does when its group loses a rank (the CLI exits)
    on_group_failure: Callable[[str], None] | None = None

    @property
    def backend_reason(self) -> str:
        return self.placement.reason if self.placement is not None else ""


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
    steering: SteeringManager | None = None  # the SAEs attached to this model
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarCompiler | None = None  # grammars compiled against this tokenizer
    default_grammar: CompiledGrammar | None = None  # the --grammar / --json-schema default
    default_grammar_error: str | None = None  # why the --grammar default failed to parse
    tags: list[str] = field(default_factory=list)  # --tags, reported on /v1/models (informational)
    vision: VisionInput | None = None  # the image side of a vision-language checkpoint (None: text only)
    lora: LoraSet | None = None  # the LoRA adapters and their live scales; None: no adapters
    group: GroupBackend | None = None  # the distributed group serving it (--tp-size / --pp-size); None: one process

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
