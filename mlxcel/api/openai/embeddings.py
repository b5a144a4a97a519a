"""POST /v1/embeddings: OpenAI's embedding object list.

`input` is a string or an array (see llamacpp/embedding.py for the accepted prompt forms);
`encoding_format` is float (default) or base64 (little-endian float32 bytes, as the OpenAI SDK
decodes them); `dimensions` is refused because mlxcel does not truncate vectors. The /v1 field
contract (openai/fields.py) applies as on the completion routes: fields the table refuses on
embeddings are refused before the worker is looked at, others are reported or refused (strict). A body that
spells `content` instead of `input` gets the native shape, which is what b10621 does.
"""

from __future__ import annotations

import base64

import numpy as np
from litestar import Request, Response, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.embedding import embed, native_body, normalize_field, prompt_field, tokenized_prompts
from mlxcel.api.openai.fields import EMBEDDINGS, check_fields, settle_unused, strict_mode
from mlxcel.api.openai.schemas import EmbeddingRequest
from mlxcel.api.side_workers import side_worker
from mlxcel.api.state import AppState


def _encode(vec: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


@post("/v1/embeddings", status_code=200)
async def openai_embeddings(request: Request, app_state: AppState) -> Response:
    strict = strict_mode(request.headers)
    body = await read_json_object(request)
    headers = settle_unused(check_fields(body, EmbeddingRequest, EMBEDDINGS), strict, EMBEDDINGS)
    worker = side_worker(app_state, "embedder")
    field, value = prompt_field(body)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "The format to return the embeddings in. Can be either float or base64",
                       code="invalid_parameter", param="encoding_format")
    prompts = tokenized_prompts(worker, value, field)
    vectors = await embed(worker, prompts, normalize_field(body))
    if field == "content":
        return Response(native_body(vectors), headers=headers)
    n = sum(len(p) for p in prompts)
    return Response({
        "model": body.get("model") if isinstance(body.get("model"), str) else worker.id,
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": [{"embedding": _encode(v, fmt), "index": i, "object": "embedding"} for i, v in enumerate(vectors)],
    }, headers=headers)
