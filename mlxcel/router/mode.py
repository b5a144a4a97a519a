"""When the server runs as a router, and the command lines router mode refuses.

Checked while parsing (cli/flags.py), before anything resolves or loads: a model argument
next to --models-dir or --models-preset is ambiguous and refused, as is a side-worker or
Vertex AI mode, which the router does not carry into its models.
"""

from __future__ import annotations

from typing import Any

from mlxcel.config.refusal import StartupRefusal


def is_router(settings: Any) -> bool:
    router = settings.router
    return (router.models_dir is not None or router.models_preset is not None) and not settings.source.model


def check_router_mode(settings: Any) -> None:
    if settings.router.models_dir is not None and settings.source.model:
        raise StartupRefusal(
            f"--models-dir {settings.router.models_dir}: selects router mode (every model of that directory served on "
            f"demand) and cannot be combined with a model argument ({settings.source.model}); the local model store a "
            "model argument resolves against is --model-store-root")
    if settings.router.models_preset is not None and settings.source.model:
        raise StartupRefusal(
            f"--models-preset {settings.router.models_preset}: presets configure router mode and steer nothing when a "
            f"model argument ({settings.source.model}) is given; drop the model argument to serve the presets")
    if not is_router(settings):
        for key, spelling in (("models_max", "--models-max"), ("models_autoload", "--models-autoload")):
            if key in settings.cli_given:  # accepted as b10621 accepts it, but said out loud
                settings.notices.append(f"{spelling} applies to router mode only (--models-dir / --models-preset "
                                        "without a model); it has no effect on a single-model server")
        return
    if settings.router.models_dir is not None and not settings.router.models_dir.is_dir():
        raise StartupRefusal(f"--models-dir {settings.router.models_dir}: no such directory")
    if settings.router.models_preset is not None and not settings.router.models_preset.is_file():
        raise StartupRefusal(f"--models-preset {settings.router.models_preset}: no such file")
    if settings.source.any_model_name:
        raise StartupRefusal("--any-model-name: in router mode the requested name picks the model, so no name can "
                             "stand for another; drop it or serve one model with -m")
    for on, spelling in ((settings.workers.embedding, "--embeddings"), (settings.workers.reranking, "--reranking"),
                         (settings.workers.embedding_model, "--embedding-model"),
                         (settings.workers.reranker_model, "--reranker-model"),
                         (settings.server.vertex_predict_route, "AIP_MODE=PREDICTION")):
        if on:
            raise StartupRefusal(f"{spelling}: router mode (--models-dir / --models-preset) serves generation "
                                 "models only; start a separate server for this mode")
