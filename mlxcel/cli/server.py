"""`mlxcel-server`: parse the command line, resolve the model, serve.

Order matters: every refusal the command line can earn is issued before the model
reference resolves (which may mean a download) and before anything heavy is imported,
and the HTTP server listens while the model loads, answering /health with 503
"Loading model" until it is ready.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.cli.flags import parse_server_args, uvicorn_kwargs
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings

if TYPE_CHECKING:
    from mlxcel.backends.select import Choice
    from mlxcel.runtime.served import Startup

log = logging.getLogger("mlxcel.server")


def resolve_ref(settings: ServerSettings, ref: str, flag: str) -> Path:
    from mlxcel.store.paths import store_root
    from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, resolve_model

    try:
        return resolve_model(ref, root=store_root(settings.source.model_store_root, os.environ),
                             default_org=settings.source.default_org, offline=settings.source.offline,
                             hf_token=settings.source.hf_token, flag=flag)
    except (ModelSourceRefused, ModelNotAvailable) as e:
        raise StartupRefusal(str(e)) from None


def resolve(settings: ServerSettings) -> tuple[Path, Startup]:
    """The -m checkpoint and what its load needs settled first (backend, adapters, draft); every
    refusal here stops startup before the load thread starts."""
    from mlxcel.cli.options_apply import check_gpu_layers

    if not settings.source.model:
        raise StartupRefusal("no model given: pass -m <checkpoint dir | owner/name | name> (or --hf-repo)")
    path = resolve_ref(settings, settings.source.model, "--hf-repo" if settings.source.hf_repo else "-m")
    config = json.loads((path / "config.json").read_text())
    refuse_unsupported(config)
    layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    if layers:
        check_gpu_layers(settings, int(layers))
    placement = choose_backend(settings, path)
    check_model_overrides(settings, config)
    from mlxcel.cli.options_spec import check_draft, resolve_draft, spec_config
    from mlxcel.runtime.load import load_for_checkpoint
    from mlxcel.runtime.served import Startup

    lora = load_for_checkpoint(settings, path)  # read and fit-checked now: a misfit stops startup before the load
    draft = resolve_draft(settings, resolve_ref) if settings.spec.type != "none" else None
    speculative = spec_config(settings, draft)
    if draft is not None:
        check_draft(settings, path, draft, placement)
    return path, Startup(placement=placement, lora=lora, speculative=speculative)


def refuse_unsupported(config: dict) -> None:
    """A model_type the registry does not serve stops startup on config.json alone, before
    the backend is chosen or any weight is read."""
    from mlxcel.models.registry import UnsupportedModelType, family_for

    try:
        family_for(config)
    except UnsupportedModelType as e:
        raise StartupRefusal(str(e)) from None


def check_model_overrides(settings: ServerSettings, config: dict) -> None:
    """Refuse, before the load thread starts, what the checkpoint cannot take: a RoPE override
    its scheme cannot compose with, a -l token outside its vocabulary."""
    from mlxcel.models.rope_overrides import RopeRefused, config_overrides

    try:
        config_overrides(config, settings.backend.rope)
    except RopeRefused as e:
        raise StartupRefusal(str(e)) from None
    from mlxcel.engine.sampling_params import FLOAT32_MAX  # light, but keep mlxcel.engine out of import time

    n_vocab = config.get("vocab_size")
    sums: dict[int, float] = {}
    for tok, value in settings.sampling.logit_bias:
        if isinstance(n_vocab, int) and not 0 <= tok < n_vocab:
            raise StartupRefusal(f"--logit-bias {tok}: token id outside the model's vocabulary (0..{n_vocab - 1})")
        sums[tok] = sums.get(tok, 0.0) + value
        if sums[tok] > FLOAT32_MAX:  # +inf once biased: every request using the default would fail
            raise StartupRefusal(f"--logit-bias {tok}: a bias above {FLOAT32_MAX:.7g} cannot be applied "
                                 f"(use {tok}-inf to ban the token)")


def enable_fast_blas(report: bool = True):
    """Route MLX's CPU matmuls to OpenBLAS; must run before anything imports mlx.core. Returns
    what was set up; `report=False` leaves its log line to `report_blas`."""
    from mlxcel.backends.mlx.blas import BlasRefusal, ensure_fast_blas

    try:
        blas = ensure_fast_blas(os.environ)
    except BlasRefusal as e:
        raise StartupRefusal(str(e)) from None
    if report:
        report_blas(blas)
    return blas


def report_blas(blas) -> None:
    (log.warning if blas.warn else log.info)("%s", blas.detail)


def choose_backend(settings: ServerSettings, path: Path | None) -> Choice:
    """Settle --backend/--device before the load thread starts, so a refusal stops startup.
    Returns the choice (backend, device, why: the startup line, /props) for runtime `Startup`;
    settings keep what was asked for."""
    from mlxcel.runtime.load import select_backend

    choice = select_backend(settings, path)
    log.info("backend %s on %s: the model runs %s (%s)", choice.backend, choice.device, in_words(choice),
             "as --backend/--device asked" if choice.reason == "requested" else choice.reason)
    return choice


def in_words(choice: Choice) -> str:
    """Where the model computes, for someone who does not know the backend names."""
    framework = "with MLX" if choice.backend == "mlx" else "with PyTorch"
    if choice.device == "cpu":
        return f"{framework} on the CPU"
    if choice.device in ("metal", "mps"):
        return f"{framework} on the Apple GPU ({'Metal' if choice.device == 'metal' else 'MPS'})"
    if choice.device.startswith("cuda"):
        return f"{framework} on NVIDIA GPU {choice.device.partition(':')[2] or '0'} (CUDA)"
    return f"{framework} on {choice.device}"


def prepare_cpu_runtime(environ) -> None:
    """Before torch loads: idle OpenMP workers sleep instead of spinning. With spinning (the
    default) a 2-thread pool sharing 2 cores with the HTTP loop, tokenizer or other processes
    decoded 5x slower here (docs/benchmarks.md). An explicit OMP_WAIT_POLICY is kept."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None, prog: str = "mlxcel-server") -> int:
    argv = sys.argv[1:] if argv is None else argv
    settings = parse_server_args(argv, os.environ, prog=prog)  # refusals exit here
    prepare_cpu_runtime(os.environ)
    from mlxcel.cli.logging_setup import configure_logging

    configure_logging(settings)
    # its line waits until the checkpoint passed its checks, so a refusal stays the one line on stderr
    blas = enable_fast_blas(report=False)
    for notice in settings.notices:
        log.warning("%s", notice)
    from mlxcel.cli import distributed as group

    group.resolve_group(settings, os.environ)  # --tp-size / --pp-size: this process's rank
    if settings.server.vertex_predict_route:
        from mlxcel.api.app import registered_paths
        from mlxcel.api.vertex import check_predict_route

        check_predict_route(settings.server.vertex_predict_route, registered_paths())
    from mlxcel.workers.plan import plan as plan_workers

    from mlxcel.router.mode import is_router

    if is_router(settings):  # --models-dir / --models-preset without a model: the router (mlxcel/router)
        from mlxcel.cli.options_spec import refuse_unused

        refuse_unused(settings, "the router's model pool instead (--models-dir / --models-preset)")
        from mlxcel.cli.memory_plan import refuse_without_model

        refuse_without_model(settings, "is a router, loading its models on demand")
        report_blas(blas)
        serve_router(settings)
        return 0
    # mode switch: --embeddings / --reranking serve a side worker and no chat model
    plan = plan_workers(settings, lambda ref, flag: resolve_ref(settings, ref, flag))
    path, startup = resolve(settings) if plan.generation else (None, None)
    children = []
    if settings.distributed.active:
        group.refuse_checkpoint_for_group(settings, path)
        if settings.distributed.rank != 0:  # a follower serves no HTTP
            return group.follow(settings, path, startup)
        startup, children = group.lead(settings, startup, argv, os.environ)
    served = False
    try:
        code, served = _serve_lead(settings, blas, plan, path, startup), True
        return code
    finally:  # after serving the ranks get their time to leave; after a refusal they are ended now
        group.end_ranks(children, settings.distributed.timeout_s if served else 0)


