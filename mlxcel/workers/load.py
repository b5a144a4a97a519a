"""Loading the planned side workers into the app state (run on the server's load thread)."""

from __future__ import annotations

import logging

from mlxcel.workers import checkpoint as ck

log = logging.getLogger("mlxcel.server")


def load_side_workers(state, settings, placed=None) -> None:
    """`placed`: the backend/device choice settled at startup (backends.select.Choice), if any;
    without one, the backend as requested."""
    from mlxcel.workers.embedding import EmbeddingWorker
    from mlxcel.workers.reranking import RerankWorker
    from mlxcel.workers.speech import SPEECH, SpeechWorker
    from mlxcel.workers.whisper import TRANSCRIPTION, WhisperWorker

    requested = placed.backend if placed is not None else settings.backend.name
    backend = requested if requested in ("mlx", "torch") else "mlx"
    for side in state.plan.sides:
        if side.kind == TRANSCRIPTION:
            state.transcriber = WhisperWorker.load(side.model_id, side.path)
            log.info("Whisper model %s loaded (%s)", side.model_id,
                     "English-only" if state.transcriber.english_only else "multilingual")
        elif side.kind == SPEECH:
            state.speaker = SpeechWorker.load(side.model_id, side.path)
            log.info("Kokoro model %s loaded: %d voices, %d Hz", side.model_id, len(state.speaker.voices),
                     state.speaker.sample_rate)
        elif side.kind == ck.EMBEDDING:
            state.embedder = EmbeddingWorker.load(side.model_id, side.path, pooling=side.pooling,
                                                  normalize=settings.workers.embd_normalize, backend=backend)
            log.info("embedding model %s loaded: pooling %s, embd_normalize %d, context %d", side.model_id,
                     state.embedder.pooling, state.embedder.normalize, state.embedder.n_ctx)
        else:
            state.reranker = RerankWorker.load(side.model_id, side.path, backend=backend)
            log.info("reranker %s loaded: context %d", side.model_id, state.reranker.n_ctx)


def side_workers_ready(state) -> bool:
    plan = state.plan
    if plan is None:
        return True
    want = {s.kind for s in plan.sides}
    return (ck.EMBEDDING not in want or state.embedder is not None) and \
        (ck.RERANKER not in want or state.reranker is not None) and \
        ("transcription" not in want or state.transcriber is not None) and \
        ("speech" not in want or state.speaker is not None)
