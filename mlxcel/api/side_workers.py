"""What the embedding and rerank routes share: finding the worker the mode selected.

A worker that was planned but is still loading answers 503 like the chat model does; a server
that serves no such worker answers b10621's 501, naming the flag that would turn it on.
"""

from __future__ import annotations

from mlxcel.api.errors import ApiError
from mlxcel.api.state import AppState

_FLAG = {"embedder": ("embeddings", "--embeddings"), "reranker": ("reranking", "--reranking")}


def side_worker(state: AppState, attr: str):
    worker = getattr(state, attr)
    if worker is not None:
        return worker
    kind = "embedding" if attr == "embedder" else "reranker"
    if state.plan is not None and any(s.kind == kind for s in state.plan.sides):
        if state.load_error:
            raise ApiError(503, f"the {kind} model failed to load: {state.load_error}", type="unavailable_error")
        raise ApiError(503, "Loading model", code="model_not_loaded", type="unavailable_error")
    what, flag = _FLAG[attr]
    raise ApiError(501, f"This server does not support {what}. Start it with `{flag}`", code="not_supported",
                   type="not_supported_error")


def generation_refusal(state: AppState) -> ApiError | None:
    """In --embeddings / --reranking mode (or serving a Whisper checkpoint) every generation route
    answers this 501."""
    flag = state.plan.restricted_by if state.plan is not None else None
    if flag is None:
        return None
    if flag == "-m":
        return ApiError(501, "This server does not support completions: -m names a Whisper (speech-to-text) "
                        "checkpoint", code="not_supported", type="not_supported_error")
    return ApiError(501, f"This server does not support completions. Start it without `{flag}`",
                    code="not_supported", type="not_supported_error")
