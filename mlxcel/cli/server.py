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

from mlxcel.api.state import AppState, ServedModel
from mlxcel.cli.flags import StartupRefusal, parse_server_args
from mlxcel.cli.settings import ServerSettings
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.store.paths import store_root
from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, resolve_model

log = logging.getLogger("mlxcel.server")

# b10621's sampling defaults, used when neither a flag nor generation_config.json says.
B10621_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def resolve_sampling_defaults(settings: ServerSettings, gen_defaults) -> SamplingParams:
    """Flag > checkpoint generation_config.json > b10621 default."""
    def pick(flag, ckpt, default):
        return flag if flag is not None else (ckpt if ckpt is not None else default)

    b = B10621_SAMPLING
    return SamplingParams(
        temperature=pick(settings.temperature, gen_defaults.temperature, b.temperature),
        top_k=pick(settings.top_k, gen_defaults.top_k, b.top_k),
        top_p=pick(settings.top_p, gen_defaults.top_p, b.top_p),
        min_p=pick(settings.min_p, gen_defaults.min_p, b.min_p),
        seed=settings.seed if settings.seed >= 0 else None,
    )


def load_served_model(settings: ServerSettings, path: Path) -> ServedModel:
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.engine import Engine
    from mlxcel.engine.tokenizer import Tokenizer

    backend = MLXBackend(path, dtype=settings.dtype)
    tokenizer = Tokenizer(path)
    n_ctx = settings.ctx_size if settings.ctx_size > 0 else backend.info.context_length
    engine = Engine(backend, tokenizer, n_ctx=n_ctx, parallel=settings.parallel, batch_size=settings.batch_size)
    if settings.warmup:
        from mlxcel.backends.base import ForwardRow

        backend.forward([ForwardRow([0], backend.new_sequence())])  # first-call costs off the request path
    engine.start()
    aliases = list(settings.alias)
    return ServedModel(
        id=aliases[0] if aliases else settings.model,
        aliases=aliases,
        info=backend.info,
        tokenizer=tokenizer,
        engine=engine,
        defaults=resolve_sampling_defaults(settings, tokenizer.generation_defaults),
        n_ctx=n_ctx,
        n_predict=settings.n_predict,
    )


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
