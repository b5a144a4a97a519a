"""Which model names a request may send.

A served model answers to its id, its --alias names and its checkpoint path; any other name
is a 404 `model_not_found` (the miLLM contract). With --any-model-name every name is served by
the loaded model, as llama-server serves one model whatever the request names, and the response
says so in `X-miLLM-Model-Substituted` (the id that answered). Side workers (embeddings,
rerank, transcription) follow the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo

SUBSTITUTED_HEADER = "X-miLLM-Model-Substituted"

# one holder per HTTP request (set by NameHeader); handlers and the tasks they start share it
_holder: ContextVar[dict[str, str] | None] = ContextVar("mlxcel_model_substituted", default=None)


def not_found(name: Any) -> ApiError:
    return ApiError(404, f"The model '{echo(name)}' does not exist", code="model_not_found", param="model")


def accepts(state: AppState, answers: Callable[[str | None], bool], name: str | None, served_id: str) -> bool:
    """Whether `name` may be served by the model `answers` belongs to (id `served_id`); under
    --any-model-name a foreign name is accepted and noted for the response header."""
    if answers(name):
        return True
    if not state.settings.source.any_model_name or not isinstance(name, str):
        return False
    holder = _holder.get()
    if holder is not None:
        holder["served"] = served_id
    return True


def name_rule(state: AppState, model: Any) -> Callable[[str | None], bool]:
    """`accepts` bound to the loaded model, for decoders that check the name themselves."""
    return lambda name: accepts(state, model.answers_to, name, model.id)


def worker_answers(state: AppState, worker: Any) -> Callable[[str | None], bool]:
    """A side worker's names: its id and path, plus -m's names when -m is its checkpoint."""
    source = state.settings.source
    names = {worker.id, str(getattr(worker, "path", worker.id))}
    main_id = source.alias[0] if source.alias else source.model
    if worker.id == main_id:
        names |= {*source.alias, *([source.model] if source.model else [])}
    return lambda name: name is None or name == "" or name in names


def check_worker(state: AppState, worker: Any, name: Any) -> None:
    """404 unless the worker answers to `name` (or --any-model-name serves every name)."""
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", code="invalid_parameter", param="model")
    if not accepts(state, worker_answers(state, worker), name, worker.id):
        raise not_found(name)


class NameHeader:
    """ASGI middleware: adds X-miLLM-Model-Substituted when a handler served a foreign name."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: dict[str, str] = {}
        token = _holder.set(holder)

        async def send_noting(message: dict) -> None:
            if message["type"] == "http.response.start" and "served" in holder:
                served = holder["served"].encode("utf-8", "replace")
                message = {**message, "headers": [*message.get("headers", []),
                                                   (SUBSTITUTED_HEADER.lower().encode(), served)]}
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            _holder.reset(token)
