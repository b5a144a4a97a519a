"""Builds the ASGI application: routes, shared state, error rendering, and the llama-server
gate (API keys, CORS) around it."""

from __future__ import annotations

from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException

from mlxcel.api.anthropic.messages import MESSAGES_ROUTES
from mlxcel.api.kv_cache import CACHE_ROUTES
from mlxcel.api.errors import (ApiError, api_error_handler, http_exception_handler, internal_error_handler,
                               refusal_handler)
from mlxcel.api.llamacpp.embedding import native_embeddings
from mlxcel.api.llamacpp.health import health, health_alias
from mlxcel.api.llamacpp.rerank import rerank
from mlxcel.api.llamacpp.routes import NATIVE_ROUTES
from mlxcel.api.llamacpp.stubs import FEATURE_DISABLED_HANDLERS
from mlxcel.api.management.steering import ROUTES as MANAGEMENT_ROUTES
from mlxcel.api.openai.audio import AUDIO_ROUTES
from mlxcel.api.openai.speech import SPEECH_ROUTES
from mlxcel.api.openai.chat import chat_completions
from mlxcel.api.openai.reasoning_control import control as chat_control
from mlxcel.api.openai.completions import completions
from mlxcel.api.openai.embeddings import openai_embeddings
from mlxcel.api.openai.models import get_model, list_loaded_models, list_models
from mlxcel.api.openai.responses import RESPONSES_ROUTES
from mlxcel.api.state import AppState
from mlxcel.api.stream_resume import STREAM_ROUTES, wrap_streams
from mlxcel.steering.requests import RequestRefused

ROUTES = [health, list_models, list_loaded_models, get_model, chat_completions, chat_control, completions, *NATIVE_ROUTES,
          *FEATURE_DISABLED_HANDLERS, *MANAGEMENT_ROUTES, *CACHE_ROUTES, *MESSAGES_ROUTES, *RESPONSES_ROUTES, *STREAM_ROUTES]
ROUTES += [native_embeddings, openai_embeddings, rerank, *AUDIO_ROUTES, *SPEECH_ROUTES]  # side workers (mlxcel/workers)


def registered_paths() -> list[str]:
    return sorted({path for handler in ROUTES for path in handler.paths})


def build_litestar(state: AppState) -> Litestar:
    """The Litestar app alone (no gate): what route tests and the manifest check inspect."""
    settings = state.settings
    routes = list(ROUTES)
    if settings.server.vertex_health_route:
        routes.append(health_alias(settings.server.vertex_health_route))
    if settings.server.vertex_predict_route:
        from mlxcel.api.vertex import make_predict_handler

        routes.append(make_predict_handler(settings.server.vertex_predict_route))

    def provide_state() -> AppState:
        return state

    return Litestar(
        route_handlers=routes,
        dependencies={"app_state": Provide(provide_state, sync_to_thread=False)},
        exception_handlers={
            ApiError: api_error_handler,
            RequestRefused: refusal_handler,
            HTTPException: http_exception_handler,
            Exception: internal_error_handler,
        },
        openapi_config=None,
        # logging stays as cli/logging_setup.py configured it (Litestar's default config would
        # replace the root handler at startup, switching every later line to its own format)
        logging_config=None,
        debug=False,
    )


def build_app(state: AppState):
    """The served ASGI app: Litestar, its streaming answers recorded for resumption
    (api/stream_resume), the chat page (api/webui) in front, behind the API-key and CORS gate;
    each request logged at -v."""
    from mlxcel.api.model_names import NameHeader
    from mlxcel.api.request_log import RequestLog
    from mlxcel.api.security import wrap_app
    from mlxcel.api.webui.routes import with_webui

    api = NameHeader(wrap_streams(build_litestar(state), state))
    return RequestLog(wrap_app(with_webui(api, state.settings), state.settings))
