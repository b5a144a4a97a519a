"""POST /v1/embeddings: OpenAI's embedding object list.

Who embeds: the embedding worker when the server runs one (--embeddings or
--embedding-model: it always wins), else the loaded generation model: each input's final
hidden states (after the model's final norm) mean-pooled over its tokens, as the /v1
contract promises. That pass is an engine job (`Engine.submit_hidden`) and is never steered.
Its vectors are not normalized unless `embd_normalize` asks (b10621's arithmetic), because
the contract's vector is the mean-pooled hidden state itself. A request naming another model
of the store switches to it first, like the other /v1 routes (api/model_switch.py). A server
whose mode flag turned generation off and that has no embedder answers b10621's 501.

`input` is a string or an array (see llamacpp/embedding.py for the accepted prompt forms);
`encoding_format` is float (default) or base64 (little-endian float32 bytes, as the OpenAI SDK
decodes them); `dimensions` is refused because mlxcel does not truncate vectors. The /v1 field
contract (openai/fields.py) applies as on the completion routes: fields the table refuses on
embeddings are refused before any model is looked at, others are reported or refused (strict).
A body that spells `content` instead of `input` gets the native shape, which is what b10621 does.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from litestar import Request, Response, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.embedding import (
    embed, native_body, normalize_field, prompt_field, prompts_with, tokenized_prompts,
)
from mlxcel.api.model_names import check_worker, worker_answers
from mlxcel.api.model_switch import model_for
from mlxcel.api.openai.fields import EMBEDDINGS, check_fields, settle_unused, strict_mode
from mlxcel.api.openai.schemas import EmbeddingRequest
from mlxcel.api.side_workers import side_worker
from mlxcel.api.state import AppState
from mlxcel.engine.types import EngineError
from mlxcel.runtime.served import ServedModel
from mlxcel.workers.vectors import normalize


def _encode(vec: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def worker_embeds(state: AppState) -> bool:
    """The embedding worker answers: it is loaded or planned, or a mode flag left no generation
    model (then side_worker's 501 names --embeddings)."""
    plan = state.plan
    return state.embedder is not None or (plan is not None and (
        plan.restricted_by is not None or any(s.kind == "embedding" for s in plan.sides)))


async def model_embed(model: ServedModel, prompts: list[list[int]], mode: int | None) -> list[np.ndarray]:
    """Mean-pooled final hidden states of the generation model, one vector per prompt."""
    for i, p in enumerate(prompts):
        if len(p) > model.n_ctx:
            raise ApiError(400, f"This model's maximum context length is {model.n_ctx} tokens. However, input[{i}] "
                           f"has {len(p)} tokens. Please reduce the input.", code="context_length_exceeded",
                           param="input")
    try:
        futures = [model.engine.submit_hidden(p) for p in prompts]
        hidden = [await asyncio.wrap_future(f) for f in futures]
    except EngineError as e:
        raise ApiError(e.status, e.message, code=e.code) from None
    vectors = [h.astype(np.float64).mean(axis=0).astype(np.float32) for h in hidden]
    if mode is not None:
        vectors = [normalize(v, mode) for v in vectors]
    if not all(np.isfinite(v).all() for v in vectors):
        raise ApiError(500, "the embedding is not finite", code="internal_error", type="server_error")
    return vectors


@post("/v1/embeddings", status_code=200)
async def openai_embeddings(request: Request, app_state: AppState) -> Response:
    strict = strict_mode(request.headers)
    body = await read_json_object(request)
    headers = settle_unused(check_fields(body, EmbeddingRequest, EMBEDDINGS), strict, EMBEDDINGS)
    name: Any = body.get("model") if isinstance(body.get("model"), str) else None
    fmt = body.get("encoding_format") or "float"
    if worker_embeds(app_state):
        worker = side_worker(app_state, "embedder")
        check_worker(app_state, worker, body.get("model"))
        field, value = prompt_field(body)
        _check_format(fmt)
        prompts = tokenized_prompts(worker, value, field)
        vectors = await embed(request, app_state, worker, prompts, normalize_field(body))
        served = name if name and worker_answers(app_state, worker)(name) else worker.id
    else:
        field, value = prompt_field(body)
        _check_format(fmt)
        mode = normalize_field(body)
        model = await model_for(app_state, name)  # may switch models (api/model_switch.py)
        prompts = prompts_with(lambda text: model.tokenizer.encode(text, add_special_tokens=True),
                               model.info.vocab_size, value, field)
        vectors = await model_embed(model, prompts, mode)
        served = model.id
    if field == "content":
        return Response(native_body(vectors), headers=headers)
    n = sum(len(p) for p in prompts)
    return Response({
        "model": served,
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": [{"embedding": _encode(v, fmt), "index": i, "object": "embedding"} for i, v in enumerate(vectors)],
    }, headers=headers)


def _check_format(fmt: Any) -> None:
    if fmt not in ("float", "base64"):
        raise ApiError(400, "The format to return the embeddings in. Can be either float or base64",
                       code="invalid_parameter", param="encoding_format")
