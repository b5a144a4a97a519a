"""POST /embedding and /embeddings (b10621's native shape), plus the request reading the OpenAI
route shares.

The prompt comes from `input`, else `content`; it is a string, an array of token ids (one
prompt), or an array whose elements are strings or token-id arrays (one prompt each). Token
ids are embedded as given, so they must already carry the model's special tokens. The native
answer is a bare array of {index, embedding} whose `embedding` is an array of arrays: one row,
the pooled vector, since mlxcel always pools. `embd_normalize` overrides the server's
normalization for this request.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
from litestar import Request, Response, post

from mlxcel.api.body import check_count, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.side_workers import run_queued, side_worker, worker_queue
from mlxcel.api.state import AppState
from mlxcel.config.limits import MAX_INPUTS
from mlxcel.workers.checkpoint import EMBEDDING
from mlxcel.workers.embedding import EmbeddingWorker, InputTooLong


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def prompt_field(body: dict[str, Any]) -> tuple[str, Any]:
    """("input" | "content", value); `input` wins, as upstream reads it. Its count is bounded here,
    before any input is tokenized."""
    for field in ("input", "content"):
        if field in body:
            check_count(body, field, MAX_INPUTS, "inputs")
            return field, body[field]
    raise ApiError(400, '"input" or "content" must be provided', code="invalid_request")


def tokenized_prompts(worker: EmbeddingWorker, value: Any, field: str) -> list[list[int]]:
    return prompts_with(worker.tokenize, worker.tokenizer.get_vocab_size(), value, field)


def prompts_with(tokenize: Callable[[str], list[int]], vocab: int, value: Any, field: str) -> list[list[int]]:
    """The prompt forms above as token lists, checked against a vocabulary of `vocab` ids."""
    if isinstance(value, str):
        prompts = [tokenize(value)]
    elif _is_ids(value) and value:
        prompts = [list(value)]
    elif isinstance(value, list):
        prompts = []
        for item in value:
            if isinstance(item, str):
                prompts.append(tokenize(item))
            elif _is_ids(item):
                prompts.append(list(item))
            else:
                raise ApiError(400, f"'{field}' must be a string, an array of token ids, or an array of strings "
                                    f"and token-id arrays", code="invalid_parameter", param=field)
    else:
        raise ApiError(400, f"'{field}' must be a string or an array", code="invalid_parameter", param=field)
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "Input content cannot be empty", code="invalid_parameter", param=field)
    for p in prompts:
        bad = next((t for t in p if t < 0 or t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of the vocabulary (size {vocab})", code="invalid_parameter",
                           param=field)
    return prompts


def normalize_field(body: dict[str, Any]) -> int | None:
    value = body.get("embd_normalize")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, "'embd_normalize' must be an integer", code="invalid_parameter", param="embd_normalize")
    return value


async def embed(request: Request, state: AppState, worker: EmbeddingWorker, prompts: list[list[int]],
                mode: int | None) -> list[np.ndarray]:
    """The worker's vectors, in the embedding queue's turn (api/side_workers.py)."""
    try:
        stop = threading.Event()
        vectors = await run_queued(request, worker_queue(state, EMBEDDING),
                                   lambda: worker.embed(prompts, mode, cancelled=stop.is_set), stop.set)
    except InputTooLong as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    if not all(np.isfinite(v).all() for v in vectors):
        raise ApiError(500, "the embedding is not finite", code="internal_error", type="server_error")
    return vectors


def native_body(vectors: list[np.ndarray]) -> list[dict]:
    return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]


@post(["/embedding", "/embeddings"], status_code=200)
async def native_embeddings(request: Request, app_state: AppState) -> Response:
    body = await read_json_object(request)
    worker = side_worker(app_state, "embedder")
    field, value = prompt_field(body)
    prompts = tokenized_prompts(worker, value, field)
    return Response(native_body(await embed(request, app_state, worker, prompts, normalize_field(body))))