def _serve_lead(settings: ServerSettings, blas, plan, path: Path | None, startup) -> int:
    """The rest of a serving start, once any ranks it leads are up (they end when this returns)."""
    from mlxcel.cli.memory_plan import plan_memory, refuse_without_model
    from mlxcel.workers.checkpoint import EMBEDDING, RERANKER

    if path is not None:
        plan_memory(settings, path, startup)  # --estimate-memory exits here
    else:
        refuse_without_model(settings, "serves no generation model (--embeddings / --reranking)")
    if path is None:
        from mlxcel.cli.options_lora import refuse_without_generation

        refuse_without_generation(settings)
        from mlxcel.cli.options_spec import refuse_unused

        refuse_unused(settings, "none (--embeddings / --reranking)")
    if path is None and any(s.kind in (EMBEDDING, RERANKER) for s in plan.sides):
        from mlxcel.runtime.served import Startup

        # an embedder / reranker runs on the same choice (Whisper is MLX's)
        startup = Startup(placement=choose_backend(settings, None))
    report_blas(blas)
    serve(settings, path, plan, startup)
    return 0


def serve(settings: ServerSettings, path: Path | None, plan=None, startup: Startup | None = None) -> None:
    import uvicorn

    from mlxcel.api.app import build_app
    from mlxcel.api.state import AppState
    from mlxcel.runtime.host import ModelHost
    from mlxcel.runtime.served import Startup
    from mlxcel.steering.store import SteeringStore
    from mlxcel.store.paths import store_root
    from mlxcel.workers.load import load_side_workers

    kwargs = uvicorn_kwargs(settings)
    sock = None
    if "uds" not in kwargs:  # bound before the load starts, so a busy port stops startup cleanly
        from mlxcel.cli.listen import bind_listener, bound_port

        sock = bind_listener(kwargs["host"], kwargs["port"], settings.server.reuse_port)
        kwargs["port"] = bound_port(sock)
    root = store_root(settings.source.model_store_root, os.environ)
    # a server started with a generation model may switch it (api/model_switch.py)
    # a group's other ranks hold shards of this model only: it is the one served (no switch)
    host = ModelHost(settings, startup or Startup(), switching=path is not None and not settings.distributed.active)
    state = AppState(settings=settings, host=host, plan=plan if plan is not None and plan.sides else None,
                     store_root=root,
                     steering_store=SteeringStore(settings.steering.state_dir or root / ".mlxcel-state"))
    app = build_app(state)
    scheme = "https" if "ssl_keyfile" in kwargs else "http"
    where = kwargs.get("uds") or f"{scheme}://{kwargs['host']}:{kwargs['port']}"

    def load() -> None:
        try:
            if path is not None:
                host.open(path)
                info = state.model.info
                log.info("model %s loaded: %s on %s/%s, compute dtype %s, context %d",
                         state.model.id, info.model_type, info.backend, info.device, info.dtype, state.model.n_ctx)
            if state.plan is not None:
                load_side_workers(state, settings, host.startup.placement)
            log.info("ready: serving requests on %s", where)
        except Exception as e:  # keep serving /health's 503 and say why
            state.load_error = str(e)
            log.exception("model load failed; %s answers /health with 503 and the reason", where)

    log.info("listening on %s%s; loading the model (/health answers 503 until it is ready)", where,
             " (SO_REUSEPORT)" if settings.server.reuse_port and sock is not None else "")
    loader = threading.Thread(target=load, name="mlxcel-load", daemon=True)
    loader.start()
    from mlxcel.api.side_workers import close_worker_queues
    from mlxcel.cli.shutdown import DrainingServer

    def end_all(reason: str) -> None:  # the drain ran out: every request and side-worker job ends with `reason`
        close_worker_queues(state, reason)
        host.close(reason)

    server = DrainingServer(uvicorn.Config(app, log_level="warning", **kwargs), settings.server.shutdown_timeout,
                            end_all)
    server.run(sockets=[sock] if sock is not None else None)
    host.close()
    if loader.is_alive():  # stopped mid-load: the interpreter's exit would abort inside the framework's loader
        log.info("exiting before the model finished loading")
        logging.shutdown()
        os._exit(0)


