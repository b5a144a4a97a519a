"""POST /tokenize and /detokenize with b10621's switches and shapes.

/tokenize: `content` is a string or an array of strings and token ids (absent: no
tokens); `add_special` (default false) adds the model's BOS/EOS the way its tokenizer
does; `parse_special` (default true) recognizes special-token spellings in the text;
`with_pieces` answers {id, piece} objects, a piece being a string when its bytes are
valid UTF-8 and an array of byte values otherwise. /detokenize renders special tokens
and turns bytes that form no character into U+FFFD.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", code="invalid_parameter", param=name)
    return value


def piece_json(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@post("/tokenize", status_code=200)
async def tokenize(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    content = body.get("content")
    tok = model.tokenizer
    ids: list[int] = []
    if isinstance(content, str):
        ids = tok.encode(content, add_special_tokens=add_special, parse_special=parse_special)
    elif isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, str):
                ids.extend(tok.encode(part, add_special_tokens=add_special and i == 0, parse_special=parse_special))
            elif isinstance(part, int) and not isinstance(part, bool):
                ids.append(part)
            else:
                raise ApiError(400, f"content[{i}] must be a string or a token id",
                               code="invalid_parameter", param="content")
    elif content is not None:
        raise ApiError(400, "content must be a string or an array of strings and token ids",
                       code="invalid_parameter", param="content")
    if not with_pieces:
        return {"tokens": ids}
    pieces = tok.pieces
    return {"tokens": [{"id": t, "piece": piece_json(pieces[t] if 0 <= t < len(pieces) else b"")} for t in ids]}


@post("/detokenize", status_code=200)
async def detokenize(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    tokens = body.get("tokens")
    if tokens is None:
        return {"content": ""}
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens must be an array of token ids", code="invalid_parameter", param="tokens")
    pieces = model.tokenizer.pieces
    bad = next((t for t in tokens if not 0 <= t < len(pieces)), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range [0, {len(pieces)})", code="invalid_parameter", param="tokens")
    return {"content": b"".join(pieces[t] for t in tokens).decode("utf-8", "replace")}
