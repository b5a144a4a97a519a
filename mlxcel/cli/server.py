"""`mlxcel-server`: parse the command line, resolve the model, serve.

Order matters: every refusal the command line can earn is issued before the model
reference resolves (which may mean a download), and the HTTP server listens while the
model loads, answering /health with 503 "Loading model" until it is ready.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from mlxcel.api.state import AppState
from mlxcel.runtime import load_served_model
from mlxcel.cli.flags import StartupRefusal, parse_server_args
from mlxcel.cli.settings import ServerSettings
from mlxcel.store.paths import store_root
from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, resolve_model

log = logging.getLogger("mlxcel.server")

def main(argv: list[str] | None = None, prog: str = "mlxcel-server") -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_server_args(argv, os.environ)
        if not settings.model:
            raise StartupRefusal("no model given: pass -m <checkpoint dir | owner/name | name>")
        root = store_root(settings.model_store_root, os.environ)
        path = resolve_model(settings.model, root=root, default_org=settings.default_org,
                             offline=settings.offline, hf_token=settings.hf_token)
    except (ModelSourceRefused, ModelNotAvailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StartupRefusal as e:
        print(e.code, file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, path)
    return 0


def serve(settings: ServerSettings, path: Path) -> None:
    import uvicorn

    from mlxcel.api.app import build_app

    state = AppState(settings=settings)

    def load() -> None:
        try:
            state.model = load_served_model(settings, path)
            info = state.model.info
            log.info("model %s loaded: %s on %s/%s, compute dtype %s, context %d",
                     state.model.id, info.model_type, info.backend, info.device, info.dtype, state.model.n_ctx)
        except Exception as e:  # keep serving /health's 503 and say why
            state.load_error = str(e)
            log.exception("model load failed")

    threading.Thread(target=load, name="mlxcel-load", daemon=True).start()
    app = build_app(state)
    kwargs = dict(host=settings.host, port=settings.port, log_level="warning",
                  timeout_keep_alive=5)
    if settings.host.endswith(".sock"):
        kwargs = dict(uds=settings.host, log_level="warning")
    log.info("listening on %s", settings.host if settings.host.endswith(".sock") else f"http://{settings.host}:{settings.port}")
    uvicorn.run(app, **kwargs)
    if state.model is not None:
        state.model.engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
