"""POST /rerank, /reranking, /v1/rerank, /v1/reranking: b10621's two response shapes.

The request spells its document list either `documents` (Jina / Cohere) or `texts` (TEI):

- `documents` -> {"model", "object": "list", "usage", "results": [{index, relevance_score}]},
  with `document: {"text": ...}` per result when `return_documents` is true;
- `texts` alone -> a bare array of {index, score}, with `text` when `return_text` is true.

A body carrying both spellings stays on the Jina envelope. Results are sorted by score,
highest first, and cut to `top_n` (default: all). Scores are the cross-encoder's raw logits.
"""

from __future__ import annotations

import threading
from typing import Any

from litestar import Request, Response, post

from mlxcel.api.body import check_count, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.model_names import check_worker
from mlxcel.api.side_workers import run_queued, side_worker, worker_queue
from mlxcel.api.state import AppState
from mlxcel.config.limits import MAX_INPUTS
from mlxcel.workers.checkpoint import RERANKER
from mlxcel.workers.embedding import InputTooLong


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", code="invalid_parameter", param=name)
    return value


def parse(body: dict[str, Any]) -> tuple[str, list[str], bool, int]:
    """(query, documents, tei, top_n) with upstream's three shape-error wordings."""
    if "query" not in body:
        raise ApiError(400, '"query" must be provided', code="invalid_request", param="query")
    query = body["query"]
    if not isinstance(query, str):
        raise ApiError(400, '"query" must be a string', code="invalid_parameter", param="query")
    tei = "texts" in body and "documents" not in body
    check_count(body, "texts" if tei else "documents", MAX_INPUTS, "documents")
    docs = body.get("texts") if tei else body.get("documents")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise ApiError(400, '"documents" must be a non-empty string array', code="invalid_parameter",
                       param="texts" if tei else "documents")
    top_n = body.get("top_n")
    if top_n is None:
        top_n = len(docs)
    elif not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, "'top_n' must be a non-negative integer", code="invalid_parameter", param="top_n")
    return query, docs, tei, top_n


@post(["/rerank", "/reranking", "/v1/rerank", "/v1/reranking"], status_code=200)
async def rerank(request: Request, app_state: AppState) -> Response:
    body = await read_json_object(request)
    worker = side_worker(app_state, "reranker")
    check_worker(app_state, worker, body.get("model"))
    query, docs, tei, top_n = parse(body)
    echo = _bool(body, "return_text" if tei else "return_documents")
    try:
        stop = threading.Event()
        scores, tokens = await run_queued(request, worker_queue(app_state, RERANKER),
                                          lambda: worker.score(query, docs, cancelled=stop.is_set), stop.set)
    except InputTooLong as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]  # stable on ties
    label = "score" if tei else "relevance_score"
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, label: scores[i]}
        if echo:
            item.update({"text": docs[i]} if tei else {"document": {"text": docs[i]}})
        results.append(item)
    if tei:
        return Response(results)
    n = sum(tokens)
    return Response({"model": worker.id, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n},
                     "results": results})
