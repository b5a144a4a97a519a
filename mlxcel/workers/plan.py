"""The server's mode switch: which checkpoint serves generation, embeddings and reranking.

Decided at startup, before anything heavy loads, and refused with the flag named when a
mode cannot be served:

- `--embeddings` / `--reranking` turn generation off and select a dedicated worker; its
  checkpoint is `--embedding-model` / `--reranker-model`, else `-m`. A checkpoint of the wrong
  kind (a causal chat model has no embedding path) stops startup naming the flag.
- `--embedding-model` / `--reranker-model` without a mode flag add a side worker beside the
  chat model, which keeps generating.
- In a mode, `-m` must be used by one of the selected workers; a `-m` nothing would load is
  refused rather than ignored.
- Without a mode flag, `-m` naming a Whisper checkpoint selects the transcription worker, and
  `-m` naming a Kokoro checkpoint the speech worker; either turns generation off (restricted by
  `-m`): there is no chat model to generate with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.workers import checkpoint as ck


@dataclass(frozen=True)
class SidePlan:
    kind: str  # ck.EMBEDDING, ck.RERANKER, whisper.TRANSCRIPTION or speech.SPEECH
    model_id: str
    path: Path
    pooling: str | None = None  # embedders only, already resolved


@dataclass(frozen=True)
class ServePlan:
    generation: bool
    restricted_by: str | None  # the mode flag that turned generation off ("-m" for a Whisper or Kokoro checkpoint)
    sides: tuple[SidePlan, ...]


def restricting_flag(settings: ServerSettings) -> str | None:
    if settings.workers.reranking:
        return "--reranking"
    if settings.workers.embedding:
        return "--embeddings"
    return None


def _side(settings: ServerSettings, kind: str, ref: str, flag: str, resolve: Callable[[str, str], Path],
          model_id: str) -> SidePlan:
    path = resolve(ref, flag)
    found = ck.encoder_kind(path)
    if found != kind:
        what = "an embedding checkpoint (a BERT encoder)" if kind == ck.EMBEDDING else \
            "a reranker (a BERT sequence classifier with one label)"
        raise StartupRefusal(f"{flag}: {ref} is {ck.describe(path)}, not {what}; mlxcel has no "
                             f"{'embedding' if kind == ck.EMBEDDING else 'reranking'} path for it")
    pooling = None
    if kind == ck.EMBEDDING:
        try:
            pooling = ck.resolve_pooling(path, settings.workers.pooling, settings.workers.pooling_env)
        except ck.CheckpointError as e:
            raise StartupRefusal(f"{flag}: {e}") from None
    return SidePlan(kind, model_id, path, pooling)


def _whisper_side(settings: ServerSettings, resolve: Callable[[str, str], Path], model_id: str) -> SidePlan | None:
    from mlxcel.workers.whisper import TRANSCRIPTION, is_whisper

    path = resolve(settings.source.model, "--hf-repo" if settings.source.hf_repo else "-m")
    if not is_whisper(path):
        return None
    import importlib.util

    missing = [m for m in ("mlx_whisper", "soundfile", "scipy") if importlib.util.find_spec(m) is None]
    if missing:
        raise StartupRefusal(f"-m {settings.source.model} is a Whisper checkpoint, and serving it needs "
                             f"{', '.join(missing)}: pip install 'mlxcel[audio]'")
    if settings.backend.name == "torch":  # as requested: plan() runs before the backend is settled
        raise StartupRefusal(f"--backend torch: {settings.source.model} is a Whisper checkpoint, which mlxcel serves on "
                             f"MLX (mlx-whisper) only; drop --backend torch")
    return SidePlan(TRANSCRIPTION, model_id, path)


def _speech_side(settings: ServerSettings, resolve: Callable[[str, str], Path], model_id: str) -> SidePlan | None:
    from mlxcel.workers.speech import SPEECH, is_kokoro

    path = resolve(settings.source.model, "--hf-repo" if settings.source.hf_repo else "-m")
    if not is_kokoro(path):
        return None
    import importlib.util

    missing = [m for m in ("mlx_audio", "misaki", "phonemizer", "espeakng_loader", "soundfile")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise StartupRefusal(f"-m {settings.source.model} is a Kokoro (text-to-speech) checkpoint, and serving it "
                             f"needs {', '.join(missing)}: pip install 'mlxcel[tts]'")
    if settings.backend.name == "torch":
        raise StartupRefusal(f"--backend torch: {settings.source.model} is a Kokoro checkpoint, which mlxcel serves on "
                             f"MLX (mlx-audio) only; drop --backend torch")
    return SidePlan(SPEECH, model_id, path)


def plan(settings: ServerSettings, resolve: Callable[[str, str], Path]) -> ServePlan:
    """`resolve(ref, flag)` turns a model reference into a local checkpoint or raises StartupRefusal."""
    mode = restricting_flag(settings)
    main_id = settings.source.alias[0] if settings.source.alias else settings.source.model
    sides: list[SidePlan] = []
    m_used = mode is None
    w = settings.workers
    for kind, selected, side_ref, side_flag, mode_flag in (
        (ck.EMBEDDING, w.embedding, w.embedding_model, "--embedding-model", "--embeddings"),
        (ck.RERANKER, w.reranking, w.reranker_model, "--reranker-model", "--reranking"),
    ):
        if side_ref:
            sides.append(_side(settings, kind, side_ref, side_flag, resolve, side_ref))
        elif selected:
            if not settings.source.model:
                raise StartupRefusal(f"{mode_flag} needs a checkpoint: pass -m or {side_flag}")
            sides.append(_side(settings, kind, settings.source.model, mode_flag, resolve, main_id))
            m_used = True
    if settings.workers.pooling and not any(s.kind == ck.EMBEDDING for s in sides):
        raise StartupRefusal(f"--pooling {settings.workers.pooling}: no embedding model is served (pass --embeddings "
                             f"or --embedding-model)")
    if settings.workers.embd_normalize is not None and not any(s.kind == ck.EMBEDDING for s in sides):
        raise StartupRefusal("--embd-normalize: no embedding model is served (pass --embeddings or "
                             "--embedding-model)")
    if mode is None and settings.source.model:
        audio = _whisper_side(settings, resolve, main_id) or _speech_side(settings, resolve, main_id)
        if audio is not None:
            return ServePlan(generation=False, restricted_by="-m", sides=(audio, *sides))
    if settings.source.model and not m_used:
        raise StartupRefusal(f"-m {settings.source.model} would not be served: {mode} turns generation off and every "
                             f"selected worker has its own checkpoint flag; drop -m or one of those flags")
    return ServePlan(generation=mode is None, restricted_by=mode, sides=tuple(sides))
