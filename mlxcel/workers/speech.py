"""The text-to-speech worker: text in, 24 kHz mono audio out, on MLX through mlx-audio's Kokoro.

A checkpoint is Kokoro's layout: `config.json` (`model_type: kokoro`, or hexgrad's original keys
`istftnet`, `plbert`, `vocab`), its weights in `*.safetensors` (PyTorch-shaped convolutions, which
mlx-audio's `sanitize` turns around) and one voice pack per voice in `voices/<name>.safetensors`
(a style vector per phoneme count). The model class is mlx-audio's; loading is the worker's own
(no hub look-up, no name guessing) and keeps float32 weights (a CPU has no fast half-precision
convolution). Quantized Kokoro checkpoints are refused.

As with Whisper, MLX binds lazy arrays to the thread that built them, so the worker owns one
thread: the model loads there and every request runs there, one at a time. The text is cut into
chunks of at most 510 phonemes (workers/speech_text.py); each chunk is one model call, handed out
as soon as it is decoded, which is what the streaming route sends. `speed` divides Kokoro's
predicted durations, so it changes the length of the speech, not its pitch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxcel.config.limits import echo
from mlxcel.workers import speech_text

SPEECH = "speech"
MIN_SPEED, MAX_SPEED = 0.25, 4.0


class SpeechError(ValueError):
    """A request the checkpoint cannot serve (`param` names the field), or a checkpoint the worker
    cannot load."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _config(path: Path) -> dict | None:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def is_kokoro(path: Path) -> bool:
    cfg = _config(path)
    return cfg is not None and (cfg.get("model_type") == "kokoro" or {"istftnet", "plbert", "vocab"} <= cfg.keys())


def _load_model(path: Path):
    import mlx.core as mx
    from mlx_audio.tts.models.kokoro import Model, ModelConfig

    cfg = _config(path)
    if cfg.get("quantization"):
        raise SpeechError(f"{path}: quantized Kokoro checkpoints are not served (float32 on a CPU)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpeechError(f"{path}: no *.safetensors weights (a PyTorch .pth Kokoro must be converted first)")
    model = Model(ModelConfig.from_dict({**cfg, "model_path": str(path)}))
    weights: dict = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in model.sanitize(weights).items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def _load_voices(path: Path) -> dict:
    """The voice packs whose language the worker can phonemise, by name."""
    import mlx.core as mx

    voices = {}
    for f in sorted((path / "voices").glob("*.safetensors")):
        if speech_text.language_of(f.stem) is None:
            continue
        pack = mx.load(str(f)).get("voice")
        if pack is None or pack.ndim != 3 or pack.shape[-1] != 256:
            raise SpeechError(f"{f}: not a Kokoro voice pack (a 'voice' tensor of shape [n, 1, 256])")
        voices[f.stem] = pack.astype(mx.float32)
    if not voices:
        raise SpeechError(f"{path}: no voice pack in voices/ for a served language "
                          f"({', '.join(sorted(speech_text.LANGUAGES))}: the first letter of a Kokoro voice name)")
    return voices


@dataclass
class Speech:
    samples: int  # audio samples produced, at `sample_rate`
    sample_rate: int
    input_tokens: int  # phonemes read
    output_tokens: int  # duration frames predicted


@dataclass
class SpeechWorker:
    id: str
    path: Path
    model: object
    voices: dict
    sample_rate: int
    executor: ThreadPoolExecutor | None = None  # the one thread all of this model's MLX work runs on
    created: int = field(default_factory=lambda: int(time.time()))
    _g2p: dict = field(default_factory=dict)  # language code -> phonemizer, made on the worker's thread

    kind = SPEECH

    @classmethod
    def load(cls, model_id: str, path: Path) -> "SpeechWorker":
        executor = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-speech")
        path = Path(path)
        model, voices = executor.submit(lambda: (_load_model(path), _load_voices(path))).result()
        return cls(model_id, path, model, voices, int(model.sample_rate), executor)

    @property
    def n_ctx(self) -> int:
        return speech_text.MAX_PHONEMES

    def check(self, voice: str, speed: float) -> None:
        """Refusals that need no synthesis, made before a response (or a stream) starts."""
        if voice not in self.voices:
            raise SpeechError(f"voice {echo(repr(voice))} is not served by {self.id}; its voices: "
                              f"{', '.join(self.voices)}",
                              "voice")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise SpeechError(f"speed {speed} is outside {MIN_SPEED}..{MAX_SPEED}", "speed")

    def synthesize(self, text: str, voice: str, speed: float = 1.0) -> tuple[np.ndarray, Speech]:
        """Blocks until this worker's thread has spoken `text`: (mono float32 audio, accounting)."""
        pieces: list[np.ndarray] = []
        speech = self.start(text, voice, speed, on_audio=pieces.append).result()
        return (np.concatenate(pieces) if pieces else np.zeros(0, np.float32)), speech

    def start(self, text: str, voice: str, speed: float = 1.0, *,
              on_audio: Callable[[np.ndarray], None] | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Future:
        """Queue a synthesis on the worker's thread; `on_audio` gets each chunk's audio as it is
        decoded (called on that thread), `cancelled` is polled between chunks."""
        self.check(voice, speed)
        return self.executor.submit(self._run, text, voice, speed, on_audio, cancelled)

    def _phonemizer(self, voice: str):
        code = speech_text.language_of(voice)
        if code not in self._g2p:
            self._g2p[code] = speech_text.phonemizer(code)
        return self._g2p[code]

    def _run(self, text: str, voice: str, speed: float, on_audio, cancelled) -> Speech:
        pack = self.voices[voice]
        speech = Speech(0, self.sample_rate, 0, 0)
        for phonemes in speech_text.chunks(text, self._phonemizer(voice)):
            if cancelled():
                break
            out = self.model(phonemes, pack[min(len(phonemes), pack.shape[0]) - 1], speed, return_output=True)
            audio = np.asarray(out.audio, dtype=np.float32).reshape(-1)
            speech.samples += len(audio)
            speech.input_tokens += len(phonemes)
            speech.output_tokens += int(out.pred_dur.sum())
            if on_audio is not None and len(audio):
                on_audio(audio)
        return speech
