"""The Whisper worker: 16 kHz mono audio in, a transcript (and its segments) out, on MLX through
mlx-whisper.

A checkpoint is either transformers' layout (`model_type: whisper`, converted to mlx-whisper's
names in memory by workers/whisper_convert.py) or mlx-whisper's own (a ModelDimensions
config.json with `weights.safetensors` / `weights.npz`). Weights are float32 (a CPU has no fast
float16 matmul).

mlx-whisper keeps its loaded model in a module-level holder keyed by path, and MLX binds a lazy
array to the stream of the thread that built it (the model's cached causal mask, mlx-whisper's
cached mel filters), so the worker owns one thread: the model loads there and every
transcription runs there, one at a time, with the holder pointed at this worker's model.
Decoding runs without timestamp tokens: a segment is one 30-second window. Token accounting:
`input_tokens` counts the audio encoder positions the clip took (1500 per window for every
released Whisper) and `output_tokens` the text tokens decoded.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRANSCRIPTION = "transcription"
SAMPLE_RATE = 16_000
WINDOW_SECONDS = 30


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

    import mlx_whisper.transcribe  # noqa: F401  (imported on this thread, not on the first request)

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
    pieces: list[str]  # the text cut at segment boundaries: "".join(pieces) == text


def _pieces(texts: list[str]) -> tuple[str, list[str]]:
    """The stripped transcript and its per-segment pieces, which join to exactly that text."""
    joined = "".join(texts)
    lo, hi = len(joined) - len(joined.lstrip()), len(joined.rstrip())
    pieces, pos = [], 0
    for t in texts:
        a, b = max(pos, lo), min(pos + len(t), hi)
        if b > a:
            pieces.append(joined[a:b])
        pos += len(t)
    return joined[lo:hi], pieces


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

    def transcribe(self, audio: np.ndarray, **options) -> Transcript:
        """Blocks until this worker's thread has transcribed `audio` (16 kHz mono float32)."""
        return self.executor.submit(self._transcribe, audio, **options).result()

    def _transcribe(self, audio: np.ndarray, *, task: str = "transcribe", language: str | None = None,
                    prompt: str | None = None, temperature: float = 0.0, max_tokens: int | None = None) -> Transcript:
        import importlib

        mt = importlib.import_module("mlx_whisper.transcribe")  # the module (the package exports the function)

        if language and self.english_only and language.lower() not in ("en", "english"):
            raise WhisperError(f"language {language!r}: {self.id} is an English-only Whisper checkpoint")
        options = {"fp16": False, "without_timestamps": True, "verbose": None, "temperature": (float(temperature),),
                   "initial_prompt": prompt or None, "condition_on_previous_text": True}
        if not self.english_only:
            options["task"] = task
            if language:
                options["language"] = language
        if max_tokens is not None:
            options["sample_len"] = max(1, min(int(max_tokens), self.n_ctx // 2))
        mt.ModelHolder.model, mt.ModelHolder.model_path = self.model, str(self.path)
        result = mt.transcribe(np.ascontiguousarray(audio, dtype=np.float32), path_or_hf_repo=str(self.path), **options)
        segments = [{"id": s["id"], "seek": s["seek"], "start": float(s["start"]), "end": float(s["end"]),
                     "text": s["text"], "tokens": [int(t) for t in s["tokens"]], "temperature": float(s["temperature"]),
                     "avg_logprob": float(s["avg_logprob"]), "compression_ratio": float(s["compression_ratio"]),
                     "no_speech_prob": float(s["no_speech_prob"])} for s in result["segments"]]
        duration = len(audio) / SAMPLE_RATE
        windows = max(1, int(np.ceil(duration / WINDOW_SECONDS)))
        n_out = sum(len(s["tokens"]) for s in segments)
        text, pieces = _pieces([s["text"] for s in segments])
        return Transcript(text, segments, result.get("language") or "en", duration,
                          windows * int(self.model.dims.n_audio_ctx), n_out, pieces)
