"""The Whisper worker: 16 kHz mono audio in, a transcript (and its segments) out, on MLX through
mlx-whisper.

A checkpoint is either transformers' layout (`model_type: whisper`, converted to mlx-whisper's
names in memory by workers/whisper_convert.py) or mlx-whisper's own (a ModelDimensions
config.json with `weights.safetensors` / `weights.npz`). Weights are float32 (a CPU has no fast
float16 matmul).

MLX binds a lazy array to the stream of the thread that built it (the model's cached causal
mask, mlx-whisper's cached mel filters), so the worker owns one thread: the model loads there and
every transcription runs there, one at a time. The long-form loop is the worker's own (greedy at
temperature 0, no timestamp tokens, so a segment is one 30-second window, decoded with the text
so far as its prompt); each window's text is handed out as soon as it is decoded, which is what
the streaming route sends. Token accounting: `input_tokens` counts the audio encoder positions
the clip took (1500 per window for every released Whisper), `output_tokens` the text tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRANSCRIPTION = "transcription"
SAMPLE_RATE = 16_000
NO_SPEECH, LOW_LOGPROB = 0.6, -1.0  # Whisper's defaults for skipping a silent window


class WhisperError(ValueError):
    """A request the checkpoint cannot serve (the message says why)."""


def is_whisper(path: Path) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") == "whisper" or {"n_mels", "n_audio_ctx", "n_text_ctx"} <= cfg.keys()


def _load_model(path: Path):
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_whisper import whisper as mw

    import importlib

    importlib.import_module("mlx_whisper.decoding")  # imported on this thread, not on the first request

    cfg = json.loads((path / "config.json").read_text())
    if "n_mels" in cfg:
        from mlx_whisper.load_models import load_model

        if cfg.get("quantization"):
            raise WhisperError(f"{path}: quantized mlx-whisper checkpoints are not served (float32 on a CPU)")
        return load_model(str(path), dtype=mx.float32), cfg["n_vocab"]
    from mlxcel.workers.whisper_convert import mlx_from_hf

    weights, dims = mlx_from_hf(path)
    model = mw.Whisper(mw.ModelDimensions(**dims), mx.float32)
    model.update(tree_unflatten([(k, mx.array(v.astype(np.float32))) for k, v in weights.items()]))
    mx.eval(model.parameters())
    return model, dims["n_vocab"]


@dataclass
class Transcript:
    text: str
    segments: list[dict]
    language: str
    duration: float
    input_tokens: int
    output_tokens: int

    @property
    def language_name(self) -> str:
        """The language as OpenAI's verbose_json names it ("english"), from Whisper's own table."""
        from mlx_whisper.tokenizer import LANGUAGES

        return LANGUAGES.get(self.language, self.language)


class _Text:
    """Joins segment texts into the transcript, dropping the leading whitespace Whisper puts
    before the first word; `add` returns the delta to stream, so deltas join to exactly `text`."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, piece: str) -> str:
        if not self.text:
            piece = piece.lstrip()
        self.text += piece
        return piece


@dataclass
class WhisperWorker:
    id: str
    path: Path
    model: object
    english_only: bool
    n_ctx: int
    executor: ThreadPoolExecutor | None = None  # the one thread all of this model's MLX work runs on
    created: int = field(default_factory=lambda: int(time.time()))

    kind = TRANSCRIPTION

    @classmethod
    def load(cls, model_id: str, path: Path) -> "WhisperWorker":
        executor = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-whisper")
        model, n_vocab = executor.submit(_load_model, Path(path)).result()
        return cls(model_id, Path(path), model, n_vocab < 51865, int(model.dims.n_text_ctx), executor)

    def check(self, language: str | None) -> None:
        """Refusals that need no audio, made before a response (or a stream) starts."""
        if language and self.english_only and language.lower() not in ("en", "english"):
            raise WhisperError(f"language {language!r}: {self.id} is an English-only Whisper checkpoint")

    def transcribe(self, audio: np.ndarray, **options) -> Transcript:
        """Blocks until this worker's thread has transcribed `audio` (16 kHz mono float32)."""
        return self.start(audio, **options).result()

    def start(self, audio: np.ndarray, *, on_delta: Callable[[str], None] | None = None,
              cancelled: Callable[[], bool] = lambda: False, **options) -> Future:
        """Queue a transcription on the worker's thread; `on_delta` gets each window's text as it
        is decoded (called on that thread), `cancelled` is polled between windows."""
        self.check(options.get("language"))
        return self.executor.submit(self._run, audio, on_delta, cancelled, **options)

    def _run(self, audio: np.ndarray, on_delta, cancelled, *, task: str = "transcribe", language: str | None = None,
             prompt: str | None = None, temperature: float = 0.0, max_tokens: int | None = None) -> Transcript:
        """Whisper's long-form loop without timestamps: one 30-second window at a time, each
        decoded with the text so far as its prompt, windows judged silent skipped."""
        import mlx.core as mx
        from mlx_whisper.audio import HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim
        from mlx_whisper.decoding import DecodingOptions, decode
        from mlx_whisper.tokenizer import get_tokenizer

        model = self.model
        mel = log_mel_spectrogram(np.ascontiguousarray(audio, dtype=np.float32), n_mels=model.dims.n_mels,
                                  padding=N_SAMPLES)
        content_frames = mel.shape[-2] - N_FRAMES
        if self.english_only:
            language, task = "en", "transcribe"  # an English-only vocabulary has no task or language tokens
        elif not language:
            _, probs = model.detect_language(pad_or_trim(mel, N_FRAMES, axis=-2).astype(mx.float32))
            language = max(probs, key=probs.get)
        tokenizer = get_tokenizer(model.is_multilingual, num_languages=model.num_languages, language=language,
                                  task=task)
        sample_len = None if max_tokens is None else max(1, min(int(max_tokens), self.n_ctx // 2))
        history = tokenizer.encode(" " + prompt.strip()) if prompt and prompt.strip() else []
        text, segments, seek, windows = _Text(), [], 0, 0
        while seek < content_frames and not cancelled():
            size = min(N_FRAMES, content_frames - seek)
            window = pad_or_trim(mel[seek : seek + size], N_FRAMES, axis=-2).astype(mx.float32)
            options = DecodingOptions(task=task, language=language, temperature=float(temperature),
                                      sample_len=sample_len, prompt=list(history), without_timestamps=True, fp16=False)
            result = decode(model, window, options)
            windows += 1
            start, seek = seek, seek + size
            if result.no_speech_prob > NO_SPEECH and result.avg_logprob <= LOW_LOGPROB:
                continue  # silence: Whisper's own voice-activity rule
            tokens = [int(t) for t in result.tokens if t < tokenizer.eot]
            delta = text.add(tokenizer.decode(tokens))
            segments.append({"id": len(segments), "seek": start, "start": start * HOP_LENGTH / SAMPLE_RATE,
                             "end": seek * HOP_LENGTH / SAMPLE_RATE, "text": tokenizer.decode(tokens),
                             "tokens": tokens, "temperature": float(result.temperature),
                             "avg_logprob": float(result.avg_logprob),
                             "compression_ratio": float(result.compression_ratio),
                             "no_speech_prob": float(result.no_speech_prob)})
            if delta and on_delta is not None:
                on_delta(delta)
            if temperature <= 0.5:  # a sampled (high-temperature) window does not condition the next
                history.extend(tokens)
            else:
                history = []
        return Transcript(text.text, segments, language, len(audio) / SAMPLE_RATE,
                          windows * int(model.dims.n_audio_ctx), sum(len(s["tokens"]) for s in segments))