def serve_router(settings: ServerSettings) -> None:
    """Router mode: the registry is read (and every preset value checked) before listening;
    models load on demand, or at startup for presets that ask."""
    import uvicorn

    from mlxcel.router.asgi import RouterApp
    from mlxcel.router.pool import RouterPool
    from mlxcel.cli.flags import model_settings
    from mlxcel.router.preset import parse_preset
    from mlxcel.router.registry import RegistryError
    from mlxcel.api.security import wrap_app
    from mlxcel.steering.store import SteeringStore
    from mlxcel.store.paths import store_root

    from mlxcel.runtime.load import select_backend

    select_backend(settings, None)  # an explicit --backend / --device that cannot be honoured stops here;
    # each model settles "auto" for its own checkpoint when it loads (a quantization mode only MLX runs)
    root = store_root(settings.source.model_store_root, os.environ)
    preset = parse_preset(settings.router.models_preset) if settings.router.models_preset is not None else None
    try:
        pool = RouterPool(settings, root, preset, model_settings,
                          SteeringStore(settings.steering.state_dir or root / ".mlxcel-state"))
    except RegistryError as e:
        raise StartupRefusal(str(e)) from None
    for slot in pool.slots.values():
        model_settings(settings, slot.entry.sections)  # a bad preset value refuses now, not at first load
    log.info("router mode: %d models (%s); --models-max %d, autoload %s", len(pool.slots),
             ", ".join(sorted(pool.slots)) or "none", settings.router.models_max,
             "on" if settings.router.models_autoload else "off")
    kwargs = uvicorn_kwargs(settings)
    from mlxcel.api.request_log import RequestLog

    from mlxcel.api.webui.routes import with_webui

    app = RequestLog(wrap_app(with_webui(RouterApp(pool), settings), settings))
    from mlxcel.cli.shutdown import DrainingServer

    class RouterServer(DrainingServer):
        def handle_exit(self, sig, frame) -> None:  # an open /models/sse stream must not hold shutdown up
            super().handle_exit(sig, frame)
            pool.close_subscribers()

    try:
        sock = None
        if "uds" not in kwargs:
            from mlxcel.cli.listen import bind_listener, bound_port

            sock = bind_listener(kwargs["host"], kwargs["port"], settings.server.reuse_port)
            kwargs["port"] = bound_port(sock)
            log.info("listening on http%s://%s:%s (router)", "s" if "ssl_keyfile" in kwargs else "",
                     kwargs["host"], kwargs["port"])
        RouterServer(uvicorn.Config(app, log_level="warning", **kwargs), settings.server.shutdown_timeout,
                     pool.shutdown).run(sockets=[sock] if sock is not None else None)
    finally:
        pool.shutdown()


if __name__ == "__main__":
    sys.exit(main())
