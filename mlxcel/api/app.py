"""Builds the Litestar application: routes, shared state, error rendering."""

from __future__ import annotations

from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException

from mlxcel.api.errors import ApiError, api_error_handler, http_exception_handler, internal_error_handler
from mlxcel.api.llamacpp.health import health
from mlxcel.api.llamacpp.routes import NATIVE_ROUTES
from mlxcel.api.openai.chat import chat_completions
from mlxcel.api.openai.completions import completions
from mlxcel.api.openai.models import get_model, list_models
from mlxcel.api.state import AppState

ROUTES = [health, list_models, get_model, chat_completions, completions, *NATIVE_ROUTES]


def build_app(state: AppState) -> Litestar:
    def provide_state() -> AppState:
        return state

    return Litestar(
        route_handlers=ROUTES,
        dependencies={"app_state": Provide(provide_state, sync_to_thread=False)},
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: internal_error_handler,
        },
        openapi_config=None,
        debug=False,
    )
